"""Vocabulary-outer backward of the row-chunked path (Triton backend; LM-head variants anywhere).

The row-outer backward (rows in chunks of C, the whole vocabulary per chunk) adds every chunk's
dZ^T X_c into one fp32 [V, H] dW accumulator: a read-modify-write of V x H x 4 bytes per chunk
(2 GiB at V=128256, H=4096; ~134 GB of HBM traffic per call at N=16384, C=512). Here the loops
are swapped:

    for each row group g of R rows (R = all rows when the budget allows):
        dX_acc = 0                                    fp32 [R, H]
        for each vocabulary block b of V_b columns:
            Z_b  = X_g W_b^T                          GEMM, fp32 result   [R, V_b]
            U_b  = head(Z_b)                          (LM-head variants only)
            dZ_b = row_grad(U_b) (-> head backward)   needs only the saved lse / H per row
            dX_acc += dZ_b W_b                        GEMM, K = V_b
            dW_b  = dZ_b^T X_g                        GEMM, K = R: written once when R = N
        dX_g = dX_acc

FLOPs are unchanged (recompute 2NHV + 4NHV); with one row group each dW block is written exactly
once (in the weight's dtype, from an fp32 GEMM result), and the only accumulator is the fp32
[R, H] dX, re-read once per vocabulary block. With several row groups (a budget below the
N x H x 4 bytes of dX) dW accumulates in fp32 across groups (N / R read-modify-writes instead of
N / C). R and V_b come from a workspace budget the caller can set (`workspace_bytes`; see
`vocab_outer_plan`).
"""
from __future__ import annotations

import torch

from ._common import (WORKSPACE_BYTES_CPU, WORKSPACE_BYTES_CUDA, addmm_f32_, grad_dtype, mm_f32,
                      plan_chunk)
from ._rowmath import row_grad


def block_elem_bytes(w: torch.Tensor, head) -> int:
    """Bytes per [R, V_b] element the backward holds at once: fp32 logits, the pre-cap logits
    with a soft-cap, a separate low-precision dZ on CUDA."""
    b = 4
    if head is not None and head.needs_pre:
        b += 4
    if grad_dtype(w) != torch.float32:
        b += torch.finfo(w.dtype).bits // 8
    return b


def vocab_outer_plan(n: int, h: int, v: int, device: torch.device, *, block_elem_bytes: int,
                     workspace_bytes: int | None = None, rows: int | None = None):
    """(rows per row group R, vocabulary columns per block V_b) of `vocab_outer_backward`.

    Workspace = fp32 dX accumulator [R, H] + per block an [R, V_b] set of buffers of
    `block_elem_bytes` per element (fp32 logits, dZ, the pre-cap logits with a soft-cap) + an
    fp32 [V_b, H] dW block. R: all rows when their dX accumulator fits half the budget -- one group,
    so each dW block is written once, in its final dtype -- else the rows that fit, rounded down
    to a multiple of 64 from 128 on (GEMM-friendly groups); `rows` (the caller's chunk_size)
    overrides R. V_b: what the rest of the budget holds.
    """
    budget = workspace_bytes or (WORKSPACE_BYTES_CUDA if device.type == "cuda"
                                 else WORKSPACE_BYTES_CPU)
    row_bytes = 4 * max(h, 1)
    if rows is None and n * row_bytes <= budget // 2:
        r = max(n, 1)   # not rounded to 64: a second group would accumulate dW in fp32 for nothing
    else:
        r = min(plan_chunk(n, row_bytes, budget // 2, chunk_size=rows), max(n, 1))
    cols = plan_chunk(v, r * block_elem_bytes + h * 4, budget, fixed_bytes=r * h * 4, align=128,
                      floor=16)
    return r, cols


def vocab_outer_backward(x, w, t, lse, ent, g1, g2, inv_temp, backend, need_dx, need_dw,
                         head, need_db, rows: int, cols: int, *, dt):
    """(dX in x.dtype or None, dW in w.dtype or fp32 or None, d bias fp32 or None).

    g1 = dL/dlogp, g2 = dL/dH: fp32 [n] or None (not both None); ent needed when g2 is given;
    dt = the target entries of dL/du (_rowmath.target_grad), written by the block holding them.
    """
    n, h = x.shape
    v = w.shape[0]
    dev = x.device
    gdt = grad_dtype(w)
    one_group = rows >= n
    dx = torch.empty_like(x) if need_dx else None
    dw = None
    if need_dw:   # final dtype when each block is written once; fp32 when groups accumulate
        dw = torch.empty(v, h, device=dev, dtype=w.dtype if one_group else torch.float32)
    db = torch.zeros(v, device=dev, dtype=torch.float32) if need_db else None
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        sl = (lambda a: None if a is None else a[r0:r1])   # noqa: E731
        xg, tg = x[r0:r1], t[r0:r1]
        x_op = xg if xg.dtype == gdt else xg.to(gdt)        # dW GEMM operand
        dxa = torch.zeros(r1 - r0, h, device=dev, dtype=torch.float32) if need_dx else None
        for v0 in range(0, v, cols):
            v1 = min(v, v0 + cols)
            wb = w[v0:v1]
            hb = None if head is None else head.cols(v0, v1)
            z = mm_f32(xg, wb.t())                                        # [R, V_b] fp32
            z_pre = None
            if hb is not None:
                z_pre = z if hb.needs_pre else None
                z = hb.forward(z, backend, out=torch.empty_like(z) if hb.needs_pre else None)
            out = z if (hb is not None or gdt == torch.float32) else \
                torch.empty(z.shape, device=dev, dtype=gdt)
            dz = row_grad(z, tg - v0, sl(lse), sl(ent), sl(g1), sl(g2), inv_temp, backend,
                          out=out, dt=sl(dt))
            if hb is not None:
                dz = hb.backward_(dz, z_pre, backend)                     # dL/d(X W^T)
                if db is not None:
                    db[v0:v1] += dz.sum(0)
                if gdt != torch.float32:
                    dz = dz.to(gdt)
            del z, z_pre
            if dxa is not None:
                addmm_f32_(dxa, dz, wb if wb.dtype == dz.dtype else wb.to(dz.dtype))
            if dw is not None:
                if r0 > 0:
                    addmm_f32_(dw[v0:v1], dz.t(), x_op)
                elif dw.dtype == torch.float32 and dz.dtype == torch.float32:
                    torch.mm(dz.t(), x_op, out=dw[v0:v1])
                else:
                    dw[v0:v1] = mm_f32(dz.t(), x_op)          # fp32 GEMM result, rounded once
            del dz
        if dx is not None:
            dx[r0:r1] = dxa
    return dx, dw, db
