"""Packing benchmark: how full are the micro-batches, and what does that buy in a fwd+bwd pass.

    python benchmarks/bench_packing.py [--json PATH] [--png PATH] [--quick]

1. Packing efficiency (real tokens / (micro-batches x max_tokens)) on a synthetic long-tail
   multi-turn length distribution (log-normal, clipped to 200..8000 tokens), over several seeds
   and budgets, for
     ours    fastrehearse.packing.pack (balanced LPT / first-fit-decreasing, varlen rows)
     greedy  naive next-fit packing in arrival order (a new row whenever the next episode does
             not fit)
     padded  HF-style padded batches in arrival order: rectangles [b, L_max] with b * L_max <=
             max_tokens (padding fraction also reported)
2. Forward+backward tokens/s (real tokens only) on the same episodes, packed (our varlen
   attention, one row per micro-batch) vs padded (transformers SDPA with a padding mask), both
   followed by the same LM-head log-prob (fastrehearse.kernels.linear_logprobs on real tokens).
   The model is a small *random* Llama (hidden 192, 4 layers, GQA 6/2 heads, vocab 4096) so
   that the run takes a couple of minutes on 2 CPU cores; on CUDA pass --device cuda.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _output import add_output_args, output_path  # noqa: E402
sys.path.insert(0, str(ROOT))

from fastrehearse.data import Episode  # noqa: E402
from fastrehearse.kernels import linear_logprobs  # noqa: E402
from fastrehearse.model import RehearsalModel, build_tiny_model, lm_head_weight  # noqa: E402
from fastrehearse.packing import pack, packing_efficiency  # noqa: E402


# ---------------------------------------------------------------- small local helpers
def hardware() -> dict:
    cpu = "unknown"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import transformers
    info = {"cpu": cpu, "cores": os.cpu_count(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(),
            # other processes share the machine: the 1-minute load average, for reading timings
            "loadavg_1m": os.getloadavg()[0]}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def lognormal_lengths(rng: random.Random, k: int, lo=200, hi=8000, median=1200.0, sigma=0.9):
    return [int(min(hi, max(lo, rng.lognormvariate(math.log(median), sigma)))) for _ in range(k)]


def greedy_rows(lengths, max_tokens):
    """Next-fit in arrival order."""
    rows, cur = [], 0
    for n in lengths:
        if cur and cur + n > max_tokens:
            rows.append(cur)
            cur = 0
        cur += n
    rows.append(cur)
    return rows


def padded_batches(lengths, max_tokens):
    """Arrival-order groups [i, j) with (j - i) * max(lengths[i:j]) <= max_tokens."""
    out, start = [], 0
    while start < len(lengths):
        end, lmax = start + 1, lengths[start]
        while end < len(lengths) and (end - start + 1) * max(lmax, lengths[end]) <= max_tokens:
            lmax = max(lmax, lengths[end])
            end += 1
        out.append((start, end, lmax))
        start = end
    return out


def episodes_from(lengths, vocab, seed):
    g = random.Random(seed)
    # roles: a CONTEXT prompt then alternating ACT / REHEARSE spans, as in a rehearsal rollout
    eps = []
    for i, n in enumerate(lengths):
        roles = [0 if t < n // 4 else (1 if (t // 64) % 2 else 2) for t in range(n)]
        eps.append(Episode([g.randrange(vocab) for _ in range(n)], roles, f"ep{i}"))
    return eps


# ---------------------------------------------------------------- 1. efficiency
def efficiency_table(seeds, budgets, n_episodes):
    rows = []
    for max_tokens in budgets:
        for seed in seeds:
            lengths = lognormal_lengths(random.Random(seed), n_episodes)
            eps = episodes_from(lengths, 100, seed)
            t0 = time.perf_counter()
            ours = pack(eps, max_tokens)
            pack_s = time.perf_counter() - t0
            greedy = greedy_rows(lengths, max_tokens)
            padded = padded_batches(lengths, max_tokens)
            total = sum(lengths)
            rows.append({
                "max_tokens": max_tokens, "seed": seed, "episodes": n_episodes, "tokens": total,
                "ours_batches": len(ours), "ours_eff": packing_efficiency(ours, max_tokens),
                "lower_bound_batches": -(-total // max_tokens),
                "greedy_batches": len(greedy), "greedy_eff": total / (len(greedy) * max_tokens),
                "padded_batches": len(padded), "padded_eff": total / (len(padded) * max_tokens),
                "padded_nonpad_frac": total / sum((e - s) * lmax for s, e, lmax in padded),
                "pack_seconds": pack_s,
            })
    return rows


# ---------------------------------------------------------------- 2. throughput
def loss_packed(model: RehearsalModel, batch):
    def head(h, w):
        mask = batch.roles != 0
        logp, _ = linear_logprobs(h, w, batch.targets.to(h.device), mask=mask.to(h.device), backend="torch")
        return -logp.sum()
    return model(batch, head)


def loss_padded(hf, eps, span, device):
    s, e, lmax = span
    b = e - s
    ids = torch.zeros(b, lmax, dtype=torch.long)
    att = torch.zeros(b, lmax, dtype=torch.long)
    tgt = torch.zeros(b, lmax, dtype=torch.long)
    msk = torch.zeros(b, lmax, dtype=torch.bool)
    for r, ep in enumerate(eps[s:e]):
        n = len(ep)
        ids[r, :n] = torch.tensor(ep.input_ids)
        att[r, :n] = 1
        tgt[r, :n - 1] = ids[r, 1:n]
        msk[r, :n - 1] = torch.tensor(ep.roles[1:]) != 0
    ids, att, tgt, msk = (x.to(device) for x in (ids, att, tgt, msk))
    h = hf.model(input_ids=ids, attention_mask=att, use_cache=False).last_hidden_state
    real = att.bool().view(-1)
    logp, _ = linear_logprobs(h.reshape(-1, h.shape[-1])[real], lm_head_weight(hf), tgt.view(-1)[real],
                              mask=msk.view(-1)[real], backend="torch")
    return -logp.sum()


def time_pass(fn, items, device, repeats):
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        for it in items:
            fn(it).backward()
        sync(device)
        times.append(time.perf_counter() - t0)
    return times


def throughput(n_episodes, max_tokens, seed, repeats, device, dtype):
    lengths = lognormal_lengths(random.Random(seed), n_episodes)
    vocab = 4096
    eps = episodes_from(lengths, vocab, seed)
    hf = build_tiny_model("llama", vocab_size=vocab, hidden_size=192, num_layers=4, num_heads=6,
                          num_kv_heads=2, intermediate_size=512, dtype=dtype).to(device).train()
    packed_model = RehearsalModel(hf)
    batches = [b.to(device) for b in pack(eps, max_tokens)]
    hf_sdpa = build_tiny_model("llama", vocab_size=vocab, hidden_size=192, num_layers=4, num_heads=6,
                               num_kv_heads=2, intermediate_size=512, dtype=dtype).to(device).train()
    hf_sdpa.set_attn_implementation("sdpa")
    spans = padded_batches(lengths, max_tokens)
    total = sum(lengths)
    # warm-up on one small batch each (allocator, thread pools)
    loss_packed(packed_model, min(batches, key=lambda b: b.num_tokens)).backward()
    loss_padded(hf_sdpa, eps, min(spans, key=lambda s: (s[1] - s[0]) * s[2]), device).backward()
    # Interleave the two so that load from other processes on a shared machine hits both alike.
    t_packed, t_padded = [], []
    for _ in range(repeats):
        t_packed += time_pass(lambda b: loss_packed(packed_model, b), batches, device, 1)
        t_padded += time_pass(lambda s: loss_padded(hf_sdpa, eps, s, device), spans, device, 1)
    mp, md = statistics.median(t_packed), statistics.median(t_padded)
    return {
        "model": "random Llama: hidden 192, 4 layers, 6 heads / 2 kv heads, ffn 512, vocab 4096",
        "dtype": str(dtype).replace("torch.", ""), "device": str(device),
        "episodes": n_episodes, "tokens": total, "max_tokens": max_tokens, "seed": seed,
        "packed_batches": len(batches), "padded_batches": len(spans),
        "padded_slots": sum((e - s) * lm for s, e, lm in spans),
        "packed_seconds": t_packed, "padded_seconds": t_padded,
        "packed_tokens_per_s": total / mp, "padded_tokens_per_s": total / md,
        "speedup": md / mp,
    }


# ---------------------------------------------------------------- report
def print_tables(eff_rows, thr):
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # plain fallback
        Console = None
    heads = ["max_tokens", "seed", "tokens", "ours (batches)", "greedy (batches)", "padded (batches)",
             "padded non-pad", "lower bound"]
    lines = [[str(r["max_tokens"]), str(r["seed"]), str(r["tokens"]),
              f"{r['ours_eff']:.1%} ({r['ours_batches']})", f"{r['greedy_eff']:.1%} ({r['greedy_batches']})",
              f"{r['padded_eff']:.1%} ({r['padded_batches']})", f"{r['padded_nonpad_frac']:.1%}",
              str(r["lower_bound_batches"])] for r in eff_rows]
    thr_heads = ["method", "batches", "median s", "tokens/s", "ratio"]
    thr_lines = [] if thr is None else [
        ["packed (ours)", str(thr["packed_batches"]), f"{statistics.median(thr['packed_seconds']):.2f}",
         f"{thr['packed_tokens_per_s']:.0f}", f"{thr['speedup']:.2f}x"],
        ["padded (sdpa)", str(thr["padded_batches"]), f"{statistics.median(thr['padded_seconds']):.2f}",
         f"{thr['padded_tokens_per_s']:.0f}", "1.00x"]]
    if Console is not None:
        con = Console()
        for title, h, ls in [("Packing efficiency (real tokens / (micro-batches x max_tokens))", heads, lines),
                             ("Forward+backward throughput (real tokens)", thr_heads, thr_lines)]:
            if not ls:
                continue
            t = Table(title=title)
            for x in h:
                t.add_column(x)
            for row in ls:
                t.add_row(*row)
            con.print(t)
    else:
        for h, ls in [(heads, lines), (thr_heads, thr_lines)]:
            print(" | ".join(h))
            for row in ls:
                print(" | ".join(row))


def plot(eff_rows, thr, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2 if thr else 1, figsize=(11 if thr else 6, 4), squeeze=False)
    ax = axes[0][0]
    budgets = sorted({r["max_tokens"] for r in eff_rows})
    width = 0.27
    for k, (key, label) in enumerate([("ours_eff", "ours"), ("greedy_eff", "naive greedy"),
                                      ("padded_eff", "padded")]):
        vals = [statistics.median(r[key] for r in eff_rows if r["max_tokens"] == b) for b in budgets]
        ax.bar([i + (k - 1) * width for i in range(len(budgets))], vals, width, label=label)
    ax.axhline(0.95, color="k", ls="--", lw=0.8)
    ax.set_xticks(range(len(budgets)), [str(b) for b in budgets])
    ax.set_xlabel("max_tokens per micro-batch")
    ax.set_ylabel("packing efficiency (median over seeds)")
    ax.set_ylim(0, 1.05)
    ax.legend(loc="lower right")
    if thr:
        ax = axes[0][1]
        ax.bar(["packed (ours)", "padded (sdpa)"], [thr["packed_tokens_per_s"], thr["padded_tokens_per_s"]],
               color=["C0", "C2"])
        ax.set_ylabel("fwd+bwd real tokens/s")
        ax.set_title(f"{thr['device']} {thr['dtype']}: {thr['speedup']:.2f}x")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_output_args(ap)
    ap.add_argument("--png", default=None, help="default: the --json path with .png")
    ap.add_argument("--episodes", type=int, default=512, help="episodes per efficiency trial")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--budgets", default="8192,16384,32768")
    ap.add_argument("--thr-episodes", type=int, default=12, help="episodes in the throughput run")
    ap.add_argument("--thr-max-tokens", type=int, default=16384)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (smoke check of the script)")
    args = ap.parse_args()
    args.json = output_path(args.json, "bench_packing_cpu.json", args.record)
    if args.quick:
        args.episodes, args.seeds, args.thr_episodes, args.repeats = 64, 2, 4, 1
    dtype = getattr(torch, args.dtype) if args.dtype else (
        torch.bfloat16 if torch.device(args.device).type == "cuda" else torch.float32)

    budgets = [int(b) for b in args.budgets.split(",")]
    eff = efficiency_table(range(args.seeds), budgets, args.episodes)
    thr = None if args.skip_throughput else throughput(args.thr_episodes, args.thr_max_tokens, 0,
                                                       args.repeats, args.device, dtype)
    print_tables(eff, thr)
    med = {k: statistics.median(r[k] for r in eff) for k in ("ours_eff", "greedy_eff", "padded_eff")}
    result = {
        "benchmark": "bench_packing", "hardware": hardware(),
        "length_distribution": "log-normal(median 1200, sigma 0.9) clipped to [200, 8000] tokens",
        "efficiency_definition": "real tokens / (micro-batches * max_tokens)",
        "efficiency": eff, "efficiency_median": med, "throughput": thr,
        "timing_note": "packed and padded passes are interleaved per repeat so load from other "
                       "processes hits both alike; hardware.loadavg_1m is the load at the start",
        "targets": {"packing_efficiency>=0.95": med["ours_eff"] >= 0.95,
                    "packed_tokens_per_s>=1.5x_padded": None if thr is None else thr["speedup"] >= 1.5},
        "argv": sys.argv[1:],
    }
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    png = Path(args.png) if args.png else out.with_suffix(".png")
    plot(eff, thr, png)
    print(f"median efficiency: ours {med['ours_eff']:.1%}, greedy {med['greedy_eff']:.1%}, "
          f"padded {med['padded_eff']:.1%}" + ("" if thr is None else
                                                f"; packed/padded tokens/s {thr['speedup']:.2f}x"))
    print(f"wrote {out} and {png}")


if __name__ == "__main__":
    main()
