"""Does an arm's rollout carry training signal from a given checkpoint? Measured before training it.

The learning experiment (benchmarks/bench_learning.py, docs/learning.md) needs the rehearse arm's
rollouts to pay a mean reward strictly inside (0.05, 0.95) with groups of non-zero advantage;
v2's Ca arm did not (1.9%), which only showed after hours of training. This draws exactly the
rollouts the trainer would draw in its first K RL steps (the arm's config and `--set`s, its tasks,
seeds, group size, temperature and reward modes; the trainer's own `rollout()`), without any update,
and reports per checkpoint and arm: mean task reward, the share of groups with zero ACT / REHEARSE
advantage, the real-environment reward of the same episodes, the malformed share and the world-model
reward. Every (checkpoint, temperature, arm) runs in this one process, side by side.

    python benchmarks/probe_rollout_signal.py --model warmup=runs/learning_v2/warmup/export \\
        --arms R,Ca --temperatures 1.0,0.7,0.4 --steps 4

One seed (`--seed`, the trainer's `seed`): another seed draws other tasks and samples (v2's Ca
had reward 5.6% on seed 0 and exactly 0 on seeds 1 and 2), so probe the seeds you will train.

The pass rule printed per row is the experiment's: 0.05 < mean reward < 0.95 and at least one group with
a non-zero ACT advantage. Without updates the K steps are K draws from the starting policy: they
say what training's first steps see, not what later steps see once the policy has moved.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, SCRATCH, hardware, print_table, write_json  # noqa: E402
import bench_learning as bl  # noqa: E402

SIGNAL = (0.05, 0.95)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", required=True, metavar="NAME=PATH",
                   help="a checkpoint to probe (an HF export dir, or a model.spec name), repeatable")
    p.add_argument("--arms", default="Ca", help=f"comma list from {bl.KNOWN_ARMS} (S has no rollouts)")
    p.add_argument("--steps", type=int, default=4, help="RL steps' worth of rollouts (tasks_per_step x group each)")
    p.add_argument("--config", default="configs/learning_smollm2.yaml")
    p.add_argument("--level", default="easy@-accounts")
    p.add_argument("--temperatures", default=None, metavar="T,...",
                   help="rollout temperatures to probe side by side (default: the config's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="extra train override for every probe (after the arm's own)")
    p.add_argument("--show", type=int, default=0, metavar="K",
                   help="print the first K episodes of each probe as text (after the prompt), with their rewards")
    p.add_argument("--out", default=None, help="output prefix (.json; default runs/bench/rollout_signal, "
                                               "--record: benchmarks/results/rollout_signal)")
    p.add_argument("--record", action="store_true", help="write into benchmarks/results/")
    a = p.parse_args(argv)
    if a.out and a.record:
        p.error("--out and --record: give one")
    a.out = a.out or str((RESULTS if a.record else SCRATCH) / "rollout_signal")
    a.arms = [x.strip() for x in a.arms.split(",") if x.strip()]
    bad = [x for x in a.arms if x not in bl.KNOWN_ARMS or x == "S"]
    if bad or not a.arms:
        p.error(f"--arms: {bad or 'empty'} cannot be probed; choose from "
                f"{[x for x in bl.KNOWN_ARMS if x != 'S']}")
    models = {}
    for m in a.model:
        name, eq, path = m.partition("=")
        if not eq or not name or not path:
            p.error(f"--model: expected NAME=PATH, got {m!r}")
        if Path(path).exists() and not (Path(path) / "config.json").is_file():
            p.error(f"--model {name}: {path} is not an HF export (no config.json)")
        if name in models:
            p.error(f"--model: name {name!r} given twice")
        models[name] = path
    a.models = models
    if a.steps < 1:
        p.error(f"--steps must be >= 1, got {a.steps}")
    try:
        a.temperatures = [None] if a.temperatures is None else [float(t) for t in a.temperatures.split(",")]
    except ValueError:
        p.error(f"--temperatures: expected comma-separated numbers, got {a.temperatures!r}")
    if any(t is not None and not t > 0 for t in a.temperatures):
        p.error(f"--temperatures must be > 0 (a greedy rollout has no group spread), got {a.temperatures}")
    return a


def probe(a, name: str, path: str, arm: str, temperature: float | None) -> dict:
    import torch
    from fastrehearse.algo.advantages import compute_advantages
    from fastrehearse.train.build import setup
    from fastrehearse.train.config import load_config
    from fastrehearse.train.parallelize import init_distributed
    from fastrehearse.train.rollouts import rollout, rollout_row
    from fastrehearse.train.tasks import next_tasks, step_seed

    torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory() as tmp:
        sets = [f"env.options.level={a.level}", *bl.V2_SETS, f"run_dir={tmp}", f"model.spec={path}",
                f"seed={a.seed}", "sft.steps=0", f"steps={a.steps}", "log.progress=false",
                *bl.ARM_SETS[arm], *a.sets,
                *([f"rollout.temperature={temperature}"] if temperature is not None else [])]
        cfg = load_config(bl.ROOT / a.config, sets)
        run = setup(cfg, init_distributed(cfg.device))
        c, ec, steps, kept = cfg.rollout, cfg.rollout.engine, [], []
        t0 = time.perf_counter()
        for step in range(a.steps):    # the trainer's rl_step 1..K tasks and seeds (loop.py), no update
            tasks = next_tasks(run.train_tasks, step * c.tasks_per_step, c.tasks_per_step, cfg.seed)
            t_step = time.perf_counter()
            eps, metrics, failures = rollout(run, tasks, mode=ec.mode, temperature=ec.temperature,
                                             seed=step_seed(cfg.seed, step, 0), group_size=c.group_size,
                                             measure_fidelity=ec.measure_fidelity)
            row = rollout_row(eps, [metrics], time.perf_counter() - t_step)
            _, adv = compute_advantages(eps, cfg.algo.advantage)
            row.update(failures=failures, zero_signal_act=adv.zero_signal_frac.get("ACT", 0.0),
                       zero_signal_rehearse=adv.zero_signal_frac.get("REHEARSE", 0.0),
                       groups=adv.num_groups, act_signal_groups=adv.act_signal_groups,
                       rewards=[e.reward for e in eps])
            steps.append(row)
            for e in eps[:max(0, a.show - len(kept))]:
                _show(run.tokenizer, e)
            kept += eps
            print(f"  {name}/{arm}/T={ec.temperature} step {step + 1}/{a.steps}: reward {row.get('reward', float('nan')):.3f}, "
                  f"zero-signal ACT groups {row['zero_signal_act']:.2f}", flush=True)
        wall = time.perf_counter() - t0
        run.logger.close()
    rewards = [e.reward for e in kept]
    live = sum(s["act_signal_groups"] for s in steps)

    def mean(xs):     # over episodes (a step with failures weighs less), None when none has it
        xs = [float(x) for x in xs if x is not None]
        return statistics.fmean(xs) if xs else None
    sha = bl.weights_sha256(Path(path)) if (Path(path) / "config.json").is_file() else None
    out = {"model": name, "path": path, "weights_sha256": sha, "arm": arm, "temperature": cfg.rollout.engine.temperature,
           "seed": cfg.seed, "episodes": len(rewards),
           "failures": sum(s["failures"] for s in steps),
           "reward": mean(rewards),
           "groups": sum(s["groups"] for s in steps), "groups_with_act_signal": live,
           "zero_signal_rehearse": statistics.fmean(s["zero_signal_rehearse"] for s in steps),
           "reward_real": mean(e.metadata.get("reward_real") for e in kept),
           "malformed_frac": mean(bool(e.metadata.get("malformed")) for e in kept),
           "world_reward": mean(e.metadata.get("world_reward", {}).get("reward") for e in kept),
           "fidelity": mean(f["field_f1"] for e in kept for f in e.metadata.get("fidelity", [])),
           "wall_s": round(wall, 1), "steps": steps}
    r = out["reward"]
    out["signal"] = bool(r is not None and SIGNAL[0] < r < SIGNAL[1] and live > 0)
    return out


def _show(tok, ep) -> None:
    """One episode from its first generated token, roles marked: [ACT] policy, [REH] world model."""
    from fastrehearse.kernels.roles import Role
    start = next((i for i, r in enumerate(ep.roles) if r in (int(Role.ACT), int(Role.REHEARSE))), len(ep))
    parts, i = [], start
    while i < len(ep):
        j = i
        while j < len(ep) and ep.roles[j] == ep.roles[i]:
            j += 1
        tag = {int(Role.ACT): "[ACT]", int(Role.REHEARSE): "[REH]"}.get(ep.roles[i], "")
        parts.append(tag + tok.decode(ep.input_ids[i:j]))
        i = j
    wr = ep.metadata.get("world_reward", {}).get("reward")
    print(f"  --- task {ep.task_id}: reward {ep.reward:.2f}, real {ep.metadata.get('reward_real')}, "
          f"world {wr if wr is None else round(wr, 3)}\n  " + "".join(parts).replace("\n", "\n  "))


def main(argv=None) -> int:
    a = parse_args(argv)
    rows = []
    for name, path in a.models.items():
        for t in a.temperatures:
            for arm in a.arms:
                print(f"probe {name} / {arm} / T={t or 'config'}: {a.steps} steps of rollouts", flush=True)
                rows.append(probe(a, name, path, arm, t))
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    cols = ["model", "arm", "T", "episodes", "reward", "ACT groups with signal", "reward_real", "malformed",
            "world reward", "signal"]
    print_table(f"rollout signal of the first {a.steps} RL steps, no update (pass: {SIGNAL[0]} < reward < "
                f"{SIGNAL[1]} and a group with ACT signal)",
                [dict(zip(cols, [r["model"], r["arm"], r["temperature"], r["episodes"], fmt(r["reward"]),
                                 f"{r['groups_with_act_signal']}/{r['groups']}", fmt(r["reward_real"]),
                                 fmt(r["malformed_frac"]), fmt(r["world_reward"]),
                                 "yes" if r["signal"] else "NO"])) for r in rows], cols)
    write_json(Path(a.out).with_suffix(".json"),
               {"argv": sys.argv[1:], "signal_window": SIGNAL, "seed": a.seed, "level": a.level,
                "config": a.config, "sets": a.sets, "hardware": hardware(), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
