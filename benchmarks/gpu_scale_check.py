"""The scale path on one GPU: a 1-rank NCCL FSDP2 run of the trainer's real SFT + RL step, every
collective checked, and its measured peak memory next to the dry run's plan of the same config.

    torchrun --nproc_per_node=1 benchmarks/gpu_scale_check.py --json OUT.json      # on a GPU
    torchrun --nproc_per_node=1 benchmarks/gpu_scale_check.py --smoke --json X     # CPU (gloo), tiny

A 1-rank group runs every collective a node runs (fastrehearse.train.parallelize), so this is the
multi-GPU code path on the one GPU that is lent: each `dist` tensor collective is wrapped to count it
and to check that its tensor is on the compute device (NCCL rejects host tensors). The model is a
random tiny-qwen3 of --hidden / --layers (no weights are on the GPU machine). The dry run
(fastrehearse.train.dry_run.plan, world size 1, the GPU's memory) runs in a subprocess (it needs its
own fake process group); the JSON holds both, item by item where they can be compared:
`measured_peak_gib` (torch.cuda.max_memory_allocated over setup + steps) vs `plan_peak_gib`.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]


def overrides(a) -> list[str]:
    tiny = a.smoke
    return [f"run_dir={a.run_dir}", "model.spec=tiny-qwen3", f"model.options.hidden_size={64 if tiny else a.hidden}",
            f"model.options.num_layers={2 if tiny else a.layers}", f"model.options.num_heads={4 if tiny else a.hidden // 128}",
            f"model.options.num_kv_heads={2 if tiny else max(1, a.hidden // 512)}", "eval.num_tasks=0",
            "log.progress=false", "rollout.tasks_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=32",
            "rollout.max_episode_tokens=1024", "max_tokens=4096", "sft.steps=1", "sft.tasks_per_step=4",
            "algo.loss.kl_coef=0.01", "checkpoint.export=false", f"model.activation_checkpointing={a.ac}",
            "dist.timeout_s=120"]


def run(a) -> dict:
    from fastrehearse.train import failures, loop
    from fastrehearse.train.build import setup
    from fastrehearse.train.config import load_config
    from fastrehearse.train.parallelize import destroy_distributed, init_distributed
    calls, misplaced = Counter(), []
    cfg = load_config("configs/smoke.yaml", overrides(a))
    # as the trainer does: the collective timeout and the per-phase failure agreement / watchdog
    info = init_distributed("cpu" if a.smoke else "cuda", timeout_s=cfg.dist.timeout_s)
    failures.start(info.rank, info.world_size, cfg.dist.timeout_s, True)

    def checked(name):
        real = getattr(dist, name)

        def wrapper(*args, **kw):
            calls[name] += 1
            for t in list(args) + list(kw.values()):
                if isinstance(t, torch.Tensor) and t.device != info.device:
                    misplaced.append(f"dist.{name}: {t.device} (compute device {info.device})")
            return real(*args, **kw)
        return wrapper
    for name in ("all_reduce", "all_gather_object", "broadcast_object_list", "barrier"):
        setattr(dist, name, checked(name))
    cuda = info.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    run_ = setup(cfg, info)
    setup_s = time.perf_counter() - t0
    try:
        rows = [loop.sft_step(run_), loop.rl_step(run_)]
        stop = loop._agree_to_stop(run_)
    finally:
        failures.stop()
    out = {"world_size": info.world_size, "backend": info.backend, "device": str(info.device),
           "collectives": dict(calls), "misplaced": misplaced, "setup_s": round(setup_s, 2),
           "rows": rows, "stop": stop,
           "params": sum(p.numel() for p in run_.hf_model.parameters()),
           "measured_peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
           "gpu_memory_gib": torch.cuda.get_device_properties(info.device).total_memory / 2**30 if cuda else 80.0}
    destroy_distributed()
    return out


def plan_in_subprocess(a, gpu_gib: float) -> dict:
    code = ("import json,sys; from fastrehearse.train.config import load_config; "
            "from fastrehearse.train.dry_run import plan; "
            f"cfg = load_config('configs/smoke.yaml', {overrides(a)!r}); "
            f"print(json.dumps(plan(cfg, 1, {gpu_gib}, budget_basis='given').to_json()))")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       env={k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                                           "MASTER_ADDR", "MASTER_PORT",
                                                                           "TORCHELASTIC_RUN_ID", "GROUP_RANK")})
    if p.returncode != 0:
        return {"error": p.stderr[-2000:]}
    return json.loads(p.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--smoke", action="store_true", help="CPU, gloo, a 2-layer hidden-64 model")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--ac", choices=("true", "false"), default="false")
    ap.add_argument("--run-dir", default="/tmp/fr_gpu_scale_check")
    a = ap.parse_args(argv)
    if "RANK" not in os.environ:
        ap.error("run it under torchrun --nproc_per_node=1 (a real 1-rank process group)")
    res = run(a)
    if int(os.environ["RANK"]) == 0:
        res["plan"] = plan_in_subprocess(a, res["gpu_memory_gib"])
        if res["measured_peak_gib"] is not None and "peak_gib" in res["plan"]:
            res["plan_peak_gib"] = res["plan"]["peak_gib"]
            res["measured_over_plan"] = res["measured_peak_gib"] / res["plan_peak_gib"]
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(res, indent=2, default=str) + "\n")
        print(json.dumps({k: res.get(k) for k in ("world_size", "backend", "collectives", "misplaced",
                                                   "measured_peak_gib", "plan_peak_gib")}))
    return 1 if res["misplaced"] else 0


if __name__ == "__main__":
    from fastrehearse.train.parallelize import exit_worker   # a torchrun worker skips finalization
    sys.exit(exit_worker(main()))
