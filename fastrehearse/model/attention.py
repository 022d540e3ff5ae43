"""Causal attention with explicit document boundaries, plugged into transformers by name.

A packed row holds several episodes back to back; `cu_seq_lens_q` (int32 [B+1], the cumulative
episode lengths) says where each starts, and every query may only see keys of its own episode:

    out[t] = sum_{s in doc(t), s <= t} softmax_s(q_t . k_s * scale) v_s

We never rely on transformers' implicit "packed sequence" detection from position_ids (it let
documents attend to each other in a CPU check, see ENVIRONMENT.md). Instead the function below is
registered as the attention implementation ATTN_IMPL ("fastrehearse_varlen") and reads the
boundaries from the forward kwargs transformers already threads to every attention call
(`cu_seq_lens_q/k`, `max_length_q/k`, the same names its flash-attention path uses).

Backends, first available wins (override with FASTREHEARSE_ATTN_BACKEND=flash_attn|torch_varlen|sdpa):
  flash_attn    flash_attn.flash_attn_varlen_func (CUDA, fp16/bf16)
  torch_varlen  torch.nn.attention.varlen.varlen_attn (CUDA, fp16/bf16; torch >= 2.10)
  sdpa          torch SDPA once per document with is_causal=True (any device/dtype; the CPU path;
                costs sum n_i^2 like the varlen kernels, never T^2)

Mask creation: transformers builds a mask per forward through ALL_MASK_ATTENTION_FUNCTIONS. For a
packed training forward (no padding mask, no KV cache) our mask function returns None, so no
[T, T] mask is materialized. With a padding mask or a KV cache (generation) it defers to the
SDPA mask and the attention function defers to transformers' SDPA, so the same model object can
also be used for batched generation.
"""
from __future__ import annotations

import inspect
import os

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTN_IMPL = "fastrehearse_varlen"
BACKENDS = ("auto", "flash_attn", "torch_varlen", "sdpa")

try:  # optional GPU extra
    from flash_attn import flash_attn_varlen_func as _flash_varlen  # type: ignore
except Exception:  # pragma: no cover - not installable on CPU CI
    _flash_varlen = None

# torch.nn.attention.varlen (torch >= 2.10) imports torch._dynamo, ~3 s: loaded on first CUDA use
# only, so CPU runs and `fastrehearse --help` do not pay for it.
_UNLOADED = object()
_torch_varlen = _UNLOADED
_TV_PARAMS: set = set()


def _get_torch_varlen():
    """torch's varlen_attn, or None when this torch has none (imported once, lazily)."""
    global _torch_varlen, _TV_PARAMS
    if _torch_varlen is _UNLOADED:
        try:
            from torch.nn.attention.varlen import varlen_attn
            _torch_varlen, _TV_PARAMS = varlen_attn, set(inspect.signature(varlen_attn).parameters)
        except Exception:  # pragma: no cover - torch < 2.10
            _torch_varlen, _TV_PARAMS = None, set()
    return _torch_varlen


def available_backends(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> list[str]:
    dev = torch.device(device)
    out = []
    if dev.type == "cuda" and dtype in (torch.float16, torch.bfloat16):
        if _flash_varlen is not None:
            out.append("flash_attn")
        if _get_torch_varlen() is not None:
            out.append("torch_varlen")
    out.append("sdpa")
    return out


def _pick_backend(q: torch.Tensor, dropout: float) -> str:
    want = os.environ.get("FASTREHEARSE_ATTN_BACKEND", "auto")
    if want not in BACKENDS:
        raise ValueError(f"FASTREHEARSE_ATTN_BACKEND must be one of {BACKENDS}, got {want!r}")
    avail = available_backends(q.device, q.dtype)
    if dropout > 0:  # torch's varlen_attn has no dropout
        avail = [b for b in avail if b != "torch_varlen"]
    if want == "auto":
        return avail[0]
    if want not in avail:
        raise ValueError(f"attention backend {want!r} is not available for {q.device.type}/{q.dtype} "
                         f"(available: {avail})")
    return want


def varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,          # [1, Hq, T, D]
    key: torch.Tensor,            # [1, Hkv, T, D]
    value: torch.Tensor,          # [1, Hkv, T, D]
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention-interface function; returns ([1, T, Hq, D], None)."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        return _unpacked_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    if kwargs.get("sliding_window") is not None:
        raise NotImplementedError(f"{ATTN_IMPL}: sliding-window attention is not supported "
                                  f"(layer {getattr(module, 'layer_idx', '?')} has sliding_window="
                                  f"{kwargs['sliding_window']})")
    cu_k = kwargs.get("cu_seq_lens_k")
    if cu_k is not None and cu_k is not cu and not torch.equal(cu_k, cu):
        raise ValueError(f"{ATTN_IMPL}: cu_seq_lens_k must equal cu_seq_lens_q (self-attention)")
    if attention_mask is not None:
        raise ValueError(f"{ATTN_IMPL}: got both cu_seq_lens_q and an attention_mask; a packed row "
                         "carries its boundaries in cu_seq_lens_q only (pass attention_mask=None)")
    if query.shape[0] != 1:
        raise ValueError(f"{ATTN_IMPL}: a packed batch is one row, got batch size {query.shape[0]}")
    T = query.shape[2]
    if not cu.is_cuda and int(cu[-1]) != T:  # checked only where it costs no device sync
        raise ValueError(f"{ATTN_IMPL}: cu_seq_lens_q ends at {int(cu[-1])} but the row has {T} tokens")
    max_len = kwargs.get("max_length_q")
    max_len = int(max_len) if max_len is not None else T
    dropout = dropout if module.training else 0.0
    backend = _pick_backend(query, dropout)

    n_rep = query.shape[1] // key.shape[1]
    if backend == "sdpa":
        out = _sdpa_per_document(query, key, value, cu, dropout, scaling, n_rep)
        return out.transpose(1, 2).contiguous(), None

    return _varlen_kernel(backend, query, key, value, cu, max_len, dropout, scaling, n_rep), None


def _varlen_kernel(backend, query, key, value, cu, max_len, dropout, scaling, n_rep):
    """[1, H, T, D] inputs -> [1, T, Hq, D] through flash-attn's or torch's varlen kernel."""
    # The varlen kernels take [T, H, D].
    q = query[0].transpose(0, 1).contiguous()
    k = key[0].transpose(0, 1).contiguous()
    v = value[0].transpose(0, 1).contiguous()
    cu32 = cu.to(torch.int32)
    if backend == "flash_attn":  # GQA native
        out = _flash_varlen(q, k, v, cu32, cu32, max_len, max_len, dropout_p=dropout,
                            softmax_scale=scaling, causal=True)
    elif backend == "torch_varlen":
        # Its keyword arguments changed across torch releases (is_causal -> window_size; scale and
        # enable_gqa added later): pass what this torch has.
        fn = _get_torch_varlen()
        kw = {}
        if "scale" in _TV_PARAMS:
            kw["scale"] = scaling
        elif scaling is not None and abs(scaling - q.shape[-1] ** -0.5) > 1e-12:
            raise ValueError(f"{ATTN_IMPL}: this torch's varlen_attn has no `scale` argument")
        if "window_size" in _TV_PARAMS:
            kw["window_size"] = (-1, 0)  # causal
        else:
            kw["is_causal"] = True
        if n_rep > 1:
            if "enable_gqa" in _TV_PARAMS:
                kw["enable_gqa"] = True
            else:
                k = k.repeat_interleave(n_rep, dim=1)
                v = v.repeat_interleave(n_rep, dim=1)
        out = fn(q, k, v, cu32, cu32, max_len, max_len, **kw)
    else:
        raise ValueError(f"unknown varlen backend {backend!r}")
    return out.unsqueeze(0)


def _sdpa_per_document(q, k, v, cu, dropout, scaling, n_rep):
    """q [1, Hq, T, D] -> [1, Hq, T, D]: SDPA once per document, causal inside it."""
    bounds = cu.tolist()  # one host sync per layer; free on CPU
    sizes = [e - s for s, e in zip(bounds[:-1], bounds[1:])]
    gqa = {"enable_gqa": True} if n_rep > 1 else {}
    # split (not slicing): its backward is one concatenation, while each slice's backward would
    # allocate and zero a full [1, H, T, D] gradient (O(documents x T) per layer).
    outs = [F.scaled_dot_product_attention(qd, kd, vd, dropout_p=dropout, is_causal=True, scale=scaling, **gqa)
            for qd, kd, vd in zip(q.split(sizes, dim=2), k.split(sizes, dim=2), v.split(sizes, dim=2))
            if qd.shape[2] > 0]
    return torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]


def _unpacked_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs):
    """No boundaries given: an ordinary (possibly padded / cached) forward, e.g. generation.

    Refuse rows whose position_ids restart (a packed row without cu_seq_lens_q would leak across
    documents) instead of silently attending across episodes.
    """
    pos = kwargs.get("position_ids")
    if (attention_mask is None and pos is not None and query.shape[2] > 1 and pos.shape[-1] > 1
            and not bool((pos[..., 1:] - pos[..., :-1] == 1).all())):
        raise ValueError(f"{ATTN_IMPL}: position_ids restart inside the row (a packed batch) but no "
                         "cu_seq_lens_q was given; use fastrehearse.model.hidden_states(model, batch)")
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                  scaling=scaling, **kwargs)


def varlen_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, attention_mask=None, **kwargs):
    """Mask function registered for ATTN_IMPL: nothing for a packed training forward, else SDPA's."""
    no_cache = isinstance(q_offset, int) and q_offset == 0 and kv_offset == 0 and kv_length == q_length
    if attention_mask is None and no_cache:
        return None
    return sdpa_mask(batch_size, q_length, kv_length, q_offset=q_offset, kv_offset=kv_offset,
                     attention_mask=attention_mask, **kwargs)


def register() -> str:
    """Register ATTN_IMPL with transformers (idempotent); returns its name."""
    AttentionInterface.register(ATTN_IMPL, varlen_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPL, varlen_mask)
    return ATTN_IMPL


def use_varlen_attention(model) -> None:
    """Switch a transformers model (and its submodules) to ATTN_IMPL."""
    register()
    model.set_attn_implementation(ATTN_IMPL)
