"""Torch backend of `linear_logprobs`: vocabulary-blocked forward and backward (the CPU path).

With s = X W^T / T for a block of R rows, processed V_b vocabulary columns at a time:

forward (online over vocabulary blocks, no N x V tensor): m = the first block's exact row max;
    every block adds S += sum_j exp(s_j - m), A += sum_j exp(s_j - m)(s_j - m) (A for the
    entropy only) with the *same* shift m, so no |s|-sized number is re-rounded per block (at
    |s| ~ 160 a running lse re-based every block drifts by ~1e-4). At the end lse = m + log S,
    H = log S - A / S (no lse - E[s] cancellation), logp = s_t - lse. A block whose max exceeds
    m by more than ~41 (S_b > 1e18: the entropy sum could overflow fp32) is redone for those
    rows with their exact block max and merged with re-basing (rare; tested).
backward (lse, H known): logq = s - lse, p = exp(logq);
    dS = -diag(g1) P + onehot diag(g1)                 (logp gradient only)
    dS = -p (g1 + g2 H + g2 logq) + onehot diag(g1)    (with an entropy gradient)
    dX = dS W / T,  dW = dS^T X / T
    The row scale -g1 is applied to the small [R, H] operands (dX rows, X for dW) instead of
    the [R, V_b] block, and the one-hot part is an index_add over R rows at the end.

Why this shape on the CPU: the shift (c or lse) enters the GEMM as an extra column of X
against a column of ones in W_b, so each GEMM already returns s - c: the backward does a single
elementwise pass per block (exp_) and the forward two (exp_, sum). dW_b = dS_b^T X has K = R
(one write per weight row; no V x H fp32 accumulator re-read every chunk), dX accumulates
in an [R, H] fp32 buffer. FLOPs as the row-chunked path: forward 2NHV, backward 6NHV.
"""
from __future__ import annotations

import torch

from ._common import vocab_block


# A block sum above this means the block max exceeds the running lse by > ~41: the entropy sum
# sum e (s - c) could then overflow fp32 (e up to 3e38), so such rows are redone with their
# exact block max. Catches inf / NaN too (the comparison is False).
_S_MAX = 1e18


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


def _sum_exp(zb: torch.Tensor, with_entropy: bool):
    """zb = s - c (consumed). Returns S_b = sum exp(zb), A_b = sum exp(zb) zb (or None)."""
    if not with_entropy:
        return zb.exp_().sum(1), None
    e = torch.exp(zb)
    s_b = e.sum(1)
    return s_b, e.mul_(zb).sum(1)


def _merge(m, s, a, c, s_b, a_b):
    """Merge block stats relative to shift c into the running (m, S, A) relative to m."""
    mn = torch.maximum(m, c)
    fa, fb = torch.exp(m - mn), torch.exp(c - mn)
    s_new = fa * s + fb * s_b
    a_new = None if a is None else fa * (a + (m - mn) * s) + fb * (a_b + (c - mn) * s_b)
    return mn, s_new, a_new


def blocked_stats(x, w, t, inv_temp: float, with_entropy: bool, rows: int):
    """(logp, entropy or None, lse), fp32 [n], for the compacted rows x [n, H] (torch backend)."""
    n, h = x.shape
    v = w.shape[0]
    dev = x.device
    logp = torch.empty(n, device=dev, dtype=torch.float32)
    lse_out = torch.empty_like(logp)
    ent = torch.empty_like(logp) if with_entropy else None
    for s in range(0, n, rows):
        e = min(n, s + rows)
        xa = _aug_rows(x[s:e], inv_temp)
        t_c = t[s:e]
        bv = vocab_block(e - s, v, dev)
        wa = _aug_weight_buf(bv, h, dev)
        m = s_acc = a_acc = None
        s_t = torch.zeros(e - s, device=dev, dtype=torch.float32)
        for v0 in range(0, v, bv):
            v1 = min(v, v0 + bv)
            wb = wa[: v1 - v0]
            wb[:, :h].copy_(w[v0:v1])
            xa[:, h] = 0.0 if m is None else -m
            zb = torch.mm(xa, wb.t())                      # s - m
            idx = t_c - v0
            inb = (idx >= 0) & (idx < v1 - v0)
            z_t = zb.gather(1, idx.clamp(0, v1 - v0 - 1).view(-1, 1)).squeeze(1)
            s_t = torch.where(inb, z_t if m is None else z_t + m, s_t)
            if m is None:                                  # first block: exact row max
                m = zb.amax(1)
                zb.sub_(m.view(-1, 1))
                s_acc, a_acc = _sum_exp(zb, with_entropy)
                continue
            s_b, a_b = _sum_exp(zb, with_entropy)
            # a block max far above m: exp (or sum e (s - m)) overflowed or came close, so redo
            # those rows with their exact block max and re-base them (rare)
            bad = ~(s_b <= _S_MAX)
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
                sr, ar = _sum_exp(zr, with_entropy)
                mr, sr, ar = _merge(m[r_bad], s_acc[r_bad], None if a_acc is None
                                    else a_acc[r_bad], m[r_bad] + cr, sr, ar)
                m, s_acc = m.index_copy(0, r_bad, mr), s_acc.index_copy(0, r_bad, sr)
                a_acc = None if a_acc is None else a_acc.index_copy(0, r_bad, ar)
            del zb
        log_s = torch.log(s_acc)
        lse = m + log_s
        logp[s:e] = s_t - lse
        lse_out[s:e] = lse
        if with_entropy:
            ent[s:e] = log_s - a_acc / s_acc
    return logp, ent, lse_out


def blocked_backward(x, w, t, lse, ent, g1, g2, inv_temp: float, rows: int, need_dx, need_dw):
    """(dX in x.dtype or None, dW fp32 or None) for the torch backend; see module docstring.

    g1 = dL/dlogp, g2 = dL/dH: fp32 [n] or None (not both None); ent needed when g2 is given.
    """
    n, h = x.shape
    v = w.shape[0]
    dev = x.device
    dx = torch.empty_like(x) if need_dx else None
    dw = torch.empty(v, h, device=dev, dtype=torch.float32) if need_dw else None
    for s in range(0, n, rows):
        e = min(n, s + rows)
        xa = _aug_rows(x[s:e], inv_temp)
        xs = xa[:, :h]                                     # x / T
        xa[:, h] = -lse[s:e]
        g1_c = None if g1 is None else g1[s:e]
        if g2 is None:
            r = -g1_c                                      # dS = diag(r) P + onehot
            a = g2_c = None
        else:
            r = None
            g2_c = -g2[s:e].view(-1, 1)
            a = g2[s:e] * ent[s:e]
            if g1_c is not None:
                a = a + g1_c
            a = a.view(-1, 1)
        xg = xs * r.view(-1, 1) if (need_dw and r is not None) else xs
        dxa = torch.zeros(e - s, h, device=dev, dtype=torch.float32) if need_dx else None
        bv = vocab_block(e - s, v, dev)
        wa = _aug_weight_buf(bv, h, dev)
        for v0 in range(0, v, bv):
            v1 = min(v, v0 + bv)
            wb = wa[: v1 - v0]
            wb[:, :h].copy_(w[v0:v1])
            zb = torch.mm(xa, wb.t())                      # log p
            if g2 is None:
                blk = zb.exp_()                            # P (row scale r applied outside)
            else:                                          # -p (a + g2 log p)
                p = torch.exp(zb)
                blk = zb.mul_(g2_c).sub_(a).mul_(p)
                del p
            if need_dx:
                dxa.addmm_(blk, wb[:, :h])
            if need_dw:
                if s == 0:
                    torch.mm(blk.t(), xg, out=dw[v0:v1])
                else:
                    dw[v0:v1].addmm_(blk.t(), xg)
            del zb, blk
        if g1_c is not None and need_dw:
            dw.index_add_(0, t[s:e], xs * g1_c.view(-1, 1))
        if need_dx:
            if r is not None:
                dxa.mul_(r.view(-1, 1))
            if g1_c is not None:
                dxa.add_(w.index_select(0, t[s:e]).float() * g1_c.view(-1, 1))
            if inv_temp != 1.0:
                dxa.mul_(inv_temp)
            dx[s:e] = dxa
    return dx, dw
