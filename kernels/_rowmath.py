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

The target entry on a confident row. With p_t near 1, dL/ds_t = g1 (1 - p_t) - g2 p_t (log p_t + H)
formed from p_t = exp(s_t - lse) cancels: lse carries an absolute error ~eps |lse|, so 1 - p_t keeps
only ~eps |lse| / (1 - p_t) relative precision (1e-3 at p_t = 1 - 1e-4, |lse| = 30; the gradient of
exactly the tokens a trained policy is sure of). So the forward also sums the *off-target* mass
without ever forming 1 - p_t:

    A = sum_{j != t} p_j                 (`off`: positive terms only, relative precision ~eps)
    B = sum_{j != t} p_j log p_j         (`off_ent`, with the entropy)

and the backward writes the target entry from them (`target_grad`); because a gradient row sums to
zero this is minus the sum of the other entries, computed without cancellation:

    dL/ds_t = g1 A + g2 p_t (B - A log p_t),   log p_t = log1p(-A) when A < 1/2, else logp.

Every path (torch rows, Triton rows, the blocked torch path, the fused policy loss) forms A and B in
its forward sweep by leaving the target column out of its sums (S = S_off + e_t) and replaces the
target entry of dZ by `dt` instead of adding a one-hot g1.
"""
from __future__ import annotations

import torch

# ---- torch ------------------------------------------------------------------------------------


def row_stats_torch(z, t, inv_temp: float, with_entropy: bool):
    """z: fp32 [C, V] raw logits (not modified). Returns (logp, entropy or None, lse, off,
    off_ent or None), fp32 [C]; `off` / `off_ent` are A / B of the module docstring."""
    s = z * inv_temp if inv_temp != 1.0 else z
    m = s.amax(dim=1, keepdim=True)
    sm = s - m                      # shifted logits, <= 0
    e = torch.exp(sm)
    ti = t.view(-1, 1)
    sm_t = sm.gather(1, ti).squeeze(1)
    e_t = e.gather(1, ti).squeeze(1)
    e.scatter_(1, ti, 0.0)          # the off-target terms only
    sum_off = e.sum(dim=1)
    sum_e = sum_off + e_t
    log_sum = torch.log(sum_e)
    lse = m.squeeze(1) + log_sum
    logp = sm_t - log_sum
    off = sum_off / sum_e
    if not with_entropy:
        return logp, None, lse, off, None
    a_off = e.mul_(sm).sum(dim=1)   # sum_{j != t} e_j (s_j - m)
    ent = log_sum - (a_off + e_t * sm_t) / sum_e
    return logp, ent, lse, off, a_off / sum_e - off * log_sum


def target_grad(logp, ent, off, off_ent, g1, g2):
    """dL/ds_t per row (fp32 [C]) from the forward's stats; see the module docstring."""
    if g2 is None:
        return g1 * off
    conf = off < 0.5
    logp_t = torch.where(conf, torch.log1p(-off), logp)
    dt = g2 * torch.exp(logp_t) * (off_ent - off * logp_t)
    return dt if g1 is None else dt + g1 * off


def put_target_(blk, t, value):
    """blk[i, t[i]] = value (a scalar or fp32 [C]) in place, for the rows whose t[i] lies in
    [0, width): blk may be a vocabulary block with t relative to its first column; the other
    rows are unchanged. Returns blk."""
    nb = blk.shape[1]
    ic = t.clamp(0, nb - 1).view(-1, 1)
    inb = ((t >= 0) & (t < nb)).view(-1, 1)
    if isinstance(value, torch.Tensor):
        value = value.view(-1, 1)
    return blk.scatter_(1, ic, torch.where(inb, value, blk.gather(1, ic)))


def row_grad_torch(z, t, lse, ent, g1, g2, inv_temp: float, out=None, *, dt):
    """dL/dz for one chunk. z fp32 [C, V] is scratch (overwritten); the result is returned,
    copied into `out` when that is a different buffer. g1/g2: fp32 [C] or None; dt = dL/ds_t
    (`target_grad`) is written at each row's target column. z may be a vocabulary block: t is
    then relative to its first column, and rows whose target lies outside [0, V) keep the
    formula's entry (as in the Triton kernel).

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
    put_target_(dz, t, dt)          # a target in another vocabulary block: not this block's entry
    if inv_temp != 1.0:
        dz.mul_(inv_temp)
    if out is None or out.data_ptr() == dz.data_ptr() or out.data_ptr() == z.data_ptr():
        return dz
    out.copy_(dz)
    return out


# ---- dispatch -----------------------------------------------------------------------------------


def row_stats(z, t, inv_temp, with_entropy, backend):
    """(logp, entropy or None, lse, off, off_ent or None) of one chunk, fp32 [C] each."""
    if backend == "triton":
        from ._rows import row_stats_triton as fn   # lazy: triton only when it is used
    else:
        fn = row_stats_torch
    return fn(z, t, inv_temp, with_entropy)


def row_grad(z, t, lse, ent, g1, g2, inv_temp, backend, out=None, *, dt):
    """At least one of g1, g2 must be given (the caller skips chunks with no gradient)."""
    if backend == "triton":
        from ._rows import row_grad_triton as fn
    else:
        fn = row_grad_torch
    return fn(z, t, lse, ent if g2 is not None else None, g1, g2, inv_temp, out=out, dt=dt)
