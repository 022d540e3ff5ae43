"""Triton kernels of the row math (see `_rowmath.py` for the formulas) and of the LM-head
transform (see `_head.py`). Imported only when the Triton backend runs: the torch backend never
imports triton.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _row_stats_kernel(z_ptr, stride_z, t_ptr, logp_ptr, ent_ptr, lse_ptr, off_ptr, off_ent_ptr, V,
                      inv_temp, WITH_ENT: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * stride_z
    t = tl.load(t_ptr + row)
    m = tl.full((), float("-inf"), tl.float32)   # running max of s (starts at -inf, not 0)
    acc_o = tl.zeros((), tl.float32)             # sum_{j != t} exp(s_j - m): the off-target mass
    acc_os = tl.zeros((), tl.float32)            # sum_{j != t} exp(s_j - m) * (s_j - m)
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        valid = cols < V
        s = tl.load(z_row + cols, mask=valid, other=float("-inf")).to(tl.float32) * inv_temp
        m_new = tl.maximum(m, tl.max(s, axis=0))  # every block has >= 1 valid column: finite
        alpha = tl.exp(m - m_new)
        sm = tl.where(valid, s - m_new, float("-inf"))
        e = tl.exp(sm)                             # 0 at padded columns
        e_off = tl.where(cols == t, 0.0, e)        # the target never enters a sum (no 1 - p_t)
        if WITH_ENT:
            # re-base the old sum of e*(s-m) to the new max: e' = alpha e, (s - m_new) = (s - m) + (m - m_new)
            # (nothing summed yet: m may be -inf; select m_new so no inf * 0 appears)
            shift = (tl.where(acc_o > 0, m, m_new) - m_new) * acc_o
            acc_os = alpha * (acc_os + shift) + tl.sum(e_off * tl.where(valid, sm, 0.0), axis=0)
        acc_o = acc_o * alpha + tl.sum(e_off, axis=0)
        m = m_new
    sm_t = tl.load(z_row + t).to(tl.float32) * inv_temp - m
    e_t = tl.exp(sm_t)
    acc = acc_o + e_t
    log_acc = tl.log(acc)
    off = acc_o / acc
    tl.store(logp_ptr + row, sm_t - log_acc)
    tl.store(lse_ptr + row, m + log_acc)
    tl.store(off_ptr + row, off)
    if WITH_ENT:
        tl.store(ent_ptr + row, log_acc - (acc_os + e_t * sm_t) / acc)
        tl.store(off_ent_ptr + row, acc_os / acc - off * log_acc)


@triton.jit
def _row_grad_kernel(z_ptr, stride_z, dz_ptr, stride_dz, t_ptr, lse_ptr, ent_ptr, g1_ptr, g2_ptr,
                     dt_ptr, V, inv_temp, HAS_G1: tl.constexpr, HAS_G2: tl.constexpr,
                     BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * stride_z
    dz_row = dz_ptr + row * stride_dz
    lse = tl.load(lse_ptr + row)
    t = tl.load(t_ptr + row)
    dt = tl.load(dt_ptr + row)                    # dL/ds_t from the off-target sums (target_grad)
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
        dz = tl.where(cols == t, dt, -p * coef)
        tl.store(dz_row + cols, (dz * inv_temp).to(dz_ptr.dtype.element_ty), mask=valid)


def _block_v(v: int, device: torch.device) -> int:
    # The interpreter is vectorized per program through numpy: big blocks = fewer Python steps.
    cap = 8192 if device.type == "cpu" else 4096
    return max(16, min(cap, triton.next_power_of_2(v)))


def _row_num_warps(v: int, device: torch.device) -> int:
    """Warps per program of the one-program-per-row kernels, by vocabulary size.

    Why not triton's default 4: a chunk is ~512 rows, so ~4 programs per SM on a 132-SM H100/H200;
    at 4 warps that is 16 of an SM's 64 warp slots, too few loads in flight to stream a 128k-wide
    row at HBM bandwidth. One warp per 256 columns of the block (16 at V >= 4096, fewer for small
    vocabularies, where a row is a few loads anyway) fills the slots. This is an occupancy argument,
    a PREDICTION: benchmarks/gpu_microbench.py sweeps 4/8/16/32 on a GPU to confirm or replace it.
    The CPU interpreter ignores num_warps.
    """
    return max(4, min(16, _block_v(v, device) // 256))


def row_stats_triton(z, t, inv_temp: float, with_entropy: bool):
    c, v = z.shape
    logp = torch.empty(c, device=z.device, dtype=torch.float32)
    lse = torch.empty_like(logp)
    off = torch.empty_like(logp)
    ent = torch.empty_like(logp) if with_entropy else logp  # dummy pointers when unused
    off_ent = torch.empty_like(logp) if with_entropy else logp
    if c:
        _row_stats_kernel[(c,)](z, z.stride(0), t, logp, ent, lse, off, off_ent, v, float(inv_temp),
                                WITH_ENT=with_entropy, BLOCK_V=_block_v(v, z.device),
                                num_warps=_row_num_warps(v, z.device))
    return logp, (ent if with_entropy else None), lse, off, (off_ent if with_entropy else None)


def row_grad_triton(z, t, lse, ent, g1, g2, inv_temp: float, out=None, *, dt):
    c, v = z.shape
    out = z if out is None else out
    if c:
        dummy = lse
        _row_grad_kernel[(c,)](z, z.stride(0), out, out.stride(0), t, lse,
                               ent if ent is not None else dummy,
                               g1 if g1 is not None else dummy, g2 if g2 is not None else dummy,
                               dt, v, float(inv_temp), HAS_G1=g1 is not None, HAS_G2=g2 is not None,
                               BLOCK_V=_block_v(v, z.device), num_warps=_row_num_warps(v, z.device))
    return out


# ---- LM-head transform (bias, logit scale, soft-cap) ---------------------------------------------
# tanh is written out (libdevice's is not available under TRITON_INTERPRET): an odd Taylor
# polynomial for |x| < 0.25, where (1 - e) / (1 + e) with e = exp(-2|x|) would lose relative
# precision to cancellation (the truncation error there is < 1e-8 relative), that quotient elsewhere
# (exp(-2|x|) -> 0 gives exactly +-1 for large |x|). A device helper, inlined by the compiler
# (tests/test_kernels_aot.py accepts it as called from the launched head kernels).


@triton.jit
def _tanh(x):
    ax = tl.abs(x)
    e = tl.exp(-2.0 * ax)
    x2 = x * x
    poly = ax * (1.0 + x2 * (-0.3333333333333333 + x2 * (0.13333333333333333 + x2 * (
        -0.05396825396825397 + x2 * 0.021869488536155203))))
    th = tl.where(ax < 0.25, poly, (1.0 - e) / (1.0 + e))
    return tl.where(x < 0, -th, th)


@triton.jit
def _head_fwd_kernel(z_ptr, stride_z, u_ptr, stride_u, b_ptr, V, scale, softcap,
                     HAS_BIAS: tl.constexpr, HAS_CAP: tl.constexpr, BLOCK_V: tl.constexpr):
    """u = scale * (z + b); u = softcap * tanh(u / softcap) when HAS_CAP. u may alias z."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    valid = cols < V
    z = tl.load(z_ptr + row * stride_z + cols, mask=valid, other=0.0).to(tl.float32)
    if HAS_BIAS:
        z += tl.load(b_ptr + cols, mask=valid, other=0.0).to(tl.float32)
    z = z * scale
    if HAS_CAP:
        z = softcap * _tanh(z / softcap)
    tl.store(u_ptr + row * stride_u + cols, z, mask=valid)


@triton.jit
def _head_bwd_kernel(z_ptr, stride_z, dz_ptr, stride_dz, b_ptr, V, scale, softcap,
                     HAS_BIAS: tl.constexpr, HAS_CAP: tl.constexpr, BLOCK_V: tl.constexpr):
    """dz *= du/dz = scale (1 - tanh^2(scale (z + b) / softcap)) (just scale without a cap); in place."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    valid = cols < V
    dz_row = dz_ptr + row * stride_dz
    g = tl.load(dz_row + cols, mask=valid, other=0.0).to(tl.float32)
    if HAS_CAP:
        z = tl.load(z_ptr + row * stride_z + cols, mask=valid, other=0.0).to(tl.float32)
        if HAS_BIAS:
            z += tl.load(b_ptr + cols, mask=valid, other=0.0).to(tl.float32)
        th = _tanh(z * scale / softcap)
        g = g * (scale * (1.0 - th * th))
    else:
        g = g * scale
    tl.store(dz_row + cols, g.to(dz_ptr.dtype.element_ty), mask=valid)


def _head_grid_block(v: int, device: torch.device) -> int:
    cap = 8192 if device.type == "cpu" else 1024
    return max(16, min(cap, triton.next_power_of_2(v)))


def head_forward_triton(z, bias, scale: float, softcap, out):
    c, v = z.shape
    if c:
        bv = _head_grid_block(v, z.device)
        _head_fwd_kernel[(c, triton.cdiv(v, bv))](
            z, z.stride(0), out, out.stride(0), bias if bias is not None else z, v, float(scale),
            float(softcap or 1.0), HAS_BIAS=bias is not None, HAS_CAP=softcap is not None,
            BLOCK_V=bv)
    return out


def head_backward_triton(dz, z_pre, bias, scale: float, softcap):
    c, v = dz.shape
    if c:
        bv = _head_grid_block(v, dz.device)
        zp = z_pre if z_pre is not None else dz
        _head_bwd_kernel[(c, triton.cdiv(v, bv))](
            zp, zp.stride(0), dz, dz.stride(0), bias if bias is not None else dz, v, float(scale),
            float(softcap or 1.0), HAS_BIAS=bias is not None, HAS_CAP=softcap is not None,
            BLOCK_V=bv)
    return dz
