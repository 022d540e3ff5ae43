"""From a PackedBatch to final hidden states (never logits), and the nn.Module the trainer shards.

hidden_states() calls the *base* model (e.g. LlamaModel, after its final norm), not the CausalLM
head: the [T, V] logits are the one object an RL step cannot afford, so the LM-head projection is
left to the fused kernels (fastrehearse.kernels.linear_logprobs / linear_policy_loss), which read
the head weight from lm_head_weight() and, for a head that is more than a weight (Gemma 2/3's
final soft-cap, Cohere's / Granite's logit scale, an lm_head bias), head_kwargs(), read from the
one head spec (fastrehearse.model.lm_head, which the TRL adapter reads too). A head the kernels
cannot reproduce is refused (check_lm_head), never scored wrong.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fastrehearse.kernels import linear_logprobs
from fastrehearse.kernels.roles import Role
from fastrehearse.packing.batch import PackedBatch

from . import lm_head
from .attention import ATTN_IMPL, use_varlen_attention
from .lm_head import head_module as _head_module


def base_model(model: nn.Module) -> nn.Module:
    """The decoder stack of a transformers CausalLM (the module whose output is after the final norm)."""
    if isinstance(model, RehearsalModel):
        model = model.model
    inner = getattr(model, "base_model", None)
    if inner is None or inner is model:
        # already a base model (e.g. LlamaModel) or an unusual wrapper
        if hasattr(model, "layers") and hasattr(model, "norm"):
            return model
        raise ValueError(f"cannot find the decoder stack of {type(model).__name__}")
    return inner


# Settings inside the decoder that the packed varlen attention does not implement.
_ATTN_KEYS = ("attn_logit_softcapping",)


def _unwrap(model: nn.Module) -> nn.Module:
    return model.model if isinstance(model, RehearsalModel) else model


def head_settings(model: nn.Module) -> dict[str, float]:
    """{'logit_scale': a, 'logit_softcap': c} from the HF config (only the entries that are set),
    read by the one head spec (`fastrehearse.model.lm_head`, shared with the TRL adapter).

    Raises ValueError naming the setting when the model transforms its logits in a way the
    kernels cannot express (or that fastrehearse does not know how this model applies), or sets an
    attention option the packed varlen attention does not implement.
    """
    model = _unwrap(model)
    out = lm_head.head_settings(model)
    cfg = model.config
    for key in _ATTN_KEYS:
        if getattr(cfg, key, None) is not None:
            raise ValueError(
                f"{type(model).__name__} ({getattr(cfg, 'model_type', '?')}) config sets "
                f"{key}={getattr(cfg, key)!r}: the packed varlen attention ({ATTN_IMPL}) does not "
                f"implement it; refusing the model rather than computing wrong hidden states")
    return out


def check_lm_head(model: nn.Module) -> None:
    """Refuse (ValueError naming the setting) a model whose logits the kernels cannot reproduce.
    Call it right after loading; RehearsalModel and token_logprobs call it too."""
    head_settings(model)


def head_kwargs(model: nn.Module) -> dict[str, Any]:
    """Keyword arguments for fastrehearse.kernels (bias, logit_scale, logit_softcap) that make the
    kernels compute this model's own logits; {} for a plain linear head. Read it inside the FSDP
    root module's forward (as the weight) so the bias is the unsharded tensor."""
    model = _unwrap(model)
    head_settings(model)                 # the trainer's own refusals (attention options) too
    return lm_head.head_kwargs(model)


def lm_head_weight(model: nn.Module) -> torch.Tensor:
    """The [V, H] LM-head weight (the input embedding when the model ties them).

    Under FSDP2 read it inside the root module's forward (RehearsalModel.forward does), where it is
    the unsharded plain tensor, not a DTensor shard. A model whose head is more than this weight
    (a bias, a logit scale or soft-cap) is refused here: use head_kwargs(model) next to it.
    """
    model = _unwrap(model)
    kw = head_kwargs(model)
    if kw:
        raise ValueError(f"{type(model).__name__}'s LM head is not just a weight "
                         f"({_describe(kw)}): pass fastrehearse.model.head_kwargs(model) to the "
                         f"kernels together with the weight")
    return _head_module(model).weight


def _describe(kw: dict[str, Any]) -> str:
    return ", ".join("a bias" if k == "bias" else f"{k}={v}" for k, v in kw.items())


def _accepts_head_kwargs(fn: Callable, names) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return True
    names_ok = {p.name for p in params if p.kind in (inspect.Parameter.KEYWORD_ONLY,
                                                    inspect.Parameter.POSITIONAL_OR_KEYWORD)}
    return set(names) <= names_ok


def _check_attn(model: nn.Module) -> None:
    impl = getattr(model.config, "_attn_implementation", None)
    if impl != ATTN_IMPL:
        raise ValueError(
            f"model uses attention implementation {impl!r}, which does not isolate the episodes of a packed "
            f"row; load it with fastrehearse.model.load_model or call "
            f"fastrehearse.model.use_varlen_attention(model) (sets {ATTN_IMPL!r})")


def varlen_kwargs(batch: PackedBatch, device: torch.device) -> dict[str, Any]:
    cu = batch.cu_seqlens.to(device=device, dtype=torch.int32, non_blocking=True)
    return dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=int(batch.max_seqlen),
                max_length_k=int(batch.max_seqlen))


def hidden_states(model: nn.Module, batch: PackedBatch) -> torch.Tensor:
    """[T, H] final hidden states (after the final norm) of a packed row."""
    base = base_model(model)
    _check_attn(base)
    dev = base.get_input_embeddings().weight.device
    if batch.input_ids.dim() != 2 or batch.input_ids.shape[0] != 1:
        raise ValueError(f"batch.input_ids must be [1, T], got {tuple(batch.input_ids.shape)}")
    out = base(input_ids=batch.input_ids.to(dev, non_blocking=True),
               position_ids=batch.position_ids.to(dev, non_blocking=True),
               attention_mask=None, use_cache=False, **varlen_kwargs(batch, dev))
    return out.last_hidden_state[0]


def loss_mask(batch: PackedBatch, *, all_tokens: bool = False) -> torch.Tensor:
    """[T] bool: positions whose target is loss-bearing (role != CONTEXT), or, with all_tokens, every
    position that has a next token inside its episode (all but the last of each episode)."""
    if not all_tokens:
        return batch.roles != Role.CONTEXT
    m = torch.ones(batch.num_tokens, dtype=torch.bool, device=batch.roles.device)
    m[batch.cu_seqlens[1:].to(torch.long) - 1] = False
    return m


def token_logprobs(model: nn.Module, batch: PackedBatch, *, all_tokens: bool = False,
                   backend: str = "auto", temperature: float = 1.0) -> torch.Tensor:
    """[T] float32 log p(targets[t] | tokens <= t of the same episode) via the fused kernel.

    Only loss-bearing positions (target role != CONTEXT) are computed unless all_tokens; the others
    are exactly 0 (they cost no vocabulary projection). The model's head settings (bias, logit
    scale, final soft-cap) are applied as its own forward does (see head_kwargs).
    """
    head = head_kwargs(model)            # refuses a head the kernels cannot express
    h = hidden_states(model, batch)
    w = _head_module(_unwrap(model)).weight
    mask = loss_mask(batch, all_tokens=all_tokens).to(h.device)
    logp, _ = linear_logprobs(h, w, batch.targets.to(h.device), mask=mask, temperature=temperature,
                              backend=backend, **head)
    return logp


class RehearsalModel(nn.Module):
    """What the trainer wraps with FSDP2: a transformers CausalLM plus a loss head called inside forward.

        model = RehearsalModel(hf_model)
        for layer in model.layers: fully_shard(layer)
        fully_shard(model)
        out = model(batch, lambda h, w: linear_policy_loss(h, w, ...))

    Inside forward the root FSDP unit's parameters (embedding, final norm, LM head) are gathered,
    so `head_fn` receives the LM-head weight as a plain tensor (and, for a head with a bias, logit
    scale or soft-cap, those as keyword arguments: see forward). With head_fn=None forward returns
    the [T, H] hidden states.
    """

    def __init__(self, hf_model: nn.Module, *, activation_checkpointing: bool = False):
        super().__init__()
        check_lm_head(hf_model)   # refuse an inexpressible head now, not mid-training
        self.model = hf_model
        use_varlen_attention(hf_model)
        if activation_checkpointing:
            self.enable_activation_checkpointing()

    @property
    def layers(self) -> nn.ModuleList:
        """The decoder layers (FSDP2 units, activation-checkpointing units)."""
        return base_model(self.model).layers

    @property
    def config(self):
        return self.model.config

    def enable_activation_checkpointing(self) -> None:
        """Recompute each decoder layer in backward (training mode only).

        Uses transformers' GradientCheckpointingLayer (non-reentrant torch.utils.checkpoint): it
        checkpoints the layer's forward with all keyword arguments, so cu_seq_lens_* reach the
        recomputation too, and it stays inside FSDP2's per-layer hooks.
        """
        kw = {"use_reentrant": False}
        if hasattr(self.model, "activation_checkpointing_enable"):  # transformers >= 5.2x
            self.model.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
        else:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)

    @property
    def activation_checkpointing(self) -> bool:
        return any(getattr(layer, "gradient_checkpointing", False) for layer in self.layers)

    def lm_head_weight(self) -> torch.Tensor:
        return lm_head_weight(self.model)

    def forward(self, batch: PackedBatch,
                head_fn: Callable[..., Any] | None = None) -> Any:
        """head_fn(hidden, weight) for a plain linear head; head_fn(hidden, weight, **head) when the
        model's head has a bias / logit scale / soft-cap (head = head_kwargs(model), to be passed on
        to the fastrehearse.kernels call). A head_fn that cannot take them is refused."""
        h = hidden_states(self.model, batch)
        if head_fn is None:
            return h
        head = head_kwargs(self.model)
        weight = _head_module(self.model).weight
        if not head:
            return head_fn(h, weight)
        if not _accepts_head_kwargs(head_fn, head):
            raise ValueError(
                f"{type(self.model).__name__}'s LM head has {_describe(head)}, but head_fn does not "
                f"accept the keyword arguments {sorted(head)}: write it as "
                f"`lambda h, w, **head: <kernel>(h, w, ..., **head)` so the kernel scores this "
                f"model's real logits")
        return head_fn(h, weight, **head)
