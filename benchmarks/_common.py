"""Small shared helpers for the benchmarks: hardware description, timing, peak memory, output.

    hw = hardware()                              # dict naming CPU / GPU, torch/triton versions
    t = time_fn(fn, device, warmup=1, reps=5)    # {"median_ms", "min_ms", "times_ms"}
    mem = peak_extra_bytes(fn, device)           # bytes above what was live before fn()
    print_table(title, rows, columns); write_json(path, payload); bar_plot(path, ...)

Timing: CUDA events on GPU, perf_counter on CPU; quote medians (shared machines are noisy).
Peak memory: CUDA -> torch.cuda.max_memory_allocated after reset_peak_memory_stats;
CPU -> the process's peak RSS (VmHWM, reset through /proc/self/clear_refs) minus the RSS before
the call, after gc + malloc_trim. It counts everything the call touches (outputs included).
"""
from __future__ import annotations

import ctypes
import gc
import json
import os
import platform
import re
import statistics
import time
from pathlib import Path

import torch

from _output import RESULTS, SCRATCH, add_output_args, output_path  # noqa: F401 (re-exported)


def hardware(device: torch.device | str = "cpu") -> dict:
    device = torch.device(device)
    info = {"python": platform.python_version(), "torch": torch.__version__,
            "cpu": cpu_model(), "cpu_cores": os.cpu_count(), "torch_threads":
            torch.get_num_threads(), "device": str(device)}
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:  # pragma: no cover
        info["triton"] = None
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info.update(gpu=p.name, gpu_mem_gib=round(p.total_memory / 2**30, 1),
                    cuda=torch.version.cuda)
    try:
        info["load_avg_1m"] = os.getloadavg()[0]  # a shared box: record how busy it was
    except OSError:  # pragma: no cover
        pass
    return info


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:  # pragma: no cover
        pass
    return platform.processor() or platform.machine()


def default_json(name: str, device: torch.device | str, record: bool = False) -> Path:
    kind = "gpu" if torch.device(device).type == "cuda" else "cpu"
    return output_path(None, f"{name}_{kind}.json", record)


def randn_on(shape, device, dtype, generator: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    """Random normal tensor in `dtype` on `device`. CUDA: drawn there (a CPU draw of a
    128256 x 4096 weight takes seconds per benchmark config); CPU: drawn on the CPU from `generator`.
    """
    device = torch.device(device)
    if device.type == "cuda":
        seed = int(torch.randint(0, 2**62, (1,), generator=generator))
        g = torch.Generator(device=device).manual_seed(seed)
        return (torch.randn(shape, device=device, generator=g) * scale).to(dtype)
    return (torch.randn(shape, generator=generator) * scale).to(device, dtype)


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def time_fn(fn, device, *, warmup: int = 1, reps: int = 5) -> dict:
    """Median wall time of fn() in ms (CUDA events on GPU)."""
    device = torch.device(device)
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return {"median_ms": statistics.median(times), "min_ms": min(times), "times_ms": times}


def _malloc_trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # pragma: no cover
        pass


def _status_kib(field: str) -> int:
    m = re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text())
    return int(m.group(1)) if m else 0


def peak_extra_bytes(fn, device) -> int | None:
    """Peak memory fn() needs on top of what is live before it (None if not measurable)."""
    device = torch.device(device)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    _malloc_trim()
    try:
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    except OSError:
        return None
    base = _status_kib("VmRSS")
    fn()
    return (_status_kib("VmHWM") - base) * 1024


def time_interleaved(steps: dict, device, *, warmup: int = 1, reps: int = 3) -> dict:
    """Round-robin timing of several fwd+bwd closures on a shared, noisy machine.

    steps: name -> (step, reset) where step() runs once and reset() drops its gradients.
    Each is warmed up (compiled) first; then the first timed round also measures each one's
    peak extra memory, and `reps` rounds run the methods one after another, so load changes
    from other processes hit every method alike (side-by-side ratios, not drift between
    methods measured minutes apart). Returns name -> {"times_ms", "median_ms", "min_ms",
    "peak_extra_bytes"} or {"error": str} for a method that raised.
    """
    out = {}
    live = {}
    for name, (step, reset) in steps.items():
        try:
            for _ in range(max(1, warmup)):
                step()
            reset()
            live[name] = (step, reset)
            out[name] = {"times_ms": []}
        except Exception as e:  # a peer failing must not kill the benchmark
            out[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            reset()
    for r in range(reps):
        for name, (step, reset) in list(live.items()):
            box = {}

            def timed():
                box["t"] = time_fn(step, device, warmup=0, reps=1)["median_ms"]
            try:
                if r == 0:
                    out[name]["peak_extra_bytes"] = peak_extra_bytes(timed, device)
                else:
                    timed()
            except Exception as e:
                out[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                live.pop(name)
                reset()
                continue
            out[name]["times_ms"].append(box["t"])
            reset()
    for name, d in out.items():
        if d.get("times_ms"):
            d["median_ms"] = statistics.median(d["times_ms"])
            d["min_ms"] = min(d["times_ms"])
    return out


def matmul_tflops(device, dtype=torch.float32, n: int | None = None, reps: int = 3) -> float:
    """Measured dense GEMM rate (TFLOP/s) of an n x n x n matmul: the device floor's yardstick."""
    device = torch.device(device)
    n = n or (8192 if device.type == "cuda" else 2048)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    t = time_fn(lambda: a @ b, device, warmup=1, reps=reps)
    return 2 * n ** 3 / (t["median_ms"] * 1e-3) / 1e12


def successful(results: dict, names, skipped: dict):
    """(name, result) for each method that ran; a failed one is printed and noted in `skipped`."""
    for name in names:
        res = results[name]
        if "error" in res:
            skipped[name] = f"failed: {res['error']}"
            print(f"  {name}: {skipped[name]}")
            continue
        yield name, res


def fmt_bytes(n) -> str:
    if n is None:
        return "n/a"
    return f"{n / 2**20:.0f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


def print_table(title: str, rows: list[dict], columns: list[str]) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # pragma: no cover
        print(title)
        print(" | ".join(columns))
        for r in rows:
            print(" | ".join(str(r.get(c, "")) for c in columns))
        return
    table = Table(title=title)
    for c in columns:
        table.add_column(c, justify="right" if c not in ("method", "note") else "left")
    for r in rows:
        table.add_row(*[str(r.get(c, "")) for c in columns])
    Console(width=200).print(table)


def write_json(path, payload: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    print(f"wrote {path}")
    return path


def bar_plot(path, groups: list[str], series: dict[str, list[float | None]], *, ylabel: str,
             title: str) -> Path | None:
    """Grouped bar chart: one group per shape/config, one bar per method."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover
        return None
    path = Path(path)
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(groups) + 2), 4))
    k = max(1, len(series))
    width = 0.8 / k
    for i, (name, vals) in enumerate(series.items()):
        xs = [g + (i - (k - 1) / 2) * width for g in range(len(groups))]
        ax.bar(xs, [v if v is not None else 0 for v in vals], width, label=name)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")
    return path


def plot_by_config(path, rows, *, title, ylabel="fwd+bwd median ms"):
    """Grouped bars: one group per (H, V, N, unmasked fraction) config, one bar per method."""
    groups = sorted({(r["H"], r["V"], r["N"], r["frac"]) for r in rows})
    names = list(dict.fromkeys(r["method"] for r in rows))
    lookup = {(r["H"], r["V"], r["N"], r["frac"], r["method"]): r for r in rows}
    bar_plot(path, [f"{h}x{v}\nN={n} f={f}" for h, v, n, f in groups],
             {m: [lookup.get((*g, m), {}).get("median_ms") for g in groups] for m in names},
             ylabel=ylabel, title=title)
