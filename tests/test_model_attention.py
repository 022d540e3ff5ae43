"""The CUDA varlen glue (layouts, int32 boundaries, causal/GQA/scale arguments across torch versions),
checked on CPU by standing in float64 reference kernels with the real call signatures.

The kernels themselves (flash-attn, torch varlen_attn) only run on CUDA; what can go wrong on our
side is the [1, H, T, D] <-> [T, H, D] transposes, GQA handling and which keyword means "causal" in
which torch release. The per-document SDPA path used on CPU is compared with transformers' eager
attention in test_model.py.
"""
import pytest
import torch

import fastrehearse.model.attention as attn

T_LENS = [5, 1, 17, 9]
HQ, HKV, D = 6, 2, 8


def ref_varlen(q, k, v, cu, scale, causal=True):
    """[T, Hq, D], [T, Hkv, D] -> [T, Hq, D], float64, per document, causal."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    out = torch.empty_like(q, dtype=torch.float64)
    b = cu.tolist()
    for s, e in zip(b[:-1], b[1:]):
        qs, ks, vs = (x[s:e].double().transpose(0, 1) for x in (q, k, v))  # [H, n, D]
        z = qs @ ks.transpose(1, 2) * scale
        if causal:
            z = z.masked_fill(~torch.ones(e - s, e - s, dtype=torch.bool).tril(), float("-inf"))
        out[s:e] = (z.softmax(-1) @ vs).transpose(0, 1)
    return out.to(q.dtype)


def check_call(q, k, v, cu_q, cu_k, max_q, max_k):
    assert q.dim() == 3 and q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
    assert cu_q.dtype == torch.int32 and torch.equal(cu_q, cu_k)
    assert max_q == max_k == max(T_LENS)


def fake_torch_varlen_new(q, k, v, cu_q, cu_k, max_q, max_k, *, return_aux=None, scale=None,
                          window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None,
                          num_splits=None):
    check_call(q, k, v, cu_q, cu_k, max_q, max_k)
    assert tuple(window_size) == (-1, 0), "causal must be requested"
    assert enable_gqa == (q.shape[1] != k.shape[1])
    return ref_varlen(q, k, v, cu_q, scale if scale is not None else q.shape[-1] ** -0.5)


def fake_torch_varlen_old(q, k, v, cu_q, cu_k, max_q, max_k, *, is_causal=False, return_aux=None):
    check_call(q, k, v, cu_q, cu_k, max_q, max_k)
    assert is_causal
    assert q.shape[1] == k.shape[1], "no GQA in this torch: k/v must be repeated"
    return ref_varlen(q, k, v, cu_q, q.shape[-1] ** -0.5)


def fake_flash(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=None, causal=False):
    check_call(q, k, v, cu_q, cu_k, max_q, max_k)
    assert causal and dropout_p == 0.0
    return ref_varlen(q, k, v, cu_q, softmax_scale)


class Attn(torch.nn.Module):
    num_key_value_groups = HQ // HKV
    layer_idx = 0


def run(backend, monkeypatch, scaling):
    g = torch.Generator().manual_seed(0)
    T = sum(T_LENS)
    # the layout transformers hands us: [1, H, T, D] views of [1, T, H, D] storage
    q = torch.randn(1, T, HQ, D, generator=g).transpose(1, 2)
    k = torch.randn(1, T, HKV, D, generator=g).transpose(1, 2)
    v = torch.randn(1, T, HKV, D, generator=g).transpose(1, 2)
    cu = torch.tensor([0] + torch.tensor(T_LENS).cumsum(0).tolist(), dtype=torch.int32)
    monkeypatch.setattr(attn, "_pick_backend", lambda *a: backend)
    out, _ = attn.varlen_attention_forward(Attn().eval(), q, k, v, None, scaling=scaling, cu_seq_lens_q=cu,
                                           cu_seq_lens_k=cu, max_length_q=max(T_LENS), max_length_k=max(T_LENS))
    assert out.shape == (1, T, HQ, D)
    want = ref_varlen(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu,
                      scaling if scaling is not None else D ** -0.5)
    torch.testing.assert_close(out[0], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scaling", [None, 0.3])
def test_sdpa_backend_matches_reference(monkeypatch, scaling):
    run("sdpa", monkeypatch, scaling)


@pytest.mark.parametrize("scaling", [None, 0.3])
def test_torch_varlen_glue_new_signature(monkeypatch, scaling):
    import inspect
    monkeypatch.setattr(attn, "_torch_varlen", fake_torch_varlen_new)
    monkeypatch.setattr(attn, "_TV_PARAMS", set(inspect.signature(fake_torch_varlen_new).parameters))
    run("torch_varlen", monkeypatch, scaling)


def test_torch_varlen_glue_old_signature(monkeypatch):
    import inspect
    monkeypatch.setattr(attn, "_torch_varlen", fake_torch_varlen_old)
    monkeypatch.setattr(attn, "_TV_PARAMS", set(inspect.signature(fake_torch_varlen_old).parameters))
    run("torch_varlen", monkeypatch, None)
    with pytest.raises(ValueError, match="has no `scale` argument"):
        run("torch_varlen", monkeypatch, 0.3)


@pytest.mark.parametrize("scaling", [None, 0.3])
def test_flash_attn_glue(monkeypatch, scaling):
    monkeypatch.setattr(attn, "_flash_varlen", fake_flash)
    run("flash_attn", monkeypatch, scaling if scaling is not None else D ** -0.5)


def test_backend_choice():
    assert attn.available_backends("cpu", torch.float32) == ["sdpa"]
    assert attn.available_backends("cuda", torch.float32) == ["sdpa"]  # varlen kernels: fp16/bf16 only


def test_backend_env_errors(monkeypatch):
    q = torch.zeros(1, 2, 3, 4)
    monkeypatch.setenv("FASTREHEARSE_ATTN_BACKEND", "flash_attn")
    with pytest.raises(ValueError, match="attention backend 'flash_attn' is not available for cpu"):
        attn._pick_backend(q, 0.0)
    monkeypatch.setenv("FASTREHEARSE_ATTN_BACKEND", "xformers")
    with pytest.raises(ValueError, match="FASTREHEARSE_ATTN_BACKEND must be one of"):
        attn._pick_backend(q, 0.0)
