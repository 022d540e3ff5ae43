"""Fused LM-head projection + log-prob (+ entropy) of the target tokens, without N x V logits.

    logp[i] = log_softmax(head(hidden[i] @ weight.T) / T)[targets[i]]
    ent[i]  = -sum_j p_ij log p_ij                               (when with_entropy)

head() is the identity unless an LM-head variant is given (bias, logit_scale, logit_softcap: see
_head.py); a variant other than a lone positive scale runs the row-chunked path on every backend.

Algorithm (see docs/kernels.md):
1. compact: only rows with mask[i] = True enter the projection (masked rows cost nothing);
2. chunk the compacted rows so one fp32 [C, V] logits block fits a byte budget;
   forward per chunk: Z = X_c W^T (GEMM, fp32 result) -> row stats (lse, logp, entropy);
3. backward, vocabulary-outer (_vocab_outer.py): per row group (all rows when the workspace
   budget allows) and vocabulary block, recompute Z_b, dZ_b = dL/dZ_b (row kernel), then
   dX_acc += dZ_b W_b (fp32 [R, H]) and dW_b = dZ_b^T X (K = R: each dW block written once,
   no V x H fp32 read-modify-write). The torch backend without head variants instead runs the
   vocabulary-blocked code of _blocked.py (same loop order, CPU-tuned).
Forward 2NHV FLOPs, backward 6NHV (recompute + two GEMMs): upstream gradients are arbitrary, so
dZ cannot be formed in the forward. `linear_policy_loss` knows its gradient early and does 6NHV.
"""
from __future__ import annotations

import torch

from ._blocked import blocked_backward, blocked_stats
from ._common import (CHUNK_BYTES_CPU, CHUNK_BYTES_CUDA, TORCH_BLOCK_ROWS, addmm_f32_,
                      check_fused_forward, check_linear_inputs, check_targets, check_temperature,
                      check_workspace_bytes, fused_forward_backend, grad_dtype, mm_f32, plan_chunk,
                      resolve_backend)
from ._head import build_head
from ._rowmath import row_grad, row_stats, target_grad
from ._vocab_outer import block_elem_bytes, vocab_outer_backward, vocab_outer_plan

__all__ = ["linear_logprobs"]

_grad_dtype = grad_dtype   # the name tests/test_kernels_aot.py's launch recipes import


def chunk_grad(x_c, w, z, t_c, lse_c, ent_c, g1_c, g2_c, dt_c, inv_temp, backend, dx_out, dw_acc,
               head=None, z_pre=None, db_acc=None):
    """One chunk of the backward: logits z (fp32 [C, V], consumed) -> dZ -> dX_c, dW (, db).

    z holds what the row kernels saw: u = head(z_pre) when a head variant is active (then dL/du
    is taken back through the head to dL/dz_pre, and its column sums go to `db_acc`).
    dX_c is written into `dx_out` (a [C, H] view, or None); dZ^T X_c is added to the fp32
    accumulator `dw_acc` (or None). g1_c = dL/dlogp, g2_c = dL/dH (fp32 [C] or None), dt_c the
    target entries of dL/du (_rowmath.target_grad).
    """
    gdt = grad_dtype(w)
    if head is None:
        out = z if gdt == torch.float32 else torch.empty(z.shape, device=z.device, dtype=gdt)
        dz = row_grad(z, t_c, lse_c, ent_c, g1_c, g2_c, inv_temp, backend, out=out, dt=dt_c)
    else:
        dz = row_grad(z, t_c, lse_c, ent_c, g1_c, g2_c, inv_temp, backend, out=z, dt=dt_c)  # dL/du
        dz = head.backward_(dz, z_pre, backend)                                      # dL/dz_pre
        if db_acc is not None:
            db_acc += dz.sum(0)
        if gdt != torch.float32:
            dz = dz.to(gdt)
    if dx_out is not None:
        if dz.dtype == w.dtype:
            torch.mm(dz, w, out=dx_out)
        else:  # CPU with low-precision weights: fp32 GEMM, rounded once into dx
            dx_out.copy_(torch.mm(dz, w.float()))
    if dw_acc is not None:
        addmm_f32_(dw_acc, dz.t(), x_c if dz.dtype == x_c.dtype else x_c.to(dz.dtype))


def head_logits(x_c, w, head, backend):
    """(u, z_pre): the chunk's logits as the row kernels see them, and the raw GEMM output when the
    head's backward needs it (else None). Without a head u is the GEMM output itself."""
    z = mm_f32(x_c, w.t())
    if head is None:
        return z, None
    if head.needs_pre:
        return head.forward(z, backend, out=torch.empty_like(z)), z
    return head.forward(z, backend), None


class _LinearLogprobs(torch.autograd.Function):
    """Compacted rows in, per-row (logp, entropy) out. Entropy output is empty when unused.

    `b` is the LM-head bias (or None) and `head` its HeadTransform (None: no bias or soft-cap, a
    lone scale folded into 1/T by build_head; the torch backend then runs the vocabulary-blocked
    code of _blocked.py).
    """

    @staticmethod
    def forward(ctx, x, w, b, t, inv_temp, with_entropy, backend, chunk, head, bwd_rows, ws_bytes):
        if backend == "torch" and head is None:
            logp, ent, lse, off, off_ent = blocked_stats(x, w, t, inv_temp, with_entropy, chunk)
            if ent is None:
                ent = off_ent = torch.empty(0, device=x.device, dtype=torch.float32)
        else:
            logp, lse, ent, off, off_ent = _row_chunked_stats(x, w, t, inv_temp, with_entropy,
                                                              backend, chunk, head)
            backend = "triton" if backend == "triton-fused" else backend   # backward: blocks
        ctx.save_for_backward(x, w, t, lse, ent, logp, off, off_ent)
        ctx.cfg = (inv_temp, with_entropy, backend, chunk, head, bwd_rows, ws_bytes)
        ctx.set_materialize_grads(False)
        if not with_entropy:
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        x, w, t, lse, ent, logp, off, off_ent = ctx.saved_tensors
        inv_temp, with_entropy, backend, chunk, head, bwd_rows, ws_bytes = ctx.cfg
        if not with_entropy:
            g_ent = None
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        nones = (None,) * 8
        if (g_logp is None and g_ent is None) or not (need_dx or need_dw or need_db) \
                or x.shape[0] == 0:
            dx = torch.zeros_like(x) if need_dx else None
            dw = torch.zeros_like(w) if need_dw else None
            db = torch.zeros(w.shape[0], device=w.device, dtype=head.bias_dtype) if need_db else None
            return (dx, dw, db) + nones
        g1 = None if g_logp is None else g_logp.float().contiguous()
        g2 = None if g_ent is None else g_ent.float().contiguous()
        ent, off_ent = (ent, off_ent) if with_entropy else (None, None)
        dt = target_grad(logp, ent, off, off_ent, g1, g2)   # the exact target entries of dL/ds
        args = (x, w, t, lse, ent, g1, g2, inv_temp)
        db = None
        if backend == "torch" and head is None:
            dx, dw = blocked_backward(*args, chunk, need_dx, need_dw, dt=dt)
        else:
            rows, cols = vocab_outer_plan(x.shape[0], x.shape[1], w.shape[0], x.device,
                                          block_elem_bytes=block_elem_bytes(w, head),
                                          workspace_bytes=ws_bytes, rows=bwd_rows)
            dx, dw, db = vocab_outer_backward(*args, backend, need_dx, need_dw, head, need_db,
                                              rows, cols, dt=dt)
        return (dx, (dw.to(w.dtype) if dw is not None else None),
                (db.to(head.bias_dtype) if db is not None else None)) + nones


def _row_chunked_stats(x, w, t, inv_temp, with_entropy, backend, chunk, head=None):
    """Forward sweep of the row-chunked path: rows in chunks, the whole vocabulary per chunk
    (backend 'triton-fused': the stats straight from x and w, no logits block)."""
    n = x.shape[0]
    if backend == "triton-fused":
        from ._fused_lse import fused_row_stats   # lazy: triton only when it is used
        fn = lambda a, b: fused_row_stats(x[a:b], w, t[a:b], inv_temp, with_entropy)  # noqa: E731
    else:
        fn = None
    logp = torch.empty(n, device=x.device, dtype=torch.float32)
    lse, off = torch.empty_like(logp), torch.empty_like(logp)
    ent = torch.empty(n if with_entropy else 0, device=x.device, dtype=torch.float32)
    off_ent = torch.empty_like(ent)
    for s in range(0, n, chunk):
        e = min(n, s + chunk)
        if fn is not None:
            logp[s:e], h, lse[s:e], off[s:e], b = fn(s, e)
        else:
            z = mm_f32(x[s:e], w.t())
            if head is not None:
                z = head.forward(z, backend)
            logp[s:e], h, lse[s:e], off[s:e], b = row_stats(z, t[s:e], inv_temp, with_entropy,
                                                            backend)
            del z
        if with_entropy:
            ent[s:e], off_ent[s:e] = h, b
    return logp, lse, ent, off, off_ent


def forward_rows(n: int, v: int, dtype, device: torch.device, backend: str, head=None,
                 chunk_size: int | None = None, budget: int | None = None) -> int:
    """Rows per chunk of the forward sweep (`chunk_size` overrides). The torch backend without a
    head variant: row blocks of TORCH_BLOCK_ROWS (its vocabulary blocks follow from _blocked.py's
    own budget). 'triton-fused': its per-row workspace, 4 fp32 numbers per vocabulary tile
    (`_fused_lse.partial_bytes_per_row`, about 1/32 of an fp32 logits row), within the logits
    budget or `budget`: all 16384 rows in one launch at V=128256 on CUDA. Otherwise one fp32
    [rows, V] logits block within CHUNK_BYTES_CUDA / CHUNK_BYTES_CPU."""
    if backend == "torch" and head is None:
        return plan_chunk(n, 1, TORCH_BLOCK_ROWS, chunk_size=chunk_size, align=1)
    logits_budget = CHUNK_BYTES_CUDA if device.type == "cuda" else CHUNK_BYTES_CPU
    if backend == "triton-fused":
        from ._fused_lse import partial_bytes_per_row    # imports triton: only for this backend
        return plan_chunk(n, partial_bytes_per_row(v, dtype, device), budget or logits_budget,
                          chunk_size=chunk_size, align=1)
    return plan_chunk(n, 4 * max(v, 1), logits_budget, chunk_size=chunk_size, align_from=64)


def compact_rows(mask: torch.Tensor | None, n: int):
    """Indices of loss-bearing rows (one host sync), or None when every row counts."""
    if mask is None:
        return None
    if mask.dtype != torch.bool:
        raise ValueError(f"mask must be a bool tensor, got {mask.dtype}")
    rows = mask.nonzero().view(-1)
    return None if rows.numel() == n else rows


def scatter_rows(vals: torch.Tensor, rows: torch.Tensor | None, n: int) -> torch.Tensor:
    """Place per-row values back at their positions; everything else is exactly 0 (no grad)."""
    if rows is None:
        return vals
    return vals.new_zeros(n).index_put((rows,), vals)


def linear_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                    mask: torch.Tensor | None = None, temperature: float = 1.0,
                    with_entropy: bool = False, backend: str = "auto",
                    chunk_size: int | None = None, bias: torch.Tensor | None = None,
                    logit_softcap: float | None = None, logit_scale: float | None = None,
                    workspace_bytes: int | None = None):
    """Log-prob of `targets` (and optionally the entropy) under softmax(head(hidden @ weight.T) / T).

    Args:
        hidden: [N, H] float32/bfloat16/float16 final hidden states.
        weight: [V, H] LM-head weight, same dtype and device as `hidden` (not a DTensor).
        targets: [N] int64 token ids; must lie in [0, V) wherever `mask` is True.
        mask: [N] bool or None (all rows). Rows with mask False cost no projection work, get
            logp = ent = 0 exactly and receive no gradient.
        temperature: the sampler's temperature: logits are divided by it before the softmax
            (after the head's scale and soft-cap).
        with_entropy: also return the per-row entropy (differentiable).
        backend: "triton" (CUDA, or CPU under TRITON_INTERPRET=1), "torch", or "auto"
            (triton on CUDA, torch otherwise). "triton-fused": the forward's logits GEMM and
            log-sum-exp in one Triton tile kernel (logits never in memory, `_fused_lse.py`),
            the backward as "triton"; no LM-head bias / soft-cap.
        chunk_size: rows per chunk (default: from a memory budget, see `forward_rows`).
        bias: [V] LM-head bias or None (differentiable).
        logit_softcap: c > 0 or None: logits = c * tanh(logits / c) (Gemma 2/3's
            final_logit_softcapping), applied after bias and scale, before the temperature.
        logit_scale: a (nonzero) or None: logits = a * (hidden @ weight.T + bias) (Cohere's
            logit_scale; Granite's is 1 / logits_scaling).
        workspace_bytes: memory the vocabulary-outer backward of the row-chunked path (Triton
            backend, or any LM-head variant) may use besides the dX / dW it returns; default
            1 GiB on CUDA, 64 MiB on CPU (see `_vocab_outer.py`). chunk_size, when given, also
            sets its rows per group.

    Returns:
        (logp [N] float32, ent [N] float32 or None). Both differentiable w.r.t. hidden, weight
        (and bias).
    """
    check_linear_inputs(hidden, weight, targets, mask)
    head, inv_temp = build_head(bias, logit_softcap, logit_scale, weight,
                                1.0 / check_temperature(temperature))
    backend = resolve_backend(backend, hidden.device)
    check_fused_forward(backend, head)
    backend = fused_forward_backend(backend, hidden, torch.is_grad_enabled() and (
        hidden.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)))
    n, v = hidden.shape[0], weight.shape[0]
    rows = compact_rows(mask, n)
    x = hidden if rows is None else hidden.index_select(0, rows)
    t = targets if rows is None else targets.index_select(0, rows)
    check_targets(t, rows, v)
    t = t.long().contiguous()
    x = x.contiguous()
    w = weight.contiguous()
    chunk = forward_rows(x.shape[0], v, x.dtype, x.device, backend, head, chunk_size)
    b = None if head is None else bias
    logp, ent = _LinearLogprobs.apply(x, w, b, t, inv_temp, bool(with_entropy), backend, chunk,
                                      head, chunk_size, check_workspace_bytes(workspace_bytes))
    logp = scatter_rows(logp, rows, n)
    if not with_entropy:
        return logp, None
    return logp, scatter_rows(ent, rows, n)
