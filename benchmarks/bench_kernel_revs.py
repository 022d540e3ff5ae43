"""The kernels at two git revisions, side by side in one process (CPU, torch backend).

A change to the kernels' math (e.g. the off-target sums that keep confident tokens' gradients
exact) must not cost speed. This times fwd+bwd of `linear_logprobs` (vocabulary-blocked torch path)
and `linear_policy_loss` (fused; the torch fast path, and the row path with an entropy gradient) for
`kernels/` as of --old (extracted with `git archive` into a temp dir and imported as its own
package) and as checked out now, alternating which runs first in each pair. Prints medians and the
median of the per-pair ratios; writes JSON.

    nice .venv/bin/python benchmarks/bench_kernel_revs.py --old 0a97fd6 --reps 8
"""
from __future__ import annotations

import argparse
import importlib
import io
import json
import platform
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _output import add_output_args, output_path  # noqa: E402


def export_rev(rev: str, into: Path, *paths: str) -> Path:
    """The tree at `rev` (or only `paths` of it) extracted under `into` with `git archive`."""
    data = subprocess.run(["git", "-C", str(ROOT), "archive", rev, *paths], check=True,
                          capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(into, filter="data")
    return into


def load_old_kernels(rev: str, into: Path):
    """`kernels/` at `rev` as the package `kernels_<rev>` (relative imports keep it self-contained)."""
    name = "kernels_" + "".join(c for c in rev if c.isalnum())
    export_rev(rev, into, "kernels")
    (into / "kernels").rename(into / name)
    sys.path.insert(0, str(into))
    return importlib.import_module(name)


def cases(k, x, w, t, roles, adv, old):
    def logprobs(ent):
        def f():
            xk, wk = x.clone().requires_grad_(), w.clone().requires_grad_()
            lp, e = k.linear_logprobs(xk, wk, t, with_entropy=ent, backend="torch")
            (lp.sum() + (e.sum() if ent else 0)).backward()
        return f

    def loss(entropy_coef):
        def f():
            xk, wk = x.clone().requires_grad_(), w.clone().requires_grad_()
            cfg = k.PolicyLossConfig(entropy_coef=entropy_coef)
            k.linear_policy_loss(xk, wk, t, roles, adv, old, cfg, backend="torch").loss.backward()
        return f

    return {"linear_logprobs": logprobs(False), "linear_logprobs + entropy": logprobs(True),
            "policy_loss (torch fast path)": loss(0.0), "policy_loss + entropy gradient": loss(0.01)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--old", required=True, help="git revision whose kernels/ is the baseline")
    p.add_argument("--reps", type=int, default=8)
    p.add_argument("--shape", default="512,576,49152", help="N,H,V (default: SmolLM2-135M's head)")
    add_output_args(p)
    a = p.parse_args()
    a.json = output_path(a.json, "kernel_revs_cpu.json", a.record)
    torch.set_num_threads(1)
    n, h, v = (int(s) for s in a.shape.split(","))
    import fastrehearse.kernels as new
    with tempfile.TemporaryDirectory() as tmp:
        old_k = load_old_kernels(a.old, Path(tmp))
        g = torch.Generator().manual_seed(0)
        x = torch.randn(n, h, generator=g)
        w = torch.randn(v, h, generator=g) * h ** -0.5
        t = torch.randint(0, v, (n,), generator=g)
        roles, adv = torch.ones(n, dtype=torch.long), torch.randn(n, generator=g)
        old_lp = torch.full((n,), -5.0)
        co, cn = cases(old_k, x, w, t, roles, adv, old_lp), cases(new, x, w, t, roles, adv, old_lp)
        rows = {}
        print(f"N={n} H={h} V={v}, 1 thread, {a.reps} pairs, order alternating")
        print(f"{'case':32s} {'old ms':>9s} {'new ms':>9s} {'new/old':>8s} {'pair ratio':>10s}")
        for name in co:
            fo, fn = co[name], cn[name]
            fo(), fn()                                   # warm-up
            to, tn = [], []
            for i in range(a.reps):
                order = ((fo, to), (fn, tn)) if i % 2 == 0 else ((fn, tn), (fo, to))
                for f, acc in order:
                    s = time.perf_counter()
                    f()
                    acc.append(time.perf_counter() - s)
            mo, mn = statistics.median(to), statistics.median(tn)
            pr = statistics.median(b / a_ for a_, b in zip(to, tn))
            rows[name] = {"old_ms": 1e3 * mo, "new_ms": 1e3 * mn, "ratio_of_medians": mn / mo,
                          "median_pair_ratio": pr, "old_s": to, "new_s": tn}
            print(f"{name:32s} {1e3 * mo:9.1f} {1e3 * mn:9.1f} {mn / mo:8.3f} {pr:10.3f}")
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    out = {"old": a.old, "new": f"{head} (working tree)", "shape": {"N": n, "H": h, "V": v}, "threads": 1,
           "reps": a.reps, "host": {"cpu": platform.processor() or platform.machine(),
                                    "torch": torch.__version__},
           "load_1m": __import__("os").getloadavg()[0], "rows": rows}
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(out, indent=1))
    print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
