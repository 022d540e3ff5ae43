"""Forward+backward of the LM-head log-prob: ours vs naive / compiled / peer fused kernels.

    python benchmarks/bench_logprobs.py [--json PATH] [--n 1024 4096] [--fracs 1 0.5 0.25]
                                        [--forward-only]

Every method computes logp[i] = log_softmax(hidden @ weight.T)[i, targets[i]] on the unmasked
rows and backpropagates sum(logp) into hidden and weight. Reported per (shape, N, unmasked
fraction): median fwd+bwd time, peak extra memory, TFLOP/s counted as 6 * N_unmasked * H * V, the
ratio to the device floor (that FLOP count at the measured dense GEMM rate) and to naive.
--forward-only times the forward under torch.no_grad (what an RL trainer runs for the behaviour /
reference log-probs) with 2 * N_unmasked * H * V FLOPs; its JSON defaults to bench_logprobs_fwd_*.
"naive" materializes the full [N, V] logits for every row (masking afterwards), as most
trainers do. GPU-only peers (Liger, cut-cross-entropy, our Triton path) are skipped on CPU with a
note: the Triton interpreter is a correctness tool, not a performance path.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (add_output_args, output_path, plot_by_config, default_json, fmt_bytes, hardware, matmul_tflops,  # noqa: E402
                     peak_extra_bytes, print_table, randn_on, successful, time_fn,
                     time_interleaved, write_json)

from fastrehearse.kernels import linear_logprobs  # noqa: E402

GPU_SHAPES = [(576, 49152), (2048, 151936), (4096, 128256)]
CPU_SHAPES = [(576, 49152)]


# ---- methods: each returns a closure doing one fwd+bwd and returning logp (detached) ---------

BACKWARD = True    # False under --forward-only: the closures skip .backward(), run under no_grad


def _backward(lp):
    if BACKWARD:
        lp.sum().backward()


def m_naive(x, w, t, mask):
    def run():
        z = (x @ w.t()).float()
        lp = torch.log_softmax(z, dim=-1).gather(1, t.clamp_min(0).view(-1, 1)).squeeze(1)
        lp = torch.where(mask, lp, torch.zeros_like(lp))
        _backward(lp)
        return lp.detach()
    return run


def m_compile_chunked(x, w, t, mask, chunk=512):
    from torch.utils.checkpoint import checkpoint

    @torch.compile(dynamic=False)
    def chunk_logp(xc, w, tc):
        return torch.log_softmax((xc @ w.t()).float(), dim=-1).gather(1, tc.view(-1, 1)).squeeze(1)

    def run():
        rows = mask.nonzero().view(-1)
        xs, ts = x.index_select(0, rows), t.index_select(0, rows)
        parts = [checkpoint(chunk_logp, xs[i:i + chunk], w, ts[i:i + chunk], use_reentrant=False)
                 for i in range(0, xs.shape[0], chunk)]
        lp = torch.cat(parts)
        _backward(lp)
        return torch.zeros(x.shape[0], device=x.device).index_put((rows,), lp.detach().float())
    return run


def _ce_peer(ce_fn, x, w, t, mask):
    """A peer returning per-token cross entropy (reduction="none"): logp = -ce; masked -> -100."""
    tt = torch.where(mask, t, torch.full_like(t, -100))

    def run():
        lp = -ce_fn(x, w, tt, ignore_index=-100, reduction="none").float()
        _backward(lp)
        return lp.detach()
    return run


def m_torch_lce(x, w, t, mask, chunked=False):
    import functools

    import torch.nn.functional as F
    opts = torch.nn.LinearCrossEntropyOptions() if chunked else None
    return _ce_peer(functools.partial(F.linear_cross_entropy, options=opts), x, w, t, mask)


def m_liger(x, w, t, mask):
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    return _ce_peer(liger_fused_linear_cross_entropy, x, w, t, mask)


def m_cce(x, w, t, mask):
    from cut_cross_entropy import linear_cross_entropy
    return _ce_peer(linear_cross_entropy, x, w, t, mask)


def m_ours(backend):
    def make(x, w, t, mask):
        def run():
            lp, _ = linear_logprobs(x, w, t, mask=mask, backend=backend)
            _backward(lp)
            return lp.detach()
        return run
    return make


def methods(device):
    """(name, factory or None, note when unavailable)."""
    cuda = device.type == "cuda"
    out = [("naive", m_naive, None)]
    out.append(("torch.compile chunked", m_compile_chunked, None))
    if hasattr(torch.nn.functional, "linear_cross_entropy"):
        out.append(("F.linear_cross_entropy", m_torch_lce, None))
        if hasattr(torch.nn, "LinearCrossEntropyOptions"):
            out.append(("F.linear_cross_entropy chunked",
                        lambda *a: m_torch_lce(*a, chunked=True), None))
    else:
        out.append(("F.linear_cross_entropy", None, f"absent in torch {torch.__version__}"))
    for name, fn, mod in (("liger FLCE", m_liger, "liger_kernel"),
                          ("cut-cross-entropy", m_cce, "cut_cross_entropy")):
        if not cuda:
            out.append((name, None, "GPU-only (Triton kernels); skipped on CPU"))
            continue
        try:
            __import__(mod)
            out.append((name, fn, None))
        except ImportError:
            out.append((name, None, f"{mod} not installed"))
    for backend in ("triton", "triton-fused"):
        if cuda:
            out.append((f"ours ({backend})", m_ours(backend), None))
        else:
            out.append((f"ours ({backend})", None, "CUDA only (CPU runs it in the interpreter)"))
    out.append(("ours (torch)", m_ours("torch"), None))
    return out


def make_inputs(n, h, v, frac, device, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = randn_on((n, h), device, dtype, g).requires_grad_()
    w = randn_on((v, h), device, dtype, g, scale=h ** -0.5).requires_grad_()
    t = torch.randint(0, v, (n,), generator=g).to(device)
    mask = torch.zeros(n, dtype=torch.bool)
    mask[torch.randperm(n, generator=g)[: int(round(frac * n))]] = True
    return x, w, t, mask.to(device)


def bench_one(name, factory, x, w, t, mask, device, warmup, reps):
    """Warm-up (and compile) untimed; then `reps` timed runs, the first also measuring memory."""
    run = factory(x, w, t, mask)

    def step():
        x.grad = w.grad = None
        with torch.set_grad_enabled(BACKWARD):
            return run()

    lp = step()
    for _ in range(max(0, warmup - 1)):
        step()
    box = {}
    x.grad = w.grad = None  # the warm-up's gradients must not sit in the baseline

    def timed_step():
        box["t"] = time_fn(step, device, warmup=0, reps=1)["median_ms"]

    mem = peak_extra_bytes(timed_step, device)
    tm = time_fn(step, device, warmup=0, reps=reps - 1) if reps > 1 else {"times_ms": []}
    times = [box["t"]] + tm["times_ms"]
    x.grad = w.grad = None
    return lp, {"median_ms": statistics.median(times), "min_ms": min(times),
                "times_ms": times}, mem


def _sequential(name, factory, x, w, t, mask, device, warmup, reps):
    try:
        lp, tm, mem = bench_one(name, factory, x, w, t, mask, device, warmup, reps)
    except Exception as e:  # a peer failing must not kill the benchmark
        x.grad = w.grad = None
        return {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    return dict(tm, lp=lp, peak_extra_bytes=mem)


def _interleaved(todo, x, w, t, mask, device, warmup, reps):
    """All methods of one config timed round-robin (see _common.time_interleaved)."""
    first_lp, steps, errors = {}, {}, {}

    def reset():
        x.grad = w.grad = None

    for name, factory in todo:
        try:
            run = factory(x, w, t, mask)
        except Exception as e:
            errors[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            continue

        def step(run=run, name=name):
            reset()
            with torch.set_grad_enabled(BACKWARD):
                lp = run()
            first_lp.setdefault(name, lp)
            return lp
        steps[name] = (step, reset)
    res = time_interleaved(steps, device, warmup=warmup, reps=reps)
    for name, d in res.items():
        if "error" not in d:
            d["lp"] = first_lp[name]
    return {**res, **errors}


# Methods that compute every row whatever the mask (the mask only zeroes results): measured
# once per (shape, N) at the first fraction and reused for the others.
MASK_AGNOSTIC = {"naive", "F.linear_cross_entropy", "F.linear_cross_entropy chunked"}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_output_args(p)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--n", type=int, nargs="+", default=None)
    p.add_argument("--fracs", type=float, nargs="+", default=[1.0, 0.5, 0.25])
    p.add_argument("--shapes", type=str, nargs="+", default=None, help="HxV, e.g. 576x49152")
    p.add_argument("--methods", type=str, nargs="+", default=None, help="subset of names")
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--full-only", type=str, nargs="+", default=[],
                   help="methods measured only at unmasked fraction 1.0 (e.g. the compiled one, "
                        "whose compile per shape costs more than a timed run)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="input dtype (default: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--forward-only", action="store_true",
                   help="time the forward under torch.no_grad (behaviour / reference log-probs)")
    p.add_argument("--interleave", action=argparse.BooleanOptionalAction, default=None,
                   help="time the methods of a config round-robin (default on CPU: a shared "
                        "box's load then hits every method alike); --no-interleave: one "
                        "method's reps after another")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default 1 on CPU: this box is shared, and one thread "
                        "keeps medians stable; every method gets the same)")
    args = p.parse_args(argv)
    global BACKWARD
    BACKWARD = not args.forward_only
    device = torch.device(args.device)
    if args.interleave is None:
        args.interleave = device.type == "cpu"
    if device.type == "cpu":
        torch.set_num_threads(args.threads or 1)
    cuda = device.type == "cuda"
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if cuda else torch.float32)
    ns = args.n or ([4096, 16384] if cuda else [1024, 4096])
    shapes = ([tuple(int(s) for s in sh.split("x")) for sh in args.shapes] if args.shapes
              else (GPU_SHAPES if cuda else CPU_SHAPES))
    reps = args.reps or (10 if cuda else 3)
    path = output_path(args.json, default_json("bench_logprobs_fwd" if args.forward_only
                                               else "bench_logprobs", device).name, args.record)

    hw = hardware(device)
    rate = matmul_tflops(device, dtype)
    print(f"{hw}\nmeasured dense {dtype} GEMM rate: {rate:.3f} TFLOP/s")
    rows, skipped, agnostic = [], {}, {}
    for h, v in shapes:
        for n in ns:
            for frac in args.fracs:
                x, w, t, mask = make_inputs(n, h, v, frac, device, dtype)
                n_sel = int(mask.sum())
                flops = (2 if args.forward_only else 6) * n_sel * h * v
                base_lp = None
                todo = []
                for name, factory, note in methods(device):
                    if args.methods and name not in args.methods:
                        continue
                    if factory is None:
                        skipped[name] = note
                        continue
                    if name in args.full_only and frac != 1.0:
                        skipped[name] = "measured at unmasked fraction 1.0 only (--full-only)"
                        continue
                    if name in MASK_AGNOSTIC and (h, v, n, name) in agnostic:
                        row = dict(agnostic[(h, v, n, name)], frac=frac, n_unmasked=n_sel,
                                   note="reused: computes all rows whatever the mask")
                        ms = row["median_ms"]
                        row.update(tflops=round(flops / (ms * 1e-3) / 1e12, 4),
                                   floor_ratio=round(ms / (flops / (rate * 1e12) * 1e3), 2)
                                   if flops else None, max_abs_diff_vs_first=None)
                        rows.append(row)
                        continue
                    todo.append((name, factory))
                if args.interleave:
                    results = _interleaved(todo, x, w, t, mask, device, args.warmup, reps)
                else:
                    results = {name: _sequential(name, f, x, w, t, mask, device, args.warmup,
                                                 reps) for name, f in todo}
                for name, res in successful(results, [n for n, _ in todo], skipped):
                    lp, mem = res["lp"], res["peak_extra_bytes"]
                    if base_lp is None:
                        base_lp = lp
                    err = float((lp - base_lp)[mask].abs().max()) if n_sel else 0.0
                    ms = res["median_ms"]
                    row = dict(H=h, V=v, N=n, frac=frac, n_unmasked=n_sel, method=name,
                               median_ms=round(ms, 2), min_ms=round(res["min_ms"], 2),
                               times_ms=[round(s, 2) for s in res["times_ms"]],
                               peak_extra_bytes=mem,
                               # minus the dX and dW every method must return: the workspace the
                               # "extra memory <= 256 MiB" (GPU) target is about
                               workspace_bytes=None if mem is None else
                               max(0, mem - (0 if args.forward_only else
                                             (n * h + v * h) * torch.finfo(dtype).bits // 8)),
                               tflops=round(flops / (ms * 1e-3) / 1e12, 4),
                               floor_ratio=round(ms / (flops / (rate * 1e12) * 1e3), 2)
                               if flops else None,
                               max_abs_diff_vs_first=err)
                    rows.append(row)
                    if name in MASK_AGNOSTIC:
                        agnostic[(h, v, n, name)] = row
                    print(f"  H={h} V={v} N={n} frac={frac} {name}: {ms:.1f} ms, "
                          f"{fmt_bytes(mem)}", flush=True)
                results = base_lp = None
                del x, w, t, mask
                # after every configuration: a timeout later must not lose these numbers
                save(path, rows, skipped, hw, dtype, rate, args, final=False)
    save(path, rows, skipped, hw, dtype, rate, args, final=True)


def save(path, rows, skipped, hw, dtype, rate, args, *, final):
    """Ratios to naive, the JSON (every call) and, at the end, the table and the PNG."""
    for r in rows:
        base = next((b for b in rows if b["method"] == "naive" and
                     (b["H"], b["V"], b["N"], b["frac"]) == (r["H"], r["V"], r["N"], r["frac"])),
                    None)
        if base:
            r["time_vs_naive"] = round(r["median_ms"] / base["median_ms"], 3)
            if r["peak_extra_bytes"] is not None and base["peak_extra_bytes"]:
                r["mem_vs_naive"] = round(r["peak_extra_bytes"] / base["peak_extra_bytes"], 3)
    cuda = str(hw.get("device", "")).startswith("cuda")
    fwd = args.forward_only
    payload = {"benchmark": "bench_logprobs", "hardware": hw, "dtype": str(dtype),
               "pass": "forward only (torch.no_grad)" if fwd else "forward + backward",
               "gemm_tflops": rate,
               "flops_counted": f"{2 if fwd else 6} * n_unmasked * H * V",
               "memory": ("CUDA max_memory_allocated" if cuda else
                          "peak RSS (VmHWM) above the RSS before the call")
               + " (peak_extra_bytes); workspace_bytes = that minus the dX and dW gradients",
               "load_avg_end": os.getloadavg(), "timing": "interleaved round-robin per config"
               if args.interleave else "sequential per method", "argv": sys.argv[1:],
               "complete": final, "rows": rows, "skipped": skipped}
    write_json(path, payload)
    if not final:
        return
    table = [dict(r, shape=f"{r['H']}x{r['V']}", mem=fmt_bytes(r["peak_extra_bytes"]),
                  workspace=fmt_bytes(r["workspace_bytes"])) for r in rows]
    print_table(f"{'fwd' if fwd else 'fwd+bwd'} log-prob, {dtype}, {hw.get('gpu') or hw['cpu']}",
                table,
                ["shape", "N", "frac", "method", "median_ms", "mem", "workspace", "tflops",
                 "floor_ratio", "time_vs_naive", "mem_vs_naive"])
    for name, note in skipped.items():
        print(f"skipped {name}: {note}")
    plot_by_config(path.with_suffix(".png"), rows,
                   title=f"linear log-prob {'fwd' if fwd else 'fwd+bwd'} "
                         f"({hw.get('gpu') or hw['cpu']})",
                   ylabel=f"{'fwd (no_grad)' if fwd else 'fwd+bwd'} median ms")


if __name__ == "__main__":
    main()
