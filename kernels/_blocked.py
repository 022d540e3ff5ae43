"""Torch backend of `linear_logprobs`: vocabulary-blocked forward and backward (the CPU path).

With s = X W^T / T for a block of R rows, processed V_b vocabulary columns at a time:

forward, direct (every row whose lse ends up in [-69, 69], i.e. all rows of a trained LM head):
    per block S += sum_j exp(s_j), A += sum_j exp(s_j) s_j (A for the entropy only), with no
    shift at all: the GEMM is plain X W_b^T (K = H) and a block costs one exp pass and one sum.
    lse = log S, H = log S - A / S, logp = s_t - lse. exp(s) cannot overflow a sum that ends
    below 1e30, and a row whose terms all underflow ends below 1e-30: rows outside that window
    (|logits| ~ 70 and beyond; inf / NaN too) are recomputed by the shifted forward.
forward, shifted (those rows only): m = the first block's exact row max; every block adds
    S += sum_j exp(s_j - m), A += sum_j exp(s_j - m)(s_j - m) with the *same* shift m, so no
    |s|-sized number is re-rounded per block (at |s| ~ 160 a running lse re-based every block
    drifts by ~1e-4). At the end lse = m + log S, H = log S - A / S (no lse - E[s]
    cancellation), logp = s_t - lse. A block whose max exceeds m by more than ~41 (S_b > 1e18:
    the entropy sum could overflow fp32) is redone for those rows with their exact block max
    and merged with re-basing (rare; tested).
backward (lse, H known): logq = s - lse, p = exp(logq);
    dS = -diag(g1) P                  (logp gradient only)      off the target column;
    dS = -p (g1 + g2 H + g2 logq)     (with an entropy gradient)
    dS_t = dt (_rowmath.target_grad: from the off-target sums, never 1 - p_t)
    dX = dS W / T,  dW = dS^T X / T
    The row scale -g1 is applied to the small [R, H] operands (dX rows, X for dW) instead of
    the [R, V_b] block; each block's target entries are zeroed and the target part (dt W[t],
    dt x to dW rows t) is an index_add over R rows at the end.
Both forwards leave the target column out of their sums (S = S_off + e_t): A = S_off / S is
the off-target mass the target entry is formed from (see _rowmath.py).
    direct (every lse of the row block within +-69): p = e^s e^-lse, and e^-lse joins the row
    scale, so the GEMM is plain X W_b^T again; guarded (see _direct_row_scale) against row
    scales leaving the normal fp32 range and against overflow of sum_j e^s_j w_j.
    shifted (otherwise): -lse is an extra GEMM column, so the GEMM returns logq directly.

Why this shape on the CPU: in the backward (and the shifted forward) the shift (lse or m)
enters the GEMM as an extra column of X against a column of ones in W_b, so the GEMM already
returns s - shift: the backward does a single elementwise pass per block (exp_), the direct
forward two (exp_, sum) after a plain GEMM. dW_b = dS_b^T X has K = R
(one write per weight row; no V x H fp32 accumulator re-read every chunk), dX accumulates
in an [R, H] fp32 buffer. FLOPs as the row-chunked path: forward 2NHV, backward 6NHV. Each row
block reuses one preallocated [R, V_b] buffer for its GEMM outputs (a fresh multi-MiB tensor per
block costs page faults on every allocation).
"""
from __future__ import annotations

import math

import torch

from . import _common
from ._rowmath import put_target_


# Direct forward: rows whose S = sum exp(s) ends outside this window (lse outside +-69) are redone
# by the shifted forward. Inside it no term overflowed and the terms that matter did not underflow.
_S_DIRECT = (1e-30, 1e30)

# A block sum above this means the block max exceeds the running lse by > ~41: the entropy sum
# sum e (s - c) could then overflow fp32 (e up to 3e38), so such rows are redone with their
# exact block max. Catches inf / NaN too (the comparison is False).
_S_MAX = 1e18
_LOG_S_MAX = math.log(_S_MAX)


def _block_cols(r: int, v: int, dev) -> int:
    """Vocabulary columns per block: one fp32 [r, V_b] block within the budget (read from
    _common at each call, so a test can shrink it)."""
    budget = _common.CHUNK_BYTES_CUDA if dev.type == "cuda" else _common.VOCAB_BLOCK_BYTES_CPU
    return _common.plan_chunk(v, 4 * max(r, 1), budget)


def _aug_rows(x: torch.Tensor, inv_temp: float) -> torch.Tensor:
    """[R, H+1] fp32: x / T in the first H columns; the last column holds -shift per block."""
    r, h = x.shape
    xa = torch.empty(r, h + 1, device=x.device, dtype=torch.float32)
    xa[:, :h].copy_(x)                     # upcast first: x * (1/T) in bf16 would round
    if inv_temp != 1.0:
        xa[:, :h].mul_(inv_temp)
    return xa


def _aug_weight_buf(bv: int, h: int, device) -> torch.Tensor:
    """[V_b, H+1] fp32 scratch for one weight block with a trailing column of ones."""
    wa = torch.empty(bv, h + 1, device=device, dtype=torch.float32)
    wa[:, h] = 1.0
    return wa


def _drop_target(blk: torch.Tensor, t_c, v0: int) -> torch.Tensor:
    """Zero, in place, the entry of each row's target when it lies in this vocabulary block (its
    columns start at v0): sums over the block then hold the off-target terms only."""
    return put_target_(blk, t_c - v0, 0.0)


def _sum_exp(zb: torch.Tensor, with_entropy: bool, t_c, v0: int):
    """zb = s - c (consumed). Returns the off-target sums S_b = sum_{j != t} exp(zb) and
    A_b = sum_{j != t} exp(zb) zb (or None)."""
    if not with_entropy:
        return _drop_target(zb.exp_(), t_c, v0).sum(1), None
    e = _drop_target(torch.exp(zb), t_c, v0)
    s_b = e.sum(1)
    return s_b, e.mul_(zb).sum(1)


def _merge(m, s, a, c, s_b, a_b):
    """Merge block stats relative to shift c into the running (m, S, A) relative to m."""
    mn = torch.maximum(m, c)
    fa, fb = torch.exp(m - mn), torch.exp(c - mn)
    s_new = fa * s + fb * s_b
    a_new = None if a is None else fa * (a + (m - mn) * s) + fb * (a_b + (c - mn) * s_b)
    return mn, s_new, a_new


def _scaled_rows(x: torch.Tensor, inv_temp: float) -> torch.Tensor:
    """fp32 x / T (upcast first: x * (1/T) in bf16 would round); x itself when fp32 and T = 1."""
    xs = x.float()
    return xs * inv_temp if inv_temp != 1.0 else xs


def _weight_blocks(w, bv: int, h: int):
    """Yield (v0, v1, fp32 [v1 - v0, H] weight block): a view when w is fp32, else an upcast copy."""
    buf = None if w.dtype == torch.float32 else torch.empty(bv, h, device=w.device, dtype=torch.float32)
    for v0 in range(0, w.shape[0], bv):
        v1 = min(w.shape[0], v0 + bv)
        yield v0, v1, (w[v0:v1] if buf is None else buf[: v1 - v0].copy_(w[v0:v1]))


def _block_view(buf: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """A contiguous [rows, cols] view at the start of a flat preallocated buffer."""
    return buf[: rows * cols].view(rows, cols)


def _gather_in_block(zb, t_c, v0: int, acc, offset=None):
    """acc[i] = zb[i, t_c[i] - v0] (+ offset[i]) for the rows whose target lies in this block."""
    nb = zb.shape[1]
    idx = t_c - v0
    inb = (idx >= 0) & (idx < nb)
    z_t = zb.gather(1, idx.clamp(0, nb - 1).view(-1, 1)).squeeze(1)
    return torch.where(inb, z_t if offset is None else z_t + offset, acc)


def blocked_stats(x, w, t, inv_temp: float, with_entropy: bool, rows: int):
    """(logp, entropy or None, lse, off, off_ent or None), fp32 [n], for the compacted rows
    x [n, H] (torch backend); off / off_ent: the off-target sums of _rowmath.py's docstring."""
    n = x.shape[0]
    names = ("logp", "ent", "lse", "off", "off_ent")
    out = {k: (torch.empty(n, device=x.device, dtype=torch.float32)
               if with_entropy or k not in ("ent", "off_ent") else None) for k in names}
    for s in range(0, n, rows):
        e = min(n, s + rows)
        *stats, ok = _direct_stats(x[s:e], w, t[s:e], inv_temp, with_entropy)
        if not bool(ok.all()):                   # rows with |logits| ~ 70+: the shifted forward
            bad = (~ok).nonzero().view(-1)
            redo = _shifted_stats(x[s:e].index_select(0, bad), w, t[s:e].index_select(0, bad),
                                  inv_temp, with_entropy)
            for c, b in zip(stats, redo):
                if c is not None:
                    c.index_copy_(0, bad, b)
        for k, c in zip(names, stats):
            if c is not None:
                out[k][s:e] = c
    return tuple(out[k] for k in names)


def _direct_stats(x_c, w, t_c, inv_temp: float, with_entropy: bool):
    """Shift-free forward of one row block: (logp, ent or None, lse, ok) with ok = rows to keep."""
    r, h = x_c.shape
    dev = x_c.device
    xs = _scaled_rows(x_c, inv_temp)
    bv = _block_cols(r, w.shape[0], dev)
    zbuf = torch.empty(r * bv, device=dev, dtype=torch.float32)
    ebuf = torch.empty_like(zbuf) if with_entropy else None
    s_acc = torch.zeros(r, device=dev, dtype=torch.float32)      # off-target sums
    a_acc = torch.zeros_like(s_acc) if with_entropy else None
    s_t = torch.zeros_like(s_acc)
    for v0, v1, wb in _weight_blocks(w, bv, h):
        zb = torch.mm(xs, wb.t(), out=_block_view(zbuf, r, v1 - v0))   # s
        s_t = _gather_in_block(zb, t_c, v0, s_t)
        if with_entropy:
            eb = _drop_target(torch.exp(zb, out=_block_view(ebuf, r, v1 - v0)), t_c, v0)
            s_acc += eb.sum(1)
            a_acc += eb.mul_(zb).sum(1)
        else:
            s_acc += _drop_target(zb.exp_(), t_c, v0).sum(1)
    e_t = torch.exp(s_t)
    s_all = s_acc + e_t
    ok = (s_all >= _S_DIRECT[0]) & (s_all <= _S_DIRECT[1])   # False for inf / NaN too
    log_s = torch.log(s_all)
    off = s_acc / s_all
    if not with_entropy:
        return s_t - log_s, None, log_s, off, None, ok
    ent = log_s - (a_acc + e_t * s_t) / s_all
    return s_t - log_s, ent, log_s, off, a_acc / s_all - off * log_s, ok


def _shifted_stats(x, w, t, inv_temp: float, with_entropy: bool):
    """Forward with a per-row shift (the first block's max) for rows the direct forward rejects."""
    n, h = x.shape
    v = w.shape[0]
    dev = x.device
    xa = _aug_rows(x, inv_temp)
    bv = _block_cols(n, v, dev)
    wa = _aug_weight_buf(bv, h, dev)
    zbuf = torch.empty(n * bv, device=dev, dtype=torch.float32)
    m = s_acc = a_acc = None
    s_t = torch.zeros(n, device=dev, dtype=torch.float32)
    for v0 in range(0, v, bv):
        v1 = min(v, v0 + bv)
        wb = wa[: v1 - v0]
        wb[:, :h].copy_(w[v0:v1])
        xa[:, h] = 0.0 if m is None else -m
        zb = torch.mm(xa, wb.t(), out=_block_view(zbuf, n, v1 - v0))   # s - m
        s_t = _gather_in_block(zb, t, v0, s_t, offset=m)
        if m is None:                                  # first block: exact row max
            m = zb.amax(1)
            zb.sub_(m.view(-1, 1))
            s_acc, a_acc = _sum_exp(zb, with_entropy, t, v0)
            continue
        # the target is not in the sums: a target far above m is caught on its own
        big_t = _gather_in_block(zb, t, v0, torch.zeros_like(m)) > _LOG_S_MAX
        s_b, a_b = _sum_exp(zb, with_entropy, t, v0)
        # a block max far above m: exp (or sum e (s - m)) overflowed or came close, so redo
        # those rows with their exact block max and re-base them (rare)
        bad = ~(s_b <= _S_MAX) | big_t
        if bool(bad.any()):
            r_bad = bad.nonzero().view(-1)
            s_b = torch.where(bad, 0.0, s_b)
            a_b = None if a_b is None else torch.where(bad, 0.0, a_b)
        s_acc = s_acc + s_b                            # same shift m: no re-basing, no
        a_acc = None if a_b is None else a_acc + a_b   # rounding of |s|-sized numbers
        if bool(bad.any()):
            zr = torch.mm(xa.index_select(0, r_bad), wb.t())
            cr = zr.amax(1)
            zr.sub_(cr.view(-1, 1))
            sr, ar = _sum_exp(zr, with_entropy, t.index_select(0, r_bad), v0)
            mr, sr, ar = _merge(m[r_bad], s_acc[r_bad], None if a_acc is None
                                else a_acc[r_bad], m[r_bad] + cr, sr, ar)
            m, s_acc = m.index_copy(0, r_bad, mr), s_acc.index_copy(0, r_bad, sr)
            a_acc = None if a_acc is None else a_acc.index_copy(0, r_bad, ar)
    sm_t = s_t - m
    e_t = torch.exp(sm_t)                              # <= e^41: the target's block was checked
    s_all = s_acc + e_t
    log_s = torch.log(s_all)
    lse = m + log_s
    off = s_acc / s_all
    if not with_entropy:
        return s_t - lse, None, lse, off, None
    ent = log_s - (a_acc + e_t * sm_t) / s_all
    return s_t - lse, ent, lse, off, a_acc / s_all - off * log_s


def blocked_backward(x, w, t, lse, ent, g1, g2, inv_temp: float, rows: int, need_dx, need_dw,
                     *, dt):
    """(dX in x.dtype or None, dW fp32 or None) for the torch backend; see module docstring.

    g1 = dL/dlogp, g2 = dL/dH: fp32 [n] or None (not both None); ent needed when g2 is given.
    dt = dL/ds_t (_rowmath.target_grad) replaces each row's target entry of dS.
    """
    n, h = x.shape
    v = w.shape[0]
    dev = x.device
    dx = torch.empty_like(x) if need_dx else None
    dw = torch.empty(v, h, device=dev, dtype=torch.float32) if need_dw else None
    log_wmax = None
    for s in range(0, n, rows):
        e = min(n, s + rows)
        g1_c = None if g1 is None else g1[s:e]
        if g2 is None:
            a_c = beta = gamma = None
        else:   # -p (a + g2 log p) with log p = s - lse:  beta + gamma s = a - g2 lse + g2 s
            a_c = g2[s:e] * ent[s:e] + (0.0 if g1_c is None else g1_c)
            beta, gamma = a_c - g2[s:e] * lse[s:e], g2[s:e]
        rho = _direct_row_scale(lse[s:e], g1_c, beta)
        if rho is not None and need_dx:   # dX accumulates sum_j e^s_j |w_j| (beta + gamma s_j)
            if log_wmax is None:
                lo, hi = torch.aminmax(w)                 # one pass, no |w| copy
                log_wmax = math.log(max(-float(lo), float(hi), 1e-30))
            if float(lse[s:e].max()) + log_wmax + _log_row_factor(beta, gamma) > _LOG_ACC_MAX:
                rho = None
        block = (x[s:e], w, t[s:e], g1_c, dt[s:e], inv_temp, dw, s == 0, need_dx)
        if rho is not None:
            dx_c = _direct_backward(*block, rho, beta, gamma)
        else:
            dx_c = _shifted_backward(*block, lse[s:e], a_c, gamma)
        if need_dx:
            dx[s:e] = dx_c
    return dx, dw


# Direct backward: p = e^s * e^-lse with the row scale e^-lse (times -g1 without an entropy
# gradient) applied to the small [R, H] operands. Allowed for a row block when every lse is
# within +-69 (e^s neither overflows nor loses the terms that matter), every row scale is 0 or
# within [1e-30, 1e30] (X rows scaled by it stay normal numbers), and the dX accumulator
# sum_j e^s_j w_j cannot pass e^_LOG_ACC_MAX. Otherwise the shifted backward runs.
_LSE_DIRECT = 69.0
_LOG_ACC_MAX = 80.0


def _direct_row_scale(lse_c, g1_c, beta):
    """Per-row scale rho (fp32 [R]) of the direct backward, or None when it is not safe."""
    if not bool((lse_c.abs() <= _LSE_DIRECT).all()):        # False for inf / NaN too
        return None
    c = torch.exp(-lse_c.double())
    rho = -c if beta is not None else -g1_c.double() * c
    mag = rho.abs()
    if not bool(((mag == 0) | ((mag >= 1e-30) & (mag <= 1e30))).all()):
        return None
    return rho.float()


def _log_row_factor(beta, gamma) -> float:
    """log of a bound on |beta + gamma s| over the block (0 without an entropy gradient)."""
    if beta is None:
        return 0.0
    bound = float((beta.abs() + gamma.abs() * 2 * _LSE_DIRECT).max())
    return math.log(max(bound, 1e-30))


def _accumulate(blk, wb, xg, dxa, dw, v0: int, v1: int, first: bool) -> None:
    """dX_acc += blk W_b; dW[v0:v1] (=|+=) blk^T xg (written, not added, by the first row block)."""
    if dxa is not None:
        dxa.addmm_(blk, wb)
    if dw is not None:
        if first:
            torch.mm(blk.t(), xg, out=dw[v0:v1])
        else:
            dw[v0:v1].addmm_(blk.t(), xg)


def _finish_block(x_c, w, t_c, dt_c, inv_temp, dw, need_dx, xs, dxa, rho):
    """Target terms (the blocks' target entries were zeroed: + dt W[t] to dX, + dt x to dW rows t),
    the row scale on dX, the 1/T."""
    if dw is not None:
        dw.index_add_(0, t_c, xs * dt_c.view(-1, 1))
    if not need_dx:
        return None
    if rho is not None:
        dxa.mul_(rho.view(-1, 1))
    dxa.add_(w.index_select(0, t_c).float() * dt_c.view(-1, 1))
    if inv_temp != 1.0:
        dxa.mul_(inv_temp)
    return dxa


def _direct_backward(x_c, w, t_c, g1_c, dt_c, inv_temp, dw, first, need_dx, rho, beta, gamma):
    """Backward of one row block with no shift in the GEMM (K = H); returns dX rows (fp32)."""
    r, h = x_c.shape
    dev = x_c.device
    xs = _scaled_rows(x_c, inv_temp)
    xg = xs * rho.view(-1, 1) if dw is not None else None
    dxa = torch.zeros(r, h, device=dev, dtype=torch.float32) if need_dx else None
    bv = _block_cols(r, w.shape[0], dev)
    zbuf = torch.empty(r * bv, device=dev, dtype=torch.float32)
    ebuf = torch.empty_like(zbuf) if beta is not None else None
    for v0, v1, wb in _weight_blocks(w, bv, h):
        zb = torch.mm(xs, wb.t(), out=_block_view(zbuf, r, v1 - v0))   # s
        if beta is None:
            blk = zb.exp_()                                             # e^s (x rho = dS)
        else:                                                           # e^s (beta + gamma s)
            eb = torch.exp(zb, out=_block_view(ebuf, r, v1 - v0))
            blk = zb.mul_(gamma.view(-1, 1)).add_(beta.view(-1, 1)).mul_(eb)
        _accumulate(_drop_target(blk, t_c, v0), wb, xg, dxa, dw, v0, v1, first)
    return _finish_block(x_c, w, t_c, dt_c, inv_temp, dw, need_dx, xs, dxa, rho)


def _shifted_backward(x_c, w, t_c, g1_c, dt_c, inv_temp, dw, first, need_dx, lse_c, a_c, gamma):
    """Backward of one row block with -lse as an extra GEMM column, so the GEMM gives log p."""
    r, h = x_c.shape
    dev = x_c.device
    xa = _aug_rows(x_c, inv_temp)
    xs = xa[:, :h]                                     # x / T
    xa[:, h] = -lse_c
    rho = -g1_c if a_c is None else None               # dS = diag(rho) P, or
    #                                                    dS = -p (a + g2 log p); target: dt
    xg = xs * rho.view(-1, 1) if (dw is not None and rho is not None) else xs
    dxa = torch.zeros(r, h, device=dev, dtype=torch.float32) if need_dx else None
    bv = _block_cols(r, w.shape[0], dev)
    wa = _aug_weight_buf(bv, h, dev)
    zbuf = torch.empty(r * bv, device=dev, dtype=torch.float32)
    ebuf = torch.empty_like(zbuf) if a_c is not None else None
    for v0 in range(0, w.shape[0], bv):
        v1 = min(w.shape[0], v0 + bv)
        wb = wa[: v1 - v0]
        wb[:, :h].copy_(w[v0:v1])
        zb = torch.mm(xa, wb.t(), out=_block_view(zbuf, r, v1 - v0))   # log p
        if a_c is None:
            blk = zb.exp_()                            # P (row scale rho applied outside)
        else:
            p = torch.exp(zb, out=_block_view(ebuf, r, v1 - v0))
            blk = zb.mul_(-gamma.view(-1, 1)).sub_(a_c.view(-1, 1)).mul_(p)
        _accumulate(_drop_target(blk, t_c, v0), wb[:, :h], xg, dxa, dw, v0, v1, first)
    return _finish_block(x_c, w, t_c, dt_c, inv_temp, dw, need_dx, xs, dxa, rho)
