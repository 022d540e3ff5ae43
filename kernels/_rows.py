"""Row math on one chunk of logits: log-sum-exp, target log-prob, entropy, and d(loss)/d(logits).

For a row of raw logits `z` [V], temperature T, `s = z / T`, target t:

    lse     = log sum_j exp(s_j)
    logp    = s_t - lse
    H       = -sum_j p_j log p_j = lse - sum_j p_j s_j,          p = softmax(s)

Given upstream per-row gradients g1 = dL/dlogp and g2 = dL/dH:

    dL/ds_j = g1 (1[j=t] - p_j) - g2 p_j (log p_j + H)
    dL/dz_j = dL/ds_j / T

Two implementations with the same contract:
- `*_torch`: plain PyTorch on the [C, V] chunk (readable reference, the CPU default);
- `*_triton`: one program per row looping over V in blocks with an *online* max / sum-exp that
  starts at -inf (a running max started at 0 breaks on all-negative logits). The entropy is
  accumulated relative to the running max, H = log S - (sum e_j (s_j - m)) / S, which avoids the
  cancellation of lse - E[s] when |s| ~ 100.
Row stats return `lse` (in units of s) so the gradient pass can recompute p = exp(s - lse).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# ---- torch ------------------------------------------------------------------------------------


def row_stats_torch(z, t, inv_temp: float, with_entropy: bool):
    """z: fp32 [C, V] raw logits (not modified). Returns (logp, entropy or None, lse), fp32 [C]."""
    s = z * inv_temp if inv_temp != 1.0 else z
    if not with_entropy:
        lse = torch.logsumexp(s, dim=1)
        return s.gather(1, t.view(-1, 1)).squeeze(1) - lse, None, lse
    m = s.amax(dim=1, keepdim=True)
    sm = s - m                      # shifted logits, <= 0
    e = torch.exp(sm)
    sum_e = e.sum(dim=1)
    log_sum = torch.log(sum_e)
    lse = m.squeeze(1) + log_sum
    logp = sm.gather(1, t.view(-1, 1)).squeeze(1) - log_sum
    ent = log_sum - e.mul_(sm).sum(dim=1) / sum_e
    return logp, ent, lse


def row_grad_torch(z, t, lse, ent, g1, g2, inv_temp: float, out=None):
    """dL/dz for one chunk. z fp32 [C, V] is scratch (overwritten); the result is returned,
    copied into `out` when that is a different buffer. g1/g2: fp32 [C] or None.

    Written as few full passes over the chunk as possible (this is the CPU hot loop).
    """
    logq = (z.mul_(inv_temp) if inv_temp != 1.0 else z).sub_(lse.view(-1, 1))   # log p
    if g2 is not None:
        # dz = -p (g1 + g2 (log p + H)) = p * (-g2 log p - (g1 + g2 H))
        p = torch.exp(logq)
        off = g2 * ent if g1 is None else g1 + g2 * ent
        dz = p.mul_(logq.mul_(-g2.view(-1, 1)).sub_(off.view(-1, 1)))
    else:
        dz = logq.exp_().mul_(-g1.view(-1, 1))
    if g1 is not None:
        dz.scatter_add_(1, t.view(-1, 1), g1.view(-1, 1))
    if inv_temp != 1.0:
        dz.mul_(inv_temp)
    if out is None or out.data_ptr() == dz.data_ptr() or out.data_ptr() == z.data_ptr():
        return dz
    out.copy_(dz)
    return out


# ---- triton -----------------------------------------------------------------------------------


@triton.jit
def _row_stats_kernel(z_ptr, stride_z, t_ptr, logp_ptr, ent_ptr, lse_ptr, V, inv_temp,
                      WITH_ENT: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * stride_z
    m = tl.full((), float("-inf"), tl.float32)   # running max of s (starts at -inf, not 0)
    acc = tl.zeros((), tl.float32)               # sum exp(s - m)
    acc_s = tl.zeros((), tl.float32)             # sum exp(s - m) * (s - m)
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        valid = cols < V
        s = tl.load(z_row + cols, mask=valid, other=float("-inf")).to(tl.float32) * inv_temp
        m_new = tl.maximum(m, tl.max(s, axis=0))  # every block has >= 1 valid column: finite
        alpha = tl.exp(m - m_new)
        sm = tl.where(valid, s - m_new, float("-inf"))
        e = tl.exp(sm)                             # 0 at padded columns
        if WITH_ENT:
            # re-base the old sum of e*(s-m) to the new max: e' = alpha e, (s - m_new) = (s - m) + (m - m_new)
            # (first block: acc = 0 and m = -inf; select m_new so no inf * 0 appears)
            shift = (tl.where(acc > 0, m, m_new) - m_new) * acc
            acc_s = alpha * (acc_s + shift) + tl.sum(e * tl.where(valid, sm, 0.0), axis=0)
        acc = acc * alpha + tl.sum(e, axis=0)
        m = m_new
    log_acc = tl.log(acc)
    lse = m + log_acc
    t = tl.load(t_ptr + row)
    s_t = tl.load(z_row + t).to(tl.float32) * inv_temp
    tl.store(logp_ptr + row, s_t - lse)
    tl.store(lse_ptr + row, lse)
    if WITH_ENT:
        tl.store(ent_ptr + row, log_acc - acc_s / acc)


@triton.jit
def _row_grad_kernel(z_ptr, stride_z, dz_ptr, stride_dz, t_ptr, lse_ptr, ent_ptr, g1_ptr, g2_ptr,
                     V, inv_temp, HAS_G1: tl.constexpr, HAS_G2: tl.constexpr,
                     BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * stride_z
    dz_row = dz_ptr + row * stride_dz
    lse = tl.load(lse_ptr + row)
    t = tl.load(t_ptr + row)
    g1 = 0.0
    if HAS_G1:
        g1 = tl.load(g1_ptr + row)
    if HAS_G2:
        g2 = tl.load(g2_ptr + row)
        h = tl.load(ent_ptr + row)
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        valid = cols < V
        logq = tl.load(z_row + cols, mask=valid, other=0.0).to(tl.float32) * inv_temp - lse
        logq = tl.where(valid, logq, 0.0)         # padded columns: finite, never stored
        p = tl.exp(logq)
        coef = tl.zeros((BLOCK_V,), tl.float32) + g1
        if HAS_G2:
            coef += g2 * (logq + h)
        dz = -p * coef
        if HAS_G1:
            dz = tl.where(cols == t, dz + g1, dz)
        tl.store(dz_row + cols, (dz * inv_temp).to(dz_ptr.dtype.element_ty), mask=valid)


def _block_v(v: int, device: torch.device) -> int:
    # The interpreter is vectorized per program through numpy: big blocks = fewer Python steps.
    cap = 8192 if device.type == "cpu" else 4096
    return max(16, min(cap, triton.next_power_of_2(v)))


def row_stats_triton(z, t, inv_temp: float, with_entropy: bool):
    c, v = z.shape
    logp = torch.empty(c, device=z.device, dtype=torch.float32)
    lse = torch.empty_like(logp)
    ent = torch.empty_like(logp) if with_entropy else logp  # dummy pointer when unused
    if c:
        _row_stats_kernel[(c,)](z, z.stride(0), t, logp, ent, lse, v, float(inv_temp),
                                WITH_ENT=with_entropy, BLOCK_V=_block_v(v, z.device))
    return logp, (ent if with_entropy else None), lse


def row_grad_triton(z, t, lse, ent, g1, g2, inv_temp: float, out=None):
    c, v = z.shape
    out = z if out is None else out
    if c:
        dummy = lse
        _row_grad_kernel[(c,)](z, z.stride(0), out, out.stride(0), t, lse,
                               ent if ent is not None else dummy,
                               g1 if g1 is not None else dummy, g2 if g2 is not None else dummy,
                               v, float(inv_temp), HAS_G1=g1 is not None, HAS_G2=g2 is not None,
                               BLOCK_V=_block_v(v, z.device))
    return out


def row_stats(z, t, inv_temp, with_entropy, backend):
    fn = row_stats_triton if backend == "triton" else row_stats_torch
    return fn(z, t, inv_temp, with_entropy)


def row_grad(z, t, lse, ent, g1, g2, inv_temp, backend, out=None):
    """At least one of g1, g2 must be given (the caller skips chunks with no gradient)."""
    fn = row_grad_triton if backend == "triton" else row_grad_torch
    return fn(z, t, lse, ent if g2 is not None else None, g1, g2, inv_temp, out=out)
