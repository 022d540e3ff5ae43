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
- `*_triton` (in `_rows.py`, imported only when the Triton backend runs, so the torch backend
  works where triton is not installed): one program per row looping over V in blocks with an *online* max / sum-exp that
  starts at -inf (a running max started at 0 breaks on all-negative logits). The entropy is
  accumulated relative to the running max, H = log S - (sum e_j (s_j - m)) / S, which avoids the
  cancellation of lse - E[s] when |s| ~ 100.
Row stats return `lse` (in units of s) so the gradient pass can recompute p = exp(s - lse).
"""
from __future__ import annotations

import torch

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
    copied into `out` when that is a different buffer. g1/g2: fp32 [C] or None. z may be a
    vocabulary block: t is then relative to its first column, and rows whose target lies
    outside [0, V) get no one-hot term (as in the Triton kernel).

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
    if g1 is not None:   # a target outside [0, V) (another vocabulary block's) adds no one-hot
        v = dz.shape[1]
        inb = (t >= 0) & (t < v)
        dz.scatter_add_(1, t.clamp(0, v - 1).view(-1, 1),
                        torch.where(inb, g1, torch.zeros_like(g1)).view(-1, 1))
    if inv_temp != 1.0:
        dz.mul_(inv_temp)
    if out is None or out.data_ptr() == dz.data_ptr() or out.data_ptr() == z.data_ptr():
        return dz
    out.copy_(dz)
    return out


# ---- dispatch -----------------------------------------------------------------------------------


def row_stats(z, t, inv_temp, with_entropy, backend):
    if backend == "triton":
        from ._rows import row_stats_triton as fn   # lazy: triton only when it is used
    else:
        fn = row_stats_torch
    return fn(z, t, inv_temp, with_entropy)


def row_grad(z, t, lse, ent, g1, g2, inv_temp, backend, out=None):
    """At least one of g1, g2 must be given (the caller skips chunks with no gradient)."""
    if backend == "triton":
        from ._rows import row_grad_triton as fn
    else:
        fn = row_grad_torch
    return fn(z, t, lse, ent if g2 is not None else None, g1, g2, inv_temp, out=out)
