"""Per-piece GPU micro-benchmark of the kernels' CUDA path, each piece beside its roofline.

    python benchmarks/gpu_microbench.py [--n 16384 --h 4096 --v 128256] [--json PATH]
    python benchmarks/gpu_microbench.py --smoke          # CPU: code path only (Triton interpreter)

What one chunk of `linear_logprobs` / `linear_policy_loss` runs, timed piece by piece (CUDA
events through triton.testing.do_bench): the fp32-output logits GEMM, `_row_stats_kernel` and
`_row_grad_kernel` at num_warps 4/8/16/32 (injected into the launch the code makes, so the
block sizes are the code's), the dX GEMM and the dW addmm into the fp32 V x H accumulator (the row-chunked path of the fused
loss); one block of linear_logprobs' vocabulary-outer backward (Z_b GEMM, row kernel, fp32 dX
accumulator addmm, dW_b GEMM) at the code's own block plan; then the whole fwd+bwd of
`linear_logprobs` at workspace budgets of 512 MiB / default (1 GiB) / 1.5 GiB and of the fused
`linear_policy_loss` at chunk budgets of 256 MiB (the default) and 1 GiB; last, the forward of
`linear_logprobs` as "triton" and as "triton-fused" (the tl.dot + LSE tile kernel) over all rows,
the latter at six tile configs.
Every row prints the measured time, the roofline floor at the *measured* matmul rate and copy
bandwidth (taken first), and benchmarks/roofline.py's prediction for the same piece at the
stated H200 numbers (central estimate, with its optimistic - pessimistic range). Also reports whether the fp32-output (`out_dtype`) GEMMs were used.
The JSON is rewritten after every row, so a timeout keeps what was measured.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

if "--smoke" in sys.argv:                     # before triton is imported anywhere
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import roofline  # noqa: E402
from _common import add_output_args, hardware, output_path  # noqa: E402

from fastrehearse.kernels import PolicyLossConfig, linear_logprobs, linear_policy_loss  # noqa: E402
from fastrehearse.kernels import _common as kc  # noqa: E402
from fastrehearse.kernels import _rows  # noqa: E402
from fastrehearse.kernels._vocab_outer import vocab_outer_plan  # noqa: E402
from fastrehearse.kernels.linear_logprobs import forward_rows  # noqa: E402


def bench_ms(fn, dev, reps=20) -> float:
    if dev.type == "cuda":
        from triton.testing import do_bench
        return float(do_bench(fn, warmup=5, rep=reps))       # rep: target ms of timed runs
    fn()                                                     # smoke: one untimed call, then one
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


@contextlib.contextmanager
def num_warps(kernel, nw: int):
    """Launch `kernel` with num_warps=nw whatever the launch code passes (sweep)."""
    orig = type(kernel).run

    def run(*args, **kwargs):
        kwargs["num_warps"] = nw
        return orig(kernel, *args, **kwargs)
    kernel.run = run
    try:
        yield
    finally:
        del kernel.run


def measured_rates(dev) -> tuple[float, float]:
    """(dense matmul TFLOP/s of an 8192^3 bf16 GEMM, copy TB/s counting read + write)."""
    if dev.type != "cuda":
        return roofline.DEVICES["h200"]["tflops"], roofline.DEVICES["h200"]["tbps"]
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    ms = bench_ms(lambda: a @ a, dev)
    src = torch.empty(1 << 30, device=dev, dtype=torch.uint8)
    dst = torch.empty_like(src)
    ms_c = bench_ms(lambda: dst.copy_(src), dev)
    return 2 * 8192 ** 3 / ms / 1e9, 2 * src.numel() / ms_c / 1e9


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--h", type=int, default=4096)
    ap.add_argument("--v", type=int, default=128256)
    ap.add_argument("--smoke", action="store_true", help="tiny shape on the CPU, code path only")
    add_output_args(ap, "output JSON, gpu_microbench_<gpu|cpu_smoke>.json")
    a = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not a.smoke
    if not cuda and not a.smoke:
        raise SystemExit("no CUDA device: use --smoke for a CPU code-path check")
    dev = torch.device("cuda" if cuda else "cpu")
    if a.smoke:
        a.n, a.h, a.v = 192, 32, 1000
    dt = torch.bfloat16 if cuda else torch.float32
    path = output_path(a.json, "gpu_microbench_gpu.json" if cuda else "gpu_microbench_cpu_smoke.json",
                       a.record)
    tflops, tbps = measured_rates(dev)
    dev_model = dict(roofline.DEVICES["h200"])
    out = {"benchmark": "gpu_microbench", "hardware": hardware(dev), "shape": [a.n, a.h, a.v],
           "dtype": str(dt), "measured_matmul_tflops": tflops, "measured_copy_tbps": tbps,
           "prediction_device": dev_model["name"], "smoke": a.smoke, "rows": []}
    print(f"{out['hardware']}\nmeasured: {tflops:.0f} TFLOP/s bf16 matmul, {tbps:.2f} TB/s copy"
          + (" (smoke: stated H200 numbers, nothing measured)" if not cuda else ""))

    def row(name, ms, piece: roofline.Piece):
        floor = max(piece.flops / (tflops * 1e12), piece.bytes / (tbps * 1e12)) * 1e3
        pred = piece.ms(dev_model)      # roofline.py's central estimate, and its range
        rng = [round(piece.ms(dev_model, a), 4) for a in (roofline.OPTIMISTIC, roofline.PESSIMISTIC)]
        r = {"name": name, "ms": round(ms, 4), "floor_ms_measured_rates": round(floor, 4),
             "predicted_ms_h200": round(pred, 4), "predicted_ms_h200_range": rng,
             "vs_floor": round(ms / floor, 2) if floor else None,
             "tflops": round(piece.flops / ms / 1e9, 1) if piece.flops else None,
             "tbps": round(piece.bytes / ms / 1e9, 3) if piece.bytes else None}
        out["rows"].append(r)
        print(f"{name:52s} {ms:9.3f} ms  floor {floor:8.3f}  predicted {pred:8.3f}  "
              f"x{r['vs_floor']}", flush=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=1) + "\n")     # after every row

    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(a.n, a.h, device=dev, generator=g).to(dt)
    w = (torch.randn(a.v, a.h, device=dev, generator=g) * a.h ** -0.5).to(dt)
    t = torch.randint(0, a.v, (a.n,), device=dev, generator=g)
    c = forward_rows(a.n, a.v, dt, dev, "triton")
    xc, tc = x[:c], t[:c]
    z = kc.mm_f32(xc, w.t())
    row(f"[C={c}] Z = X_c W^T (fp32 out)", bench_ms(lambda: kc.mm_f32(xc, w.t()), dev),
        roofline.gemm("", c, a.v, a.h, out_bytes=4))
    lse = _rows.row_stats_triton(z, tc, 1.0, False)[2]      # a real lse for the grad pass
    g1 = torch.randn(c, device=dev)
    dz = torch.empty(z.shape, device=dev, dtype=dt)
    for nw in ((4, 8, 16, 32) if cuda else (4,)):
        with num_warps(_rows._row_stats_kernel, nw):
            row(f"[C={c}] _row_stats_kernel (entropy) warps={nw}",
                bench_ms(lambda: _rows.row_stats_triton(z, tc, 1.0, True), dev),
                roofline.passes("", c * a.v * 4))
        with num_warps(_rows._row_grad_kernel, nw):
            row(f"[C={c}] _row_grad_kernel (g1) warps={nw}",
                bench_ms(lambda: _rows.row_grad_triton(z, tc, lse, None, g1, None, 1.0, out=dz, dt=g1),
                         dev),
                roofline.passes("", c * a.v * (4 + dz.element_size())))
    dx = torch.empty_like(xc)
    row(f"[C={c}] dX_c = dZ W", bench_ms(lambda: torch.mm(dz, w, out=dx), dev),
        roofline.gemm("", c, a.h, a.v, a_bytes=dz.element_size()))
    acc = torch.zeros(w.shape, device=dev, dtype=torch.float32)
    row(f"[C={c}] dW += dZ^T X_c (fp32 V x H accumulator)",
        bench_ms(lambda: kc.addmm_f32_(acc, dz.t(), xc), dev),
        roofline.gemm("", a.v, a.h, c, out_bytes=4, accumulate=True))
    out["out_dtype_float32_gemms"] = {k: bool(v) for k, v in
                                      getattr(kc, "_OUT_DTYPE_OK", {}).items()}
    print("fp32-output GEMMs (out_dtype=float32) used:", out["out_dtype_float32_gemms"]
          or "not tried (fp32 inputs)")
    del z, dz, acc, dx

    # one block of the vocabulary-outer backward (linear_logprobs on CUDA), the code's own plan
    rows, cols = vocab_outer_plan(a.n, a.h, a.v, torch.device("cuda"),
                                  block_elem_bytes=4 + x.element_size())
    r, vb = min(rows, a.n), min(cols, a.v)
    xr, tr, wb = x[:r], t[:r], w[:vb]
    zb = kc.mm_f32(xr, wb.t())
    row(f"[R={r}, V_b={vb}] Z_b = X W_b^T (fp32 out)", bench_ms(lambda: kc.mm_f32(xr, wb.t()), dev),
        roofline.gemm("", r, vb, a.h, out_bytes=4))
    lse_b = _rows.row_stats_triton(zb, tr.clamp_max(vb - 1), 1.0, False)[2]
    g1b = torch.randn(r, device=dev)
    dzb = torch.empty(zb.shape, device=dev, dtype=dt)
    for nw in ((4, 8, 16) if cuda else (4,)):
        with num_warps(_rows._row_grad_kernel, nw):
            row(f"[R={r}, V_b={vb}] _row_grad_kernel (g1) warps={nw}",
                bench_ms(lambda: _rows.row_grad_triton(zb, tr, lse_b, None, g1b, None, 1.0,
                                                       out=dzb, dt=g1b), dev),
                roofline.passes("", r * vb * (4 + dzb.element_size())))
    dxa = torch.zeros(r, a.h, device=dev, dtype=torch.float32)
    row(f"[R={r}, V_b={vb}] dX_acc += dZ_b W_b (fp32 [R, H])",
        bench_ms(lambda: kc.addmm_f32_(dxa, dzb, wb), dev),
        roofline.gemm("", r, a.h, vb, out_bytes=4, accumulate=True, a_bytes=dzb.element_size()))
    dwb = torch.empty(vb, a.h, device=dev, dtype=dt)
    row(f"[R={r}, V_b={vb}] dW_b = dZ_b^T X (fp32 result -> {str(dt)[6:]})",
        bench_ms(lambda: dwb.copy_(kc.mm_f32(dzb.t(), xr)), dev),
        roofline.Piece("", 2.0 * vb * a.h * r, vb * r * dzb.element_size() + r * a.h *
                       x.element_size() + vb * a.h * (4 + 4 + dwb.element_size())))
    del zb, dzb, dxa, dwb

    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    roles = torch.randint(1, 3, (a.n,), device=dev)
    adv, old = torch.randn(a.n, device=dev), torch.full((a.n,), -11.0, device=dev)
    backend = "triton"

    def record_step(name, fn, design):
        floor_flops = design.floor_nhv * a.n * a.h * a.v
        ms = bench_ms(fn, dev, reps=200)
        row(name, ms, roofline.Piece("", floor_flops, 0.0))
        t = roofline.times(design.pieces, dev_model)
        out["rows"][-1]["predicted_ms_h200"] = round(t["central"], 3)
        out["rows"][-1]["predicted_ms_h200_range"] = [round(t["optimistic"], 3),
                                                      round(t["pessimistic"], 3)]
        out["rows"][-1]["note"] = f"floor = {design.floor_nhv}NHV at the measured rate"

    # linear_logprobs: the vocabulary-outer backward at workspace budgets (default: the code's)
    for ws in ((512 << 20, None, 3 << 29) if cuda else (None,)):
        def lp_step(ws=ws):
            xg.grad = wg.grad = None
            lp, _ = linear_logprobs(xg, wg, t, backend=backend, workspace_bytes=ws)
            lp.sum().backward()
        label = "default" if ws is None else f"{ws >> 20} MiB"
        record_step(f"linear_logprobs fwd+bwd, workspace {label}", lp_step,
                    roofline.ours_logprobs(a.n, a.h, a.v, "vocab-outer", ws))
    # the fused loss: rows per chunk from its workspace budget (default: the code's, 3 GiB on CUDA)
    for ws in ((2 << 30, None, 4 << 30) if cuda else (None,)):
        rows_c = roofline._fused_rows(a.n, a.h, a.v, ws) if cuda else "cpu"

        def pl_step(ws=ws):
            xg.grad = wg.grad = None
            linear_policy_loss(xg, wg, t, roles, adv, old, PolicyLossConfig(), backend=backend,
                               check_finite=False, workspace_bytes=ws).loss.backward()
        label = "default" if ws is None else f"{ws >> 20} MiB"
        record_step(f"linear_policy_loss fused fwd+bwd, workspace {label} ({rows_c} rows)", pl_step,
                    roofline.ours_fused_loss(a.n, a.h, a.v, "budgeted", None, fused_budget=ws))
    fused_forward(a, x, w, t, dev, cuda, row)
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


# Tile configs swept for backend="triton-fused" on CUDA: (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages);
# the first is the code's default (kernels/_fused_lse.py).
FUSED_TILES = [(128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 128, 64, 4, 4),
               (64, 128, 64, 4, 4), (128, 64, 64, 4, 4), (256, 128, 64, 8, 3)]


def fused_forward(a, x, w, t, dev, cuda, row):
    """The forward of linear_logprobs both ways over all N rows, with the entropy: "triton" (fp32
    logits chunks + _row_stats_kernel) and "triton-fused" (tl.dot + LSE tiles, torch merge), then
    the fused kernel's tile sweep. The question for the fused backend: does its tl.dot reach the
    cuBLAS rate (floor = 2NHV at the measured rate)?"""
    from fastrehearse.kernels import _fused_lse
    from fastrehearse.kernels.linear_logprobs import _row_chunked_stats
    c = forward_rows(a.n, a.v, x.dtype, dev, "triton")
    cf = forward_rows(a.n, a.v, x.dtype, dev, "triton-fused")
    flops = roofline.Piece("", 2.0 * a.n * a.h * a.v, 0.0)
    row(f"[N={a.n}] forward 'triton' ({c}-row chunks, entropy)",
        bench_ms(lambda: _row_chunked_stats(x, w, t, 1.0, True, "triton", c), dev), flops)
    tiles = FUSED_TILES if cuda else [_fused_lse.tile_config(x.dtype, dev)]
    default = dict(_fused_lse._CUDA_TILES)
    for tile in tiles:
        try:
            if cuda:
                _fused_lse._CUDA_TILES[x.dtype] = tile
            ms = bench_ms(lambda: _row_chunked_stats(x, w, t, 1.0, True, "triton-fused", cf), dev)
            row(f"[N={a.n}] forward 'triton-fused' tile {tile} ({cf} rows per launch)", ms, flops)
        except Exception as e:        # e.g. out of shared memory for a large tile: say so, go on
            print(f"tile {tile}: {type(e).__name__}: {str(e)[:200]}", flush=True)
        finally:
            _fused_lse._CUDA_TILES.clear()
            _fused_lse._CUDA_TILES.update(default)


if __name__ == "__main__":
    sys.exit(main())
