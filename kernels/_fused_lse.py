"""Forward row statistics straight from X and W: the logits tile GEMM (`tl.dot`) fused with the
log-sum-exp, so the [N, V] logits never reach HBM (cut-cross-entropy's idea). Backend
"triton-fused" (linear_logprobs / linear_policy_loss); imported only when that backend runs.

One program per [BLOCK_M rows x BLOCK_N vocabulary] tile computes s = (X_tile W_tile^T) / T in
registers and reduces it per row to a partial, with the target column left out of every sum
(the confident-row scheme of _rowmath.py):

    m_k = max_{j in tile k} s_j
    S_k = sum_{j in tile k, j != t} exp(s_j - m_k)
    A_k = sum_{j in tile k, j != t} exp(s_j - m_k) (s_j - m_k)       (with the entropy)
    s_t                                                             (written by the target's tile)

and writes 2 fp32 numbers per row and tile (3 with the entropy; [N, V / BLOCK_N] each: 3 / BLOCK_N
of the bytes of fp32 logits, 1/43 at BLOCK_N = 128) instead of the tile. `fused_row_stats` merges them (torch, small):

    M = max_k m_k,  a_k = exp(m_k - M)
    S_off = sum_k a_k S_k                        A_off = sum_k a_k (A_k + S_k (m_k - M))
    e_t = exp(s_t - M),  S = S_off + e_t
    lse = M + log S,  logp = s_t - lse,  off = S_off / S
    ent = log S - (A_off + e_t (s_t - M)) / S,  off_ent = A_off / S - off log S

exactly the outputs of `_rows._row_stats_kernel` (every term of A_off is <= 0: no cancellation).
The backward recomputes logits blocks (the vocabulary-outer backward of the "triton" backend): a
gradient needs dZ for both GEMMs, so fusing only the forward saves the logits' HBM write + read
and their memory, most of all for forward-only calls (old / reference log-probs in RL).

fp32 inputs use an IEEE fp32 `tl.dot`, or TF32 when torch.backends.cuda.matmul.allow_tf32 is on
(the precision torch.mm, hence the backward's recomputed logits, then has); bf16 / fp16 use the
tensor cores with an fp32 accumulator (the backward's fp32-output GEMM; where torch has none,
differentiated calls run as "triton": _common.fused_forward_backend). Under TRITON_INTERPRET=1 bf16
operands are upcast to fp32 first (exact; a CPU-only fp32 copy of W per call): the interpreter
multiplies bf16 storage bits as integers (triton issue 11584).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _lse_tile_kernel(x_ptr, w_ptr, t_ptr, pm_ptr, ps_ptr, pa_ptr, st_ptr, N, V, H, stride_x,
                     stride_w, stride_p, inv_temp, WITH_ENT: tl.constexpr,
                     DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    # Grouped program order (Triton matmul tutorial): GROUP_M row blocks sweep the vocabulary
    # together, so each W tile is read from HBM about once per group instead of once per row block.
    pid = tl.program_id(0)
    n_m = tl.cdiv(N, BLOCK_M)
    n_n = tl.cdiv(V, BLOCK_N)
    group = pid // (GROUP_M * n_n)
    first_m = group * GROUP_M
    size_m = tl.minimum(n_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * n_n)) % size_m
    pid_n = (pid % (GROUP_M * n_n)) // size_m

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    rmask = rows < N
    cmask = cols < V
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_x + ks[None, :]
    w_ptrs = w_ptr + cols[None, :].to(tl.int64) * stride_w + ks[:, None]   # W^T tile [K, N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, H, BLOCK_K):
        kmask = (k + ks) < H
        x = tl.load(x_ptrs, mask=rmask[:, None] & kmask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=kmask[:, None] & cmask[None, :], other=0.0)
        acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    s = tl.where(cmask[None, :], acc * inv_temp, float("-inf"))
    m = tl.max(s, axis=1)                      # every tile has >= 1 valid column: finite
    sm = s - m[:, None]
    t = tl.load(t_ptr + rows, mask=rmask, other=-1)
    is_t = cols[None, :] == t[:, None]
    e = tl.where(is_t, 0.0, tl.exp(sm))        # padded columns: exp(-inf) = 0; target left out
    part = rows.to(tl.int64) * stride_p + pid_n
    tl.store(pm_ptr + part, m, mask=rmask)
    tl.store(ps_ptr + part, tl.sum(e, axis=1), mask=rmask)
    if WITH_ENT:
        tl.store(pa_ptr + part, tl.sum(e * tl.where(cmask[None, :], sm, 0.0), axis=1), mask=rmask)
    s_t = tl.sum(tl.where(is_t, s, 0.0), axis=1)
    in_tile = (t >= pid_n * BLOCK_N) & (t < pid_n * BLOCK_N + BLOCK_N)
    tl.store(st_ptr + rows, s_t, mask=rmask & in_tile)


# Tiles. CUDA bf16 / fp16: 128 x 128 x 64 with 8 warps and 3 stages is the shape of the Triton
# matmul tutorial's Hopper configs (96 KiB of shared memory, wgmma); fp32 (IEEE, no tensor cores)
# uses smaller tiles. A PREDICTION until benchmarks/gpu_check.sh times it on a GPU.
# CPU (interpreter): numpy does each op of a program over the whole tile, so big tiles mean few
# Python steps.
_CUDA_TILES = {torch.bfloat16: (128, 128, 64, 8, 3), torch.float16: (128, 128, 64, 8, 3),
               torch.float32: (64, 64, 32, 4, 3)}
_CPU_TILE = (32, 128, 64, 4, 1)
GROUP_M = 8


def tile_config(dtype: torch.dtype, device: torch.device) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for the tile kernel."""
    return _CUDA_TILES[dtype] if device.type == "cuda" else _CPU_TILE


def partial_bytes_per_row(v: int, dtype: torch.dtype, device: torch.device) -> int:
    """Workspace bytes one row takes: three fp32 partials per vocabulary tile from the kernel and
    one more [C, tiles] fp32 array in the merge (about 1/32 of an fp32 logits row at 128-column
    tiles); besides that only the per-row outputs."""
    return 16 * triton.cdiv(v, tile_config(dtype, device)[1])


def fused_row_stats(x, w, t, inv_temp: float, with_entropy: bool):
    """(logp, entropy or None, lse, off, off_ent or None), fp32 [C], of s = (x @ w.T) * inv_temp
    without forming it: the contract of `_rowmath.row_stats` on the logits x @ w.T."""
    c, h = x.shape
    v = w.shape[0]
    if x.dtype != w.dtype:
        raise ValueError(f"fused_row_stats: x is {x.dtype} but w is {w.dtype}")
    x, w, t = x.contiguous(), w.contiguous(), t.long().contiguous()   # no-ops for the callers
    if x.device.type == "cpu" and x.dtype == torch.bfloat16:    # the interpreter's bf16 tl.dot
        x, w = x.float(), w.float()
    tf32 = x.dtype != torch.float32 or (x.is_cuda and torch.backends.cuda.matmul.allow_tf32)
    bm, bn, bk, nw, ns = tile_config(x.dtype, x.device)
    nt = triton.cdiv(v, bn)
    pm = torch.empty(c, nt, device=x.device, dtype=torch.float32)
    ps = torch.empty_like(pm)
    pa = torch.empty_like(pm) if with_entropy else pm      # a dummy pointer when unused
    st = torch.empty(c, device=x.device, dtype=torch.float32)
    if c:
        grid = (triton.cdiv(c, bm) * nt,)
        _lse_tile_kernel[grid](x, w, t, pm, ps, pa, st, c, v, h, x.stride(0), w.stride(0),
                               pm.stride(0), float(inv_temp), WITH_ENT=with_entropy,
                               DOT_PRECISION="tf32" if tf32 else "ieee",
                               BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=GROUP_M,
                               num_warps=nw, num_stages=ns)
    # the merge holds 4 [C, nt] fp32 arrays at most (pm, ps, pa and a): in place where it can
    big_m = pm.amax(dim=1, keepdim=True)
    dm = pm.sub_(big_m)                                     # m_k - M <= 0 (pm reused)
    a = torch.exp(dm)
    a_off = pa.addcmul_(ps, dm).mul_(a).sum(dim=1) if with_entropy else None   # sum_k a_k (A_k +
    s_off = ps.mul_(a).sum(dim=1)                                             # S_k (m_k - M))
    big_m = big_m.squeeze(1)
    sm_t = st - big_m
    e_t = torch.exp(sm_t)
    s_all = s_off + e_t
    log_s = torch.log(s_all)
    logp = sm_t - log_s
    lse = big_m + log_s
    off = s_off / s_all
    if not with_entropy:
        return logp, None, lse, off, None
    ent = log_s - (a_off + e_t * sm_t) / s_all
    return logp, ent, lse, off, a_off / s_all - off * log_s
