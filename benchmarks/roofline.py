"""Roofline model of the LM-head log-prob / policy-loss methods on an H200 / H100 (a PREDICTION).

    python benchmarks/roofline.py [--device h200|h100] [--json PATH] [--measured JSON ...]
                                  [--budget-gib 1.5] [--workspace-gib G] [--shapes HxV ...]
                                  [--fused-workspace-gib G] [--fused-ideas]

For every method of bench_logprobs.py / bench_policy_loss.py (ours as `ours-logprobs` and
`ours-fused-loss` in labelled designs, `design_key`: "row-chunked" with the V x H fp32 dW
accumulator and 256 MiB logits chunks, "vocab-outer" as kernels/_vocab_outer.py does it with the
code's own block plan, "fused-fwd" the backend "triton-fused" (tl.dot + LSE tile forward); for the fused loss "budgeted" (row-chunked, chunks from the code's own
`fused_loss_rows` workspace plan, fp32 dW accumulator: the default), "budgeted-bf16" (the same
with `dw_accum_dtype=torch.bfloat16`, opt-in, at a 1.5 GiB budget), a HYPOTHETICAL two-sweep
"vocab-outer" and a HYPOTHETICAL "bf16-acc" (bf16 dW + per-token terms fused into the row
kernel); which one the code runs is in `design`) and
every shape, the model lists the pieces one fwd+bwd runs (GEMMs, logits passes,
row kernels, dW / dX accumulators, small-op launches), each with its FLOPs and HBM bytes, and
predicts a piece's time as its roofline max(FLOPs / matmul rate, bytes / bandwidth) (`predicted_ms`,
the sum over pieces) and, as a pessimistic bound with no overlap inside a piece, FLOPs / rate +
bytes / bandwidth (`predicted_serial_ms`). `floor_ms` is the method's own GEMM FLOPs at the
matmul rate (6NHV for one pass with the gradient known in the forward, 8NHV when the backward
recomputes the logits); `bound_by` names what keeps the method off that floor (the piece with the
largest time above its FLOP time), or "GEMM FLOPs" when that excess is under 10%.

Device numbers (bf16 dense matmul rate, HBM bandwidth counting bytes read + written):
- h200: 790 TFLOP/s, 4.3 TB/s, measured on the project's H200 (8192^3 bf16 matmul through
  PyTorch 769-798 TFLOP/s; device-to-device copy ~4.3 TB/s; ../shared/ENVIRONMENT.md).
- h100 (SXM): not measured. Same GH100 compute as the H200 (132 SMs, 989 TFLOP/s dense bf16 on
  the datasheet), so the H200's measured 790 TFLOP/s is assumed; HBM3 3.35 TB/s on the datasheet
  times the H200's measured / datasheet ratio (4.3 / 4.8) = 3.0 TB/s.

What is assumed (all in this file, per method): GEMM operands are read from HBM once (L2 reuse
inside the GEMM); a small torch op costs LAUNCH_US; peers' internals as read from their sources
(liger-kernel 0.8.5: bf16 dW accumulator, chunk = next_pow2(N / ceil(V / H)); cut-cross-entropy
25.1.1: dE / dC accumulated in bf16 per (row, vocab) tile under locks, gradient filtering not
modelled; torch's F.linear_cross_entropy: the reference linear + cross_entropy, and its chunked
option with reduction="none" recomputes in the backward (256-row chunks, bf16 dW accumulation
assumed). It is a model: the numbers to trust are measured ones (bench_*_gpu.json); `--measured`
prints them beside the prediction.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

DEVICES = {
    "h200": {"name": "NVIDIA H200", "tflops": 790.0, "tbps": 4.3,
             "source": "measured on the project's H200 (8192^3 bf16 matmul 769-798 TFLOP/s, "
                       "D2D copy 4.3 TB/s)"},
    "h100": {"name": "NVIDIA H100 SXM", "tflops": 790.0, "tbps": 3.0,
             "source": "not measured: H200's measured matmul rate (same GH100 compute, 989 "
                       "TFLOP/s datasheet); 3.35 TB/s datasheet x 4.3/4.8 (H200 measured/datasheet)"},
}
LAUNCH_US = 5.0          # one small torch op on the GPU (launch + tiny kernel), assumed
BF16 = 2
F32 = 4
GPU_SHAPES = [(576, 49152), (2048, 151936), (4096, 128256)]
TARGET = {"N": 16384, "H": 4096, "V": 128256}
CHUNK_BYTES_CUDA = 256 << 20     # kernels/_common.py: fp32 [C, V] logits per chunk on CUDA


@dataclass
class Piece:
    name: str
    flops: float = 0.0           # per occurrence
    bytes: float = 0.0           # HBM bytes read + written, per occurrence
    count: float = 1.0
    launches: float = 0.0        # small-op launches (LAUNCH_US each), per occurrence

    def ms(self, dev, serial=False) -> float:
        c = self.flops / (dev["tflops"] * 1e12)
        m = self.bytes / (dev["tbps"] * 1e12)
        t = (c + m) if serial else max(c, m)
        return self.count * (t + self.launches * LAUNCH_US * 1e-6) * 1e3


def gemm(name, m, n, k, out_bytes=BF16, accumulate=False, a_bytes=BF16, b_bytes=BF16, count=1):
    """[m, k] x [k, n] -> [m, n]; accumulate: the output is also read (beta = 1)."""
    return Piece(name, 2.0 * m * n * k,
                 m * k * a_bytes + n * k * b_bytes + m * n * out_bytes * (2 if accumulate else 1),
                 count)


def passes(name, nbytes, count=1, launches=0):
    return Piece(name, 0.0, nbytes, count, launches)


@dataclass
class Design:
    method: str                  # name as in bench_logprobs / bench_policy_loss (ours: ours-*)
    design: str
    bench_method: str | None     # the benchmark's method name (to join measured numbers)
    computes_masked_rows: bool   # mask-agnostic: all N rows whatever the unmasked fraction
    floor_nhv: int               # 6 or 8: the method's GEMM FLOPs in units of N H V
    pieces: list = field(default_factory=list)
    workspace: float = 0.0
    notes: str = ""
    key: str = "reference"       # ours: "row-chunked", "vocab-outer", "budgeted", "budgeted-bf16",
    #                              "bf16-acc"


# ---- methods ------------------------------------------------------------------------------------


def naive(n, h, v):
    nv = n * v
    return Design("naive", "materialized [N, V] logits (bf16 GEMM, fp32 log_softmax)", "naive",
                  True, 6, [
                      gemm("logits GEMM X W^T (bf16 out)", n, v, h),
                      passes("logits .float() (read bf16, write fp32)", nv * (BF16 + F32)),
                      passes("log_softmax fwd (2 reads + 1 write, fp32)", nv * 3 * F32),
                      passes("gather bwd: zeros [N, V] fp32", nv * F32),
                      passes("log_softmax bwd (3 reads + 1 write, fp32)", nv * 4 * F32),
                      passes("cast bwd fp32 -> bf16", nv * (F32 + BF16)),
                      gemm("dX = dZ W", n, h, v),
                      gemm("dW = dZ^T X", v, h, n),
                  ], workspace=nv * 3 * F32,
                  notes="workspace: saved fp32 log_softmax output + two fp32 [N, V] grads")


def compile_chunked(n, h, v, chunk=512):
    c = min(chunk, n)
    k = math.ceil(n / c)
    return Design("torch.compile chunked", "512-row checkpointed chunks, compiled log_softmax",
                  "torch.compile chunked", False, 8, [
                      gemm("fwd logits GEMM per chunk (bf16 out)", c, v, h, count=k),
                      passes("fwd fused log_softmax + gather (2 reads)", c * v * 2 * BF16, k),
                      gemm("bwd recompute logits GEMM", c, v, h, count=k),
                      passes("bwd fused softmax grad (2 reads + 1 write, bf16)", c * v * 3 * BF16, k),
                      gemm("dX_c = dZ W", c, h, v, count=k),
                      gemm("dW_c = dZ^T X_c (new bf16 V x H)", v, h, c, count=k),
                      passes("autograd sums dW_c into w.grad (2 reads + 1 write, bf16)",
                             v * h * 3 * BF16, max(0, k - 1)),
                  ], workspace=c * v * 3 * BF16 + v * h * BF16,
                  notes="workspace: chunk logits/grads + one chunk's bf16 dW before it is summed")


def torch_lce(n, h, v):
    nv = n * v
    return Design("F.linear_cross_entropy", "reference linear + cross_entropy (assumed)",
                  "F.linear_cross_entropy", True, 6, [
                      gemm("logits GEMM (bf16 out)", n, v, h),
                      passes("log_softmax fwd (2 reads + 1 write, bf16)", nv * 3 * BF16),
                      passes("nll bwd: zeros [N, V] bf16", nv * BF16),
                      passes("log_softmax bwd (3 reads + 1 write, bf16)", nv * 4 * BF16),
                      gemm("dX = dZ W", n, h, v),
                      gemm("dW = dZ^T X", v, h, n),
                  ], workspace=nv * 3 * BF16, notes="workspace: three bf16 [N, V] tensors")


def torch_lce_chunked(n, h, v):
    # LinearCrossEntropyOptions() on CUDA bf16: chunking "aspect_ratio:2" =
    # next_pow2(ceil(N / ceil(V / H))) / 2 rows; reduction="none" recomputes in the backward.
    c = min(n, max(1, 2 ** math.ceil(math.log2(math.ceil(n / math.ceil(v / h)))) // 2))
    k = math.ceil(n / c)
    return Design("F.linear_cross_entropy chunked",
                  f"{c}-row chunks, backward recomputes (reduction='none'), bf16 dW acc (assumed)",
                  "F.linear_cross_entropy chunked", True, 8, [
                      gemm("fwd logits GEMM per chunk", c, v, h, count=k),
                      passes("fwd lse (2 reads, bf16)", c * v * 2 * BF16, k),
                      gemm("bwd recompute logits GEMM", c, v, h, count=k),
                      passes("bwd softmax grad (2 reads + 1 write)", c * v * 3 * BF16, k),
                      gemm("dX_c = dZ W", c, h, v, count=k),
                      gemm("dW += dZ^T X_c (bf16 accumulator)", v, h, c, accumulate=True, count=k),
                  ], workspace=c * v * 2 * BF16, notes="workspace: one chunk's logits + grad")


def liger_flce(n, h, v):
    c = min(n, 2 ** math.ceil(math.log2(math.ceil(n / math.ceil(v / h)))))
    k = math.ceil(n / c)
    return Design("liger FLCE", f"{c}-row chunks, gradients in the forward, bf16 dW accumulator",
                  "liger FLCE", True, 6, [
                      gemm("logits GEMM per chunk (bf16 out)", c, v, h, count=k),
                      passes("CE kernel: 2 reads + grad written in place (bf16)",
                             c * v * 3 * BF16, k),
                      gemm("dX_c = dZ W", c, h, v, count=k),
                      gemm("dW += dZ^T X_c (bf16 accumulator, addmm)", v, h, c, accumulate=True,
                           count=k),
                  ], workspace=c * v * 2 * F32,
                  notes="liger-kernel 0.8.5 (accum_dtype=None); all rows computed (ignore_index)")


def cce(n, h, v, block=128):
    nb, vb = math.ceil(n / block), math.ceil(v / block)
    return Design("cut-cross-entropy", "fused tiles: logits never in HBM; dE/dC bf16 tile "
                  "read-modify-write under locks, no gradient filtering",
                  "cut-cross-entropy", False, 8, [
                      gemm("fwd fused logits tiles + online lse", n, v, h, out_bytes=0),
                      gemm("bwd recompute logits tiles", n, v, h, out_bytes=0),
                      gemm("bwd dE tiles (K = V tile)", n, h, v, out_bytes=0),
                      gemm("bwd dC tiles (K = row tile)", v, h, n, out_bytes=0),
                      passes(f"dE += per {block}-col tile (bf16 RMW, {vb} tiles per row)",
                             vb * n * h * 2 * BF16),
                      passes(f"dC += per {block}-row tile (bf16 RMW, {nb} tiles per vocab row)",
                             nb * v * h * 2 * BF16),
                  ], workspace=0.0,
                  notes="upper bound: the tile read-modify-writes may hit L2, and on trained "
                        "models CCE filters most vocabulary tiles out of the backward")


FUSED_TILE_N = 128               # kernels/_fused_lse.py: vocabulary columns per bf16 tile


def _ours_chunk(n, v):
    rows = max(1, CHUNK_BYTES_CUDA // (F32 * v))
    if rows >= 64:
        rows -= rows % 64
    return max(1, min(rows, n))


def _row_chunked_forward(n, h, v, c, k, ops, ops_name, z_bytes=F32):
    zt = "fp32" if z_bytes == F32 else "bf16"
    return [gemm(f"fwd Z = X_c W^T ({zt} out)", c, v, h, out_bytes=z_bytes, count=k),
            passes(f"fwd _row_stats_kernel (1 read {zt})", c * v * z_bytes, k),
            passes(ops_name, 0, k, ops)]


def _row_chunked_backward(n, h, v, c, k, recompute, z_bytes=F32, first_mm=False):
    """first_mm: the first chunk writes dW with a plain GEMM (no zero-fill, no read of zeros)."""
    out = []
    if recompute:
        out.append(gemm("bwd recompute Z (fp32 out)", c, v, h, out_bytes=F32, count=k))
    zt = "fp32" if z_bytes == F32 else "bf16"
    out += [
        passes(f"_row_grad_kernel (read {zt} Z, write bf16 dZ)", c * v * (z_bytes + BF16), k),
        gemm("dX_c = dZ W", c, h, v, count=k),
        gemm("dW += dZ^T X_c (fp32 V x H accumulator, addmm)", v, h, c, out_bytes=F32,
             accumulate=True, count=k - 1 if first_mm else k)]
    if first_mm:
        return out + [gemm("dW = dZ^T X_c, first chunk (fp32 V x H, plain mm)", v, h, c,
                           out_bytes=F32),
                      passes("dW: final cast to bf16", v * h * (F32 + BF16))]
    return out + [passes("dW: zero fp32 accumulator + final cast to bf16",
                         v * h * (F32 + F32 + BF16))]


def _vocab_outer_backward(n, h, v, plan_bytes):
    """kernels/_vocab_outer.py as written: row groups of R rows (all rows when their fp32 dX
    accumulator fits half the budget), vocabulary blocks of V_b columns, both from the code's own
    `vocab_outer_plan`. Per block: Z_b GEMM (fp32 out), row kernel (fp32 in, bf16 dZ out),
    dX_acc += dZ_b W_b (fp32 accumulator), dW_b = dZ_b^T X (K = R) as an fp32 GEMM result
    rounded once into the bf16 dW (first group) or added into an fp32 dW (later groups)."""
    import torch
    from fastrehearse.kernels._common import vocab_outer_plan
    rows, cols = vocab_outer_plan(n, h, v, torch.device("cuda"), block_elem_bytes=F32 + BF16,
                                  workspace_bytes=int(plan_bytes) if plan_bytes else None)
    r = min(rows, n)
    groups = math.ceil(n / r)
    k = math.ceil(v / cols)
    w = v / k                                            # the average block width
    kk = groups * k
    pieces = [
        gemm(f"bwd Z_b = X_g W_b^T (fp32 out; {groups} row group(s) of {r}, {k} blocks of "
             f"<= {cols})", r, w, h, out_bytes=F32, count=kk),
        passes("_row_grad_kernel on the [R, V_b] block", r * w * (F32 + BF16), kk),
        gemm("dX_acc += dZ_b W_b (fp32 [R, H] accumulator)", r, h, w, out_bytes=F32,
             accumulate=True, count=kk),
        gemm("dW_b = dZ_b^T X_g (K = R, fp32 result)", w, h, r, out_bytes=F32, count=k),
        passes("dW_b fp32 result rounded into the bf16 dW", w * h * (F32 + BF16), k),
        passes("dX_acc zeroed, copied out to bf16 dX", r * h * (F32 + F32 + BF16), groups),
        passes("small torch ops per vocab block (bwd)", 0, kk, 3),
    ]
    ws = r * h * F32 + r * cols * (F32 + BF16) + cols * h * F32
    if groups > 1:
        pieces += [gemm("dW_b += dZ_b^T X_g (later groups, fp32 V x H)", w, h, r, out_bytes=F32,
                        accumulate=True, count=(groups - 1) * k),
                   passes("fp32 dW cast to bf16", v * h * (F32 + BF16))]
        ws += v * h * F32
    return pieces, ws, (groups, r, cols)


def ours_logprobs(n, h, v, design, budget):
    c = _ours_chunk(n, v)
    k = math.ceil(n / c)
    fwd = _row_chunked_forward(n, h, v, c, k, 4, "small torch ops per chunk (fwd: copies out)")
    if design == "row-chunked":
        return Design("ours-logprobs", "row-chunked backward, V x H fp32 dW read-modify-write "
                      "(the CUDA path before commit c0f2889)", "ours (triton)", False, 8,
                      fwd + _row_chunked_backward(n, h, v, c, k, recompute=True)
                      + [passes("small torch ops per chunk (bwd)", 0, k, 3)],
                      workspace=v * h * F32 + c * v * (F32 + BF16), key=design,
                      notes=f"{c}-row chunks; workspace: fp32 dW accumulator + fp32 Z + bf16 dZ")
    bwd, ws, (groups, r, cols) = _vocab_outer_backward(n, h, v, budget)
    if design == "fused-fwd":
        # backend="triton-fused" (kernels/_fused_lse.py): the forward's logits live in registers
        # (tl.dot tiles of FUSED_TILE_N columns + an online LSE), 3 fp32 partials per row and
        # tile go out, a torch merge reads them back; the backward is the vocabulary-outer one
        nt = math.ceil(v / FUSED_TILE_N)
        fwd_f = [gemm(f"fwd fused tiles: Z in registers + LSE ({FUSED_TILE_N}-col tiles, 3 fp32 "
                      f"partials per row and tile)", n, v, h, out_bytes=3 * F32 / FUSED_TILE_N),
                 passes(f"merge the partials (torch: ~7 reads + 3 writes of [N, {nt}] fp32)",
                        10 * n * nt * F32, 1, 14)]
        return Design("ours-logprobs", "backend triton-fused: tl.dot + LSE tile kernel forward "
                      "(logits never in HBM), vocabulary-outer backward", "ours (triton-fused)",
                      False, 8, fwd_f + bwd, workspace=max(ws, 4 * n * nt * F32), key=design,
                      notes=f"forward one launch, {nt} vocabulary tiles, its tl.dot ASSUMED at "
                            f"the cuBLAS rate (Triton Hopper GEMMs often run 10-30% below: then "
                            f"this design is the slower one); backward {groups} group(s) of {r} "
                            f"rows x V_b={cols}")
    return Design("ours-logprobs", "vocabulary-outer backward (the CUDA path since commit "
                  "c0f2889: kernels/_vocab_outer.py, blocks from vocab_outer_plan)",
                  "ours (triton)", False, 8, fwd + bwd,
                  workspace=max(ws, c * v * F32), key=design,
                  notes=f"forward {c}-row chunks; backward {groups} group(s) of {r} rows x V_b="
                        f"{cols}; workspace: fp32 [R, H] dX accumulator + fp32 Z_b + bf16 dZ_b + "
                        f"fp32 dW_b")


# The workspace budget the roofline gives the dw_accum_dtype=bf16 design (the issue-17 bound);
# the code's default (FUSED_WORKSPACE_BYTES_CUDA, 3 GiB) would hold twice the rows.
BF16_ACC_BUDGET = 1.5 * 2 ** 30

# Small kernels per chunk of kernels/policy_loss.py's sweep besides its GEMMs and row kernels:
# per-token loss terms, derivatives, metric stores. Counted (aten ops under a TorchDispatchMode,
# Triton path, per extra chunk) for the default PolicyLossConfig (ppo_clip, no KL / entropy):
# 34 elementwise kernels + 4 stores; with KL and an entropy bonus ~59.
FUSED_LOSS_OPS = 38


def _fused_elem_bytes(z_bytes=F32):
    """Bytes per logit a fused-loss chunk holds on CUDA (bf16 weights, no head variant): fp32 Z
    + a bf16 dZ (`_vocab_outer.block_elem_bytes`); bf16 Z (idea (b)) would take dZ in place."""
    return F32 + BF16 if z_bytes == F32 else BF16


def _fused_rows(n, h, v, fused_budget, z_bytes=F32, acc32=True):
    """kernels/policy_loss.py's rows per chunk on CUDA, from the code's own helper
    (`_common.fused_loss_rows`, default FUSED_WORKSPACE_BYTES_CUDA): the fp32 V x H dW
    accumulator fixed (none with dw_accum_dtype=bf16: acc32=False), `_fused_elem_bytes` per
    logit of a chunk."""
    import torch
    from fastrehearse.kernels._common import fused_loss_rows
    return fused_loss_rows(n, v, torch.device("cuda"), elem_bytes=_fused_elem_bytes(z_bytes),
                           fixed_bytes=v * h * F32 if acc32 else 0,
                           workspace_bytes=int(fused_budget) if fused_budget else None)


def ours_fused_loss(n, h, v, design, budget, fused_budget=None, z_bytes=F32, first_mm=False):
    """z_bytes=BF16 (idea (b): logits kept in bf16) and first_mm (idea (c)) are variants of the
    "budgeted" design the code does NOT run; fused_loss_ideas() lists them."""
    c = _ours_chunk(n, v)
    if design == "budgeted":       # the current code: rows from the workspace budget
        c = _fused_rows(n, h, v, fused_budget, z_bytes)
    if design == "budgeted-bf16":  # the current code with dw_accum_dtype=torch.bfloat16
        c = _fused_rows(n, h, v, fused_budget if fused_budget else BF16_ACC_BUDGET, z_bytes,
                        acc32=False)
    k = math.ceil(n / c)
    cw = n / k                     # the average chunk (the last one may be narrower)
    fwd = _row_chunked_forward(n, h, v, cw, k, FUSED_LOSS_OPS,
                               "per-token loss terms + derivatives (small torch ops per chunk)",
                               z_bytes)
    if design in ("row-chunked", "budgeted"):
        what = ("one pass, row-chunked, V x H fp32 dW read-modify-write per chunk, "
                + ("chunks from a workspace budget counting the accumulator (the current CUDA "
                   "path, _common.fused_loss_rows)" if design == "budgeted" else
                   "256 MiB logits chunks (the CUDA path before commit 174ba20)"))
        return Design("ours-fused-loss", what, "fused (triton)", False, 6,
                      fwd + _row_chunked_backward(n, h, v, cw, k, False, z_bytes, first_mm),
                      workspace=v * h * F32 + c * v * _fused_elem_bytes(z_bytes), key=design,
                      notes=f"{k} chunks of <= {c} rows; gradients made in the forward (6NHV); "
                            f"workspace: fp32 dW accumulator + fp32 Z + bf16 dZ of one chunk")
    if design == "budgeted-bf16":
        pieces = fwd + [
            passes("_row_grad_kernel (read fp32 Z, write bf16 dZ)", cw * v * (F32 + BF16), k),
            gemm("dX_c = dZ W", cw, h, v, count=k),
            gemm("dW += dZ^T X_c (bf16 V x H: the returned dW, fp32 inside the GEMM)", v, h, cw,
                 accumulate=True, count=k)]
        return Design("ours-fused-loss", "one pass, row-chunked, dW accumulated in the returned "
                      "bf16 dW (dw_accum_dtype=torch.bfloat16: rounded once per chunk, as Liger), "
                      "chunks from the workspace budget (no accumulator in it)",
                      "fused (triton, bf16 dW, 1.5 GiB)",
                      False, 6, pieces, workspace=c * v * _fused_elem_bytes(z_bytes), key=design,
                      notes=f"{k} chunks of <= {c} rows (workspace_bytes="
                            f"{(fused_budget or BF16_ACC_BUDGET) / 2 ** 30:g} GiB); workspace: "
                            f"fp32 Z + bf16 dZ of one chunk")
    if design == "bf16-acc":
        pieces = [p for p in fwd if "small torch ops" not in p.name] + [
            passes("_row_grad_kernel (read fp32 Z, write bf16 dZ)", cw * v * (F32 + BF16), k),
            gemm("dX_c = dZ W", cw, h, v, count=k),
            gemm("dW += dZ^T X_c (bf16 V x H accumulator, fp32 inside the GEMM)", v, h, cw,
                 accumulate=True, count=k),
            passes("small torch ops per chunk (per-token terms fused into the row kernel)", 0,
                   k, 3)]
        return Design("ours-fused-loss", "HYPOTHETICAL: one pass, row-chunked, bf16 dW "
                      "accumulator (as Liger; dW rounded to bf16 once per chunk) and the "
                      "per-token loss terms fused into the row kernel", "fused (triton)", False,
                      6, pieces, workspace=c * v * (F32 + BF16), key=design,
                      notes="not implemented: trades the fp32 dW accumulation for time + memory")
    bwd, ws, (groups, r, cols) = _vocab_outer_backward(n, h, v, budget)
    return Design("ours-fused-loss", "HYPOTHETICAL two sweeps: row-chunked stats, then the "
                  "vocabulary-outer backward (the per-token gradient needs the whole row's lse "
                  "first: 8NHV)", "fused (triton)", False, 8, fwd + bwd,
                  workspace=max(ws, c * v * F32), key=design,
                  notes=f"not implemented; V_b={cols}: meets the workspace bound at the price of "
                        f"a logits recompute")


def fused_loss_ideas(dev_key="h200", n=None, h=None, v=None) -> list[dict]:
    """The fused-loss variants weighed against the issue-17 targets (docs/gpu.md section 2), at
    the target shape by default. Only `budget 3 GiB` (the default) is what the code runs."""
    n, h, v = n or TARGET["N"], h or TARGET["H"], v or TARGET["V"]
    dev = DEVICES[dev_key]
    floor = 6 * n * h * v / (dev["tflops"] * 1e12) * 1e3
    gib = 2 ** 30
    unsound_b = ("unsound: log-probs from bf16-rounded logits are off by up to ~6e-2 nats vs "
                 "float64 at logit std 3 (fp32 logits: ~1e-5)")
    rows = [("before: 256 MiB logits chunks", ours_fused_loss(n, h, v, "row-chunked", None),
             "sound (the code before 174ba20)")]
    for b in (2.5, 3.0, 4.0, 6.0):
        rows.append((f"(a) budget {b:g} GiB", ours_fused_loss(n, h, v, "budgeted", None, b * gib),
                     "sound" + (", the default (current code)" if b == 3.0 else "")))
    rows += [("(a) 3 GiB + (c) first chunk plain mm",
              ours_fused_loss(n, h, v, "budgeted", None, 3 * gib, first_mm=True),
              "sound; not implemented (needs linear_logprobs.chunk_grad to write, not add)"),
             ("(a) 3 GiB + (b) bf16 logits",
              ours_fused_loss(n, h, v, "budgeted", None, 3 * gib, z_bytes=BF16), unsound_b),
             ("two sweeps, vocabulary-outer", ours_fused_loss(n, h, v, "vocab-outer", None),
              "sound, 8NHV; not implemented"),
             ("fused=False (linear_logprobs + torch loss)", ours_unfused(n, h, v, None),
              "sound, 8NHV (the code's unfused path)"),
             ("bf16 dW accumulator + per-token terms in the row kernel",
              ours_fused_loss(n, h, v, "bf16-acc", None),
              "gives up fp32 dW accumulation; the per-token fusion is not implemented")]
    for b in (1.0, 1.5, 3.0):
        rows.append((f"dw_accum_dtype=bf16, budget {b:g} GiB",
                     ours_fused_loss(n, h, v, "budgeted-bf16", None, b * gib),
                     "implemented (opt-in); dW rounded to bf16 once per chunk"))
    out = []
    for name, d, verdict in rows:
        t = sum(p.ms(dev) for p in d.pieces)
        out.append({"idea": name, "device": dev["name"], "N": n, "H": h, "V": v,
                    "predicted_ms": round(t, 3), "ratio_to_6nhv": round(t / floor, 4),
                    "workspace_bytes": int(d.workspace), "notes": d.notes, "verdict": verdict})
    return out


def ours_unfused(n, h, v, budget):
    d = ours_logprobs(n, h, v, "vocab-outer", budget)
    d.method, d.bench_method = "unfused (triton)", "unfused (triton)"
    d.design = "linear_logprobs (vocabulary-outer backward) + torch loss"
    d.pieces.append(passes("torch loss + autograd (per-token ops)", 0, 1, 60))
    return d


def liger_grpo(n, h, v, seq=256):
    k = math.ceil(n / seq)
    return Design("liger chunked GRPO", f"{seq}-row chunks (one sequence), torch.func grad per "
                  "chunk, bf16 dW summed per chunk", "liger chunked GRPO", True, 6, [
                      gemm("logits GEMM per chunk", seq, v, h, out_bytes=F32, count=k),
                      passes("compiled loss fwd+bwd over fp32 logits (3 reads + 1 write)",
                             seq * v * 4 * F32, k),
                      gemm("dX_c = dZ W", seq, h, v, count=k),
                      gemm("dW_c = dZ^T X_c (new bf16 V x H)", v, h, seq, count=k),
                      passes("grad_weight += dW_c (2 reads + 1 write, bf16)", v * h * 3 * BF16, k),
                  ], workspace=seq * v * 2 * F32 + v * h * BF16,
                  notes="all rows computed (no compaction); assumed from liger_kernel.chunked_loss")


LOGPROB_METHODS = ["naive", "torch.compile chunked", "F.linear_cross_entropy",
                   "F.linear_cross_entropy chunked", "liger FLCE", "cut-cross-entropy",
                   "ours-logprobs"]
LOSS_METHODS = ["ours-fused-loss", "unfused (triton)", "liger chunked GRPO"]


def designs(n_all, n_unmasked, h, v, budget, fused_budget=None):
    nu = n_unmasked
    out = [naive(n_all, h, v), compile_chunked(nu, h, v), torch_lce(n_all, h, v),
           torch_lce_chunked(n_all, h, v), liger_flce(n_all, h, v), cce(nu, h, v)]
    for d in ("row-chunked", "vocab-outer", "fused-fwd"):
        out.append(ours_logprobs(nu, h, v, d, budget))
    for d in ("budgeted", "budgeted-bf16", "row-chunked", "vocab-outer", "bf16-acc"):
        out.append(ours_fused_loss(nu, h, v, d, budget, fused_budget))
    out += [ours_unfused(nu, h, v, budget), liger_grpo(n_all, h, v)]
    return out


# ---- records ------------------------------------------------------------------------------------


def record(d: Design, dev_key: str, n: int, h: int, v: int, frac: float) -> dict:
    dev = DEVICES[dev_key]
    rows = n if d.computes_masked_rows else round(frac * n)
    pred = sum(p.ms(dev) for p in d.pieces)
    serial = sum(p.ms(dev, serial=True) for p in d.pieces)
    floor = d.floor_nhv * rows * h * v / (dev["tflops"] * 1e12) * 1e3
    flops = sum(p.flops * p.count for p in d.pieces)
    nbytes = sum(p.bytes * p.count for p in d.pieces)
    excess = {p.name: p.ms(dev) - p.count * p.flops / (dev["tflops"] * 1e12) * 1e3
              for p in d.pieces}
    worst = max(excess, key=excess.get)
    bound = ("GEMM FLOPs" if pred <= 0 or sum(excess.values()) < 0.1 * pred
             else ("launches: " if "small torch ops" in worst else "HBM: ") + worst)
    return {"method": d.method, "design": d.design, "design_key": d.key, "bench_method": d.bench_method,
            "device": dev["name"], "matmul_tflops": dev["tflops"], "hbm_tbps": dev["tbps"],
            "N": n, "H": h, "V": v, "unmasked": frac, "rows_computed": rows, "dtype": "bf16",
            "predicted_ms": round(pred, 3), "predicted_serial_ms": round(serial, 3),
            "floor_ms": round(floor, 3), "floor_flops": f"{d.floor_nhv} * rows * H * V",
            "ratio_to_floor": round(pred / floor, 4) if floor else None,
            "ratio_to_6nhv_all_rows": round(pred / (6 * n * h * v / (dev["tflops"] * 1e12) * 1e3), 4),
            "flops": flops, "hbm_bytes": nbytes, "workspace_bytes": int(d.workspace),
            "bound_by": bound, "notes": d.notes,
            "pieces": [{"name": p.name, "count": p.count, "flops": p.flops, "bytes": p.bytes,
                        "launches": p.launches, "ms": round(p.ms(dev), 4)} for p in d.pieces]}


def build(dev_key="h200", shapes=None, ns=None, fracs=None, workspace_gib=None,
          fused_workspace_gib=None) -> list[dict]:
    """workspace_gib: the vocabulary-outer plan's budget; fused_workspace_gib: the fused loss's
    (None: the code's defaults)."""
    shapes = shapes or GPU_SHAPES
    ns = ns or [4096, 16384]
    fracs = fracs or [1.0, 0.5, 0.25]
    recs = []
    for h, v in shapes:
        for n in ns:
            for f in fracs:
                for d in designs(n, round(f * n), h, v,
                                 workspace_gib * 2 ** 30 if workspace_gib else None,
                                 fused_workspace_gib * 2 ** 30 if fused_workspace_gib else None):
                    recs.append(record(d, dev_key, n, h, v, f))
    return recs


def targets(recs: list[dict], budget_gib=1.5) -> list[dict]:
    """The issue-17 targets at N=16384, H=4096, V=128256, all rows: fused loss <= 1.10x its
    6NHV floor, linear_logprobs <= 1.10x its 8NHV floor, workspace <= budget."""
    six = 6 * TARGET["N"] * TARGET["H"] * TARGET["V"]
    quarter = {(r["method"], r["design"]): r["predicted_ms"] for r in recs
               if (r["N"], r["H"], r["V"], r["unmasked"]) == (*TARGET.values(), 0.25)}
    out = []
    for r in recs:
        if (r["N"], r["H"], r["V"], r["unmasked"]) != (TARGET["N"], TARGET["H"], TARGET["V"], 1.0):
            continue
        if r["method"] not in ("ours-logprobs", "ours-fused-loss"):
            continue
        nhv = 6 if r["method"] == "ours-fused-loss" else 8
        floor = nhv / 6 * six / (r["matmul_tflops"] * 1e12) * 1e3
        t = r["predicted_ms"] / floor
        out.append({"method": r["method"], "design": r["design"], "design_key": r["design_key"],
                    "time_vs_target_floor":
                    round(t, 3), "target_floor": f"{nhv}NHV = {floor:.1f} ms",
                    "time_met": t <= 1.10, "workspace_gib": round(r["workspace_bytes"] / 2**30, 3),
                    "workspace_met": r["workspace_bytes"] <= budget_gib * 2**30})
        q = quarter.get((r["method"], r["design"]))
        if q is not None:   # issue 17: 25%-unmasked time <= 0.35x all-unmasked
            out[-1].update(unmasked_25_ratio=round(q / r["predicted_ms"], 3),
                           unmasked_25_met=q / r["predicted_ms"] <= 0.35)
    return out


def join_measured(recs, paths):
    """Attach measured medians from bench_*_gpu.json rows (matched by bench method and shape)."""
    idx = {}
    for p in paths:
        data = json.loads(Path(p).read_text())
        for row in data.get("rows", []):
            key = (row["method"], row["N"], row["H"], row["V"], float(row["frac"]))
            idx[key] = (row["median_ms"], data.get("hardware", {}).get("gpu"),
                        data.get("gemm_tflops"))
    for r in recs:
        m = idx.get((r["bench_method"], r["N"], r["H"], r["V"], float(r["unmasked"])))
        if m:
            r["measured_ms"], r["measured_on"], r["measured_gemm_tflops"] = m
            r["measured_vs_predicted"] = round(m[0] / r["predicted_ms"], 3)
    return recs


def fmt_gib(b):
    return f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.0f} MiB"


def print_table(recs, dev_key):
    cols = ["method", "design", "N", "unmasked", "predicted_ms", "floor_ms", "ratio_to_floor",
            "workspace", "bound_by", "measured_ms"]
    print(f"PREDICTED fwd+bwd on {DEVICES[dev_key]['name']} ({DEVICES[dev_key]['tflops']} TFLOP/s "
          f"bf16, {DEVICES[dev_key]['tbps']} TB/s); floor = the method's own GEMM FLOPs")
    for (h, v) in sorted({(r["H"], r["V"]) for r in recs}):
        print(f"\nH={h} V={v}")
        print(" | ".join(cols))
        for r in recs:
            if (r["H"], r["V"]) != (h, v):
                continue
            row = dict(r, workspace=fmt_gib(r["workspace_bytes"]),
                       design=r["design"][:48], bound_by=r["bound_by"][:60])
            print(" | ".join(str(row.get(c, "")) for c in cols))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=sorted(DEVICES), default="h200")
    ap.add_argument("--json", type=Path, default=None,
                    help="default benchmarks/results/roofline_<device>.json")
    ap.add_argument("--shapes", nargs="+", default=None, help="HxV, e.g. 4096x128256")
    ap.add_argument("--n", type=int, nargs="+", default=None)
    ap.add_argument("--fracs", type=float, nargs="+", default=None)
    ap.add_argument("--budget-gib", type=float, default=1.5,
                    help="the workspace target the designs are checked against (issue 17: 1.5)")
    ap.add_argument("--workspace-gib", type=float, default=None,
                    help="budget of the vocabulary-outer plan (default: the code's, "
                         "kernels/_common.WORKSPACE_BYTES_CUDA)")
    ap.add_argument("--fused-workspace-gib", type=float, default=None,
                    help="the fused loss's workspace_bytes (default: the code's, "
                         "kernels/_common.FUSED_WORKSPACE_BYTES_CUDA)")
    ap.add_argument("--measured", nargs="*", default=None,
                    help="bench_logprobs/bench_policy_loss GPU JSON files to print beside the "
                         "prediction (default on a CUDA machine: benchmarks/results/*_gpu.json)")
    ap.add_argument("--fused-ideas", action="store_true",
                    help="print the fused-loss variants weighed at the target shape and exit")
    args = ap.parse_args(argv)
    if args.fused_ideas:
        print(f"PREDICTED fused-loss variants on {DEVICES[args.device]['name']}, N, H, V = "
              f"{TARGET['N']}, {TARGET['H']}, {TARGET['V']} (time / 6NHV floor, workspace):")
        for r in fused_loss_ideas(args.device):
            print(f"  {r['idea']:44s} {r['predicted_ms']:7.1f} ms {r['ratio_to_6nhv']:.3f}x "
                  f"{fmt_gib(r['workspace_bytes']):>9s}  {r['verdict']}")
        return 0
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes] if args.shapes else None
    recs = build(args.device, shapes, args.n, args.fracs, args.workspace_gib,
                 args.fused_workspace_gib)
    measured = args.measured
    if measured is None:
        try:
            import torch
            cuda = torch.cuda.is_available()
        except ImportError:  # pragma: no cover
            cuda = False
        res = Path(__file__).resolve().parent / "results"
        measured = ([str(p) for p in (res / "bench_logprobs_gpu.json",
                                      res / "bench_policy_loss_gpu.json") if p.exists()]
                    if cuda else [])
    if measured:
        join_measured(recs, measured)
    print_table(recs, args.device)
    print("\nissue-17 targets at N=16384, H=4096, V=128256, bf16, all rows (PREDICTED):")
    for t in targets(recs, args.budget_gib):
        print(f"  {t['method']:16s} {t['design'][:70]:70s} time {t['time_vs_target_floor']}x "
              f"{t['target_floor']} -> {'met' if t['time_met'] else 'NOT met'}; workspace "
              f"{t['workspace_gib']} GiB -> {'met' if t['workspace_met'] else 'NOT met'}"
              + (f"; 25% unmasked {t['unmasked_25_ratio']}x -> "
                 f"{'met' if t['unmasked_25_met'] else 'NOT met'}" if "unmasked_25_ratio" in t
                 else ""))
    path = args.json or Path(__file__).resolve().parent / "results" / f"roofline_{args.device}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("[\n" + ",\n".join(json.dumps(r) for r in recs) + "\n]\n")  # a record a line
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
