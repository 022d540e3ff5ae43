"""Peak host memory per rank of building a sharded run's models: whole-model loading on every rank
against the sharded construction the trainer uses (fastrehearse/train/model_init.py).

    python benchmarks/bench_load_memory.py [--world 2] [--hidden 1024 --layers 8] [--json PATH]

One Hugging Face directory (a Llama-shaped model, untied head, bf16 safetensors as real checkpoints
ship) is written once; then for each method `torchrun --nproc_per_node=WORLD` builds the policy, the
KL reference and the HF generation copy on gloo, and every rank reports its peak RSS (ru_maxrss)
before and after. Methods:
  whole    the trainer's loading at commit b8c1a74: every rank loads the whole model in fp32,
           deep-copies it for the reference and the generation copy, then shards the policy
  sharded  built on meta, sharded, each rank reading its rows from the safetensors files; the
           reference filled from the policy's shards; the generation copy filled one tensor at a time
Methods alternate over --rounds; the table shows medians. Writes runs/bench/load_memory_cpu.json (--record: benchmarks/results/).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _output import add_output_args, output_path  # noqa: E402
METHODS = ("whole", "sharded")


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0   # KiB on Linux


def worker(method: str, spec: str, out: str) -> None:
    """One rank (under torchrun): build the three models, report peak RSS."""
    import torch

    from fastrehearse.model import RehearsalModel
    from fastrehearse.train.config import load_config
    from fastrehearse.train.model_init import (build_generation_model, build_policy, build_reference,
                                               load_whole)
    from fastrehearse.train.parallelize import destroy_distributed, init_distributed, parallelize
    cfg = load_config(None, [f"model.spec={spec}", "algo.loss.kl_coef=0.01", "run_dir=/tmp/_fr_unused"])
    info = init_distributed("cpu")
    before = _rss_mib()
    if method == "whole":
        hf_model, _ = load_whole(cfg)
        ref = copy.deepcopy(hf_model).requires_grad_(False)
        gen = copy.deepcopy(hf_model).requires_grad_(False)
        policy = parallelize(RehearsalModel(hf_model), info)
        ref = parallelize(RehearsalModel(ref), info)
        peak_trained = _rss_mib()        # `whole` makes the generation copy before sharding
    else:
        policy, hf_model, _ = build_policy(cfg, info)
        ref = build_reference(cfg, info, policy, hf_model)
        peak_trained = _rss_mib()
        gen = build_generation_model(cfg, info, policy, hf_model)
    n_params = sum(p.numel() for p in hf_model.parameters())
    rec = {"rank": info.rank, "rss_before_mib": before, "rss_policy_ref_mib": peak_trained,
           "rss_peak_mib": _rss_mib(), "params": n_params}
    Path(f"{out}.{info.rank}").write_text(json.dumps(rec))
    del policy, ref, gen, torch
    destroy_distributed()


def make_model(path: Path, hidden: int, layers: int) -> int:
    import torch

    from fastrehearse.model.loader import build_tiny_model, load_tokenizer
    tok = load_tokenizer("smollm2")
    m = build_tiny_model("qwen2", vocab_size=len(tok), hidden_size=hidden, num_layers=layers,
                         num_heads=hidden // 64, num_kv_heads=max(1, hidden // 256),
                         intermediate_size=hidden * 11 // 4, dtype=torch.bfloat16)
    m.save_pretrained(path)
    tok.save_pretrained(path)
    return sum(p.numel() for p in m.parameters())


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_method(method: str, spec: Path, world: int, tmp: Path) -> list[dict]:
    out = tmp / f"{method}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}", f"--master_port={_port()}",
           __file__, "--worker", method, str(spec), str(out)]
    p = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"bench_load_memory: {method} failed:\n{(p.stdout + p.stderr)[-3000:]}")
    return [json.loads(Path(f"{out}.{r}").read_text()) for r in range(world)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    add_output_args(ap)
    ap.add_argument("--worker", nargs=3, metavar=("METHOD", "SPEC", "OUT"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.json = output_path(a.json, "load_memory_cpu.json", a.record)
    if a.worker:
        worker(*a.worker)
        return 0
    for name in ("world", "hidden", "layers", "rounds"):
        if getattr(a, name) < 1:
            ap.error(f"--{name} must be >= 1")
    if a.hidden % 256:
        ap.error("--hidden must be a multiple of 256 (64-wide heads, 4 query heads per KV head)")
    from rich.console import Console
    from rich.table import Table
    with tempfile.TemporaryDirectory(prefix="fr_loadmem_") as td:
        tmp = Path(td)
        spec = tmp / "model"
        n = make_model(spec, a.hidden, a.layers)
        runs = {m: [] for m in METHODS}
        for r in range(a.rounds):
            for m in (METHODS if r % 2 == 0 else METHODS[::-1]):
                runs[m].append(run_method(m, spec, a.world, tmp))
    fp32_mib = n * 4 / 2**20
    rec = {"benchmark": "bench_load_memory", "hardware": f"CPU ({platform.processor() or platform.machine()}, "
           f"{os.cpu_count()} cores), gloo", "world_size": a.world, "params": n, "model_fp32_mib": round(fp32_mib, 1),
           "shape": {"family": "qwen2", "hidden": a.hidden, "layers": a.layers, "vocab": 49152, "tied": False,
                     "checkpoint_dtype": "bf16"},
           "what": "policy + KL reference + HF generation copy built per rank", "rounds": a.rounds,
           "methods": {}}
    table = Table(title=f"peak host RSS per rank, {a.world} ranks, {n / 1e6:.0f}M params "
                        f"({fp32_mib:.0f} MiB in fp32), medians of {a.rounds} rounds")
    for col in ("method", "rank", "before MiB", "policy + ref: added MiB", "all three: added MiB",
                "all three / fp32 model"):
        table.add_column(col, justify="right")
    for m in METHODS:
        per_rank = []
        for rank in range(a.world):
            before = statistics.median(run[rank]["rss_before_mib"] for run in runs[m])
            trained = statistics.median(run[rank]["rss_policy_ref_mib"] for run in runs[m])
            peak = statistics.median(run[rank]["rss_peak_mib"] for run in runs[m])
            per_rank.append({"rank": rank, "rss_before_mib": round(before, 1),
                             "added_policy_ref_mib": round(trained - before, 1), "rss_peak_mib": round(peak, 1),
                             "added_mib": round(peak - before, 1), "added_over_model": round((peak - before) / fp32_mib, 3)})
            table.add_row(m, str(rank), f"{before:.0f}", f"{trained - before:.0f}", f"{peak - before:.0f}",
                          f"{(peak - before) / fp32_mib:.2f}x")
        rec["methods"][m] = {"per_rank": per_rank, "samples": runs[m]}
    worst = {m: max(r["added_mib"] for r in rec["methods"][m]["per_rank"]) for m in METHODS}
    rec["ratio_added_sharded_over_whole"] = round(worst["sharded"] / worst["whole"], 3)
    trained = {m: max(r["added_policy_ref_mib"] for r in rec["methods"][m]["per_rank"]) for m in METHODS}
    rec["ratio_policy_ref_sharded_over_whole"] = round(trained["sharded"] / trained["whole"], 3)
    # On CPU the generation copy is host memory by necessity (the rollout decodes there); on a GPU
    # it is device memory, and what stays on the host is the policy + reference column.
    rec["note"] = ("on CPU the compute device is the host: the shards and the fp32 generation copy count as "
                   "host memory; on a GPU they live in device memory and the host keeps only what loading "
                   "reads (one tensor's rows at a time)")
    Console().print(table)
    print(f"worst rank, memory added: policy + reference sharded / whole = "
          f"{rec['ratio_policy_ref_sharded_over_whole']:.2f}; all three = {rec['ratio_added_sharded_over_whole']:.2f}")
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(rec, indent=2) + "\n")
    print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    from fastrehearse.train.parallelize import exit_worker   # a torchrun worker skips finalization
    sys.exit(exit_worker(main()))
