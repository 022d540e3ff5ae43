"""Does world rehearsal teach? Rehearsal with a reward computable inside the rehearsed world,
against real-environment RL, a format-learning control, hybrid and SFT-only, at matched compute
(docs/learning.md). Version 2 of the first learning experiment (benchmarks/results/learning_smollm2.*).

One shared SFT warm-up (configs/learning_smollm2.yaml + V2_SETS: the embedded SmolLM2-135M, builtin
EASY tasks with the final answer checked, every tool family but `accounts`, constant lr), then per
arm and seed a normal `fastrehearse train` run directory starting from the warm-up export, with the
same optimizer steps, learning rate and trajectories per step:
  R   GRPO with every call executed for real, rewarded on calls + the real answer (env.reward=real)
  Ca  rehearse only, env.reward=consistent (the answer graded against the episode's own rehearsed
      responses), REHEARSE on the world-model format reward (no grounded term: no real env at all)
  Cc  rehearse only, env.reward=calls (the answer never checked): the format-learning control;
      same world-model reward as Ca, so Ca - Cc isolates the consistent answer reward
  H   hybrid (hybrid_p 0.5), env.reward=consistent, REHEARSE on format + grounded (field F1 against
      the real response of each rehearsed call), ACT baseline within real / rehearsed strata, CE on
      real responses (w_observed 1)
  S   SFT only on gold trajectories: the same optimizer steps, lr and trajectories per step
  Hw0, Hg0  (only when named in --arms) H with w_observed 0 / with grounded_weight 0: which term
      drove H's collapse
  Cag  (only when named) Ca with the world-model reward gated on ACT signal
      (algo.advantage.gate_rehearse_on_act=true): without ACT signal the world-model reward alone moved Ca
  Calr (only when named) Ca at lr 2e-5: the lr scaled by the rollout temperature 0.4
Then per checkpoint (the warm-up's too): `fastrehearse eval` (real tools, greedy) on the seen
families' held-out tasks (answer-checked; call success rescored from the same episodes), the
held-out `accounts` family (answers are copies of a tool field: call and answer success), the seen
families under API drift; `python -m fastrehearse.eval.teacher_forced` (log-prob of the gold answer
given the real responses on 256 held-out items; rehearsal fidelity split into schema / echo /
hidden values). Report: per-item results, 95% Welch and bootstrap intervals for every contrast,
the minimum detectable effect (benchmarks/learning_report.py).

    python benchmarks/bench_learning.py --dry-run       # the plan, time estimate, every command
    python benchmarks/bench_learning.py --pilot         # warm-up + its eval: is it in the 25-60% window?
    nice -n 19 python benchmarks/bench_learning.py      # the experiment; rerun the same command to resume
    python benchmarks/bench_learning.py --report-only   # rebuild JSON/MD/PNG from the run dirs
    python benchmarks/bench_learning.py --seeds R=2 --prior benchmarks/results/learning_v2_smollm2.json
                                  # add seed 1 of R; seed 0 from the earlier report (its run dir is gone)
    python benchmarks/bench_learning.py --tiny          # the whole pipeline on a tiny random model
    python benchmarks/bench_learning.py --design v4 --pilot              # v4 pilot 1: the warm-up ladder
    python benchmarks/bench_learning.py --design v4 --pilot --warmup K   # v4 pilot 2-3: signal, cost

Resumable: a finished run (its summary.json counts the planned steps) is skipped, a started one
continues with `fastrehearse train --resume`, an eval directory continues where it stopped (and is
redone when its checkpoint changed). Failed commands are listed under "failures"; their numbers
are missing, never zero. Writes runs/bench/learning_v2_smollm2.{json,md,png} (--record: benchmarks/results/).
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, SCRATCH, hardware  # noqa: E402

ARMS = ("R", "Ca", "Cc", "H", "S")
ARM_NAMES = {"R": "real-env GRPO, answer reward", "Ca": "rehearse, consistent reward",
             "Cc": "rehearse, calls reward (control)", "H": "hybrid 0.5, consistent + grounded world reward",
             "S": "SFT-only"}
_WORLD = ["algo.world_reward.mode=world"]
ARM_SETS = {   # --set overrides of each arm (on top of: start from the warm-up export, seed, steps)
    "R": ["rollout.mode=real", "env.reward=real"],
    "Ca": ["rollout.mode=rehearse", "env.reward=consistent", *_WORLD, "algo.world_reward.grounded_weight=0"],
    "Cc": ["rollout.mode=rehearse", "env.reward=calls", *_WORLD, "algo.world_reward.grounded_weight=0"],
    "H": ["rollout.mode=hybrid", "rollout.hybrid_p=0.5", "env.reward=consistent", *_WORLD,
          "algo.world_reward.grounded_weight=1.0", "algo.hybrid_baseline=strata", "algo.loss.w_observed=1.0"],
    "S": [],   # plan(): steps=0, sft.steps=--steps, sft.tasks_per_step = tasks x group, sft.lr = optim.lr
}
DEFAULT_SEEDS = {"R": 4, "Ca": 4, "Cc": 3, "H": 3, "S": 2}
# Ablations, run only when named (--arms Hw0,Hg0,Cag): H collapsed into argument-less calls with ~no
# ACT signal, so either the CE on real responses or the grounded world reward moved the policy; Ca's
# zero-reward seeds collapsed too, moved by the world-model reward alone, which Cag gates on ACT signal.
ABLATIONS = {   # arm: (name, the arm it ablates, its extra --sets)
    "Hw0": ("H without CE on real responses (w_observed 0)", "H", ["algo.loss.w_observed=0.0"]),
    "Hg0": ("H without the grounded world reward (grounded_weight 0)", "H", ["algo.world_reward.grounded_weight=0.0"]),
    "Cag": ("Ca with the world-model reward gated on ACT signal", "Ca", ["algo.advantage.gate_rehearse_on_act=true"]),
    # At rollout temperature T the trained log-probs are of softmax(z / T): a weight step moves the
    # sampled distribution's logits 1/T times as far as at T = 1. Ca at lr 2e-5 = 5e-5 x 0.4 tests
    # whether the collapses of the T = 0.4 runs are that larger effective step (docs/learning.md).
    "Calr": ("Ca at lr 2e-5 (5e-5 x T for T = 0.4)", "Ca", ["optim.lr=2e-05"]),
}
for _arm, (_name, _base, _sets) in ABLATIONS.items():   # later --set wins: the ablated term after the arm's own
    ARM_NAMES[_arm], ARM_SETS[_arm], DEFAULT_SEEDS[_arm] = _name, [*ARM_SETS[_base], *_sets], 1
# v4's controls (docs/learning.md, v4 pre-registration), run only when named (--arms R,Ca,Cv,Sr,S):
# Cv acts on the real tools through a scrambled world (envs/scramble.py: schema and echoes kept,
# every other value random), paid by `consistent`; Sr is rejection-sampling SFT on its own rehearsed
# episodes that pass `consistent` (sft.source own_rehearsals: plan() gives it RL-like steps).
CONTROLS = {
    "Cv": ("real tools, scrambled content, consistent reward", ["rollout.mode=real", "env.options.scramble=true",
                                                                "env.reward=consistent"]),
    "Sr": ("SFT on own rehearsals passing consistent", ["rollout.mode=rehearse", "env.reward=consistent",
                                                        "sft.source=own_rehearsals"]),
}
for _arm, (_name, _sets) in CONTROLS.items():
    ARM_NAMES[_arm], ARM_SETS[_arm], DEFAULT_SEEDS[_arm] = _name, list(_sets), 4
KNOWN_ARMS = (*ARMS, *ABLATIONS, *CONTROLS)
# Every run, warm-up included: hold out `accounts` (EASY answers there are copies of a response
# field, so 0% would say something about unseen tools) and a constant lr (v1's SFT-only had constant
# 1e-4, RL a cosine from 5e-5: two changes at once).
# rollback_nonfinite off: its copy of parameters + Adam moments is ~1.6 GB per run, and two runs
# beside the other agents' jobs ran the 24 GiB box out of memory (the kernel killed two runs). The
# update is the same unless a step is non-finite, which then stops the run with an error instead.
# max_tokens 1024 (one episode's limit): micro-batches of ~1k tokens instead of 4k hold ~4x fewer
# activations (a run peaked at 6.3 GB RSS); the gradient is the same (global token normalization,
# docs/training.md), only the summation order differs. checkpoint.every 2: a killed run loses <= 2 steps.
V2_SETS = ["optim.min_lr_ratio=1.0", "optim.rollback_nonfinite=false", "max_tokens=1024", "checkpoint.every=2"]
KILLED_RETRIES = 3      # a command killed by a signal (the OOM killer) is resumed up to this often
DRIFT = "rename,errors,units,formats"
WINDOW = (0.25, 0.60)   # the warm-up's answer-checked success the pilot must find
# v4 (docs/learning.md, "v4 pre-registration" and its addendum): the builtin "rules" family, no
# held-out family; every run is configs/learning_v4_smollm2.yaml plus the sets below (its own file
# carries the episode limits, the constant lr and the checkpoint cadence v2/v3 set with V2_SETS).
V4 = {"config": "configs/learning_v4_smollm2.yaml", "level": "rules", "arms": ("R", "Ca", "Cv", "Sr", "S"),
      "seeds": {"R": 8, "Ca": 8, "Cv": 4, "Sr": 4, "S": 2}, "steps": 24, "n_eval": 100, "n_mixed": 64,
      "n_rehearsal": 64, "ladder": (8, 16, 32, 64), "pilot_items": (100, 64), "fallback": (0.15, 0.75)}
CLI = str(Path(sys.executable).parent / "fastrehearse")   # the console script of this venv
# Per-unit costs, seconds at 1 torch thread, two runs side by side on the shared 2-core box with
# the other agents' jobs (load average ~5; measured 2026-12-04, docs/learning.md "Cost"): GRPO step
# of 3 tasks x 4 samples, SFT per gold trajectory, eval episode, teacher-forced log-prob item and
# rehearsal item, process start with the model load. A quiet box is ~2x faster.
COST_S = {"rl_step": 180.0, "sft_traj": 11.0, "eval_item": 7.0, "tf_item": 1.5, "tf_rehearsal": 8.0,
          "start": 40.0}


def parse_seeds(text: str | None, arms: list[str]) -> dict[str, int]:
    if text is None:
        return {arm: DEFAULT_SEEDS[arm] for arm in arms}
    if text.strip().isdigit():
        return {arm: int(text) for arm in arms}
    out = {}
    for part in text.split(","):
        arm, eq, n = part.partition("=")
        if not eq or arm.strip() not in arms or not n.strip().isdigit():
            raise ValueError(f"--seeds: expected N or ARM=N,... over {arms}, got {part!r}")
        out[arm.strip()] = int(n)
    return {arm: out.get(arm, DEFAULT_SEEDS[arm]) for arm in arms}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--design", choices=("v2", "v4"), default="v2",
                   help="v2/v3 (EASY tasks, a held-out family) or v4 (the rules family; docs/learning.md)")
    p.add_argument("--warmup", type=int, default=None, metavar="K",
                   help=f"v4: the warm-up W_K (sft.steps=K) the arms start from, K in {V4['ladder']} "
                        "(the pilot picks it)")
    p.add_argument("--config", default=None, help="train config (default configs/learning_smollm2.yaml, "
                                                  "--tiny: configs/learning_tiny.yaml, "
                                                  f"--design v4: {V4['config']})")
    p.add_argument("--level", default=None,
                   help="builtin level of every run, holding out a family as LEVEL@-FAMILY "
                        "(default easy@-accounts; --design v4: rules, no family held out)")
    p.add_argument("--arms", default=None, help=f"comma list from {KNOWN_ARMS} (default: {ARMS}; "
                                                f"--design v4: {V4['arms']})")
    p.add_argument("--seeds", default=None, help=f"N for every arm or ARM=N,... (default {DEFAULT_SEEDS})")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per arm (default 12; --tiny 2)")
    p.add_argument("--n-eval", type=int, default=None, help="held-out tasks per success metric (default 64)")
    p.add_argument("--n-tf", type=int, default=None, help="items of the teacher-forced log-prob (default 256)")
    p.add_argument("--n-rehearsal", type=int, default=None,
                   help="items of the teacher-forced rehearsal split (default 64)")
    p.add_argument("--jobs", type=int, default=2, help="runs side by side (each --threads torch threads)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--runs", default=None, help="root of the run dirs (default runs/learning_v2)")
    p.add_argument("--out", default=None, help="output prefix (default runs/bench/learning_v2_smollm2; "
                                               "--record: benchmarks/results/learning_v2_smollm2)")
    p.add_argument("--record", action="store_true",
                   help="write the report into benchmarks/results/, replacing the committed one")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="extra train override for every run, warm-up included")
    p.add_argument("--no-drift", action="store_true", help="skip the API-drift eval (reported missing)")
    p.add_argument("--tiny", action="store_true", help="tiny random model, a handful of steps and items")
    p.add_argument("--pilot", action="store_true", help="only the warm-up and its eval, then the window check")
    p.add_argument("--dry-run", action="store_true", help="print the plan and the commands; run nothing")
    p.add_argument("--report-only", action="store_true", help="only rebuild JSON/MD/PNG from the run dirs")
    p.add_argument("--prior", action="append", default=[], metavar="JSON",
                   help="an earlier report of the same plan: its arm/seed records stand for run dirs not "
                        "here (not retrained), when its warm-up is this one (repeatable)")
    a = p.parse_args(argv)
    v4 = a.design == "v4"
    if a.warmup is not None and not v4:
        p.error("--warmup: only with --design v4 (v2/v3 have one warm-up, the config's sft.steps)")
    if v4 and a.warmup is not None and a.warmup not in V4["ladder"]:
        p.error(f"--warmup: the pre-registered ladder is {V4['ladder']}, got {a.warmup}")
    if v4 and a.warmup is None and not (a.pilot or a.dry_run):   # --pilot --warmup K: steps 2-3
        p.error("--design v4 needs --warmup K (the level the pilot chose: run --pilot first)")
    a.level = a.level or (V4["level"] if v4 else "easy@-accounts")
    a.arms = a.arms or ",".join(V4["arms"] if v4 else ARMS)
    if v4 and a.seeds is None:
        a.seeds = ",".join(f"{k}={V4['seeds'][k]}" for k in V4["seeds"] if k in a.arms.split(","))
    a.config = a.config or (V4["config"] if v4 and not a.tiny else
                            f"configs/learning_{'tiny' if a.tiny else 'smollm2'}.yaml")
    a.steps = a.steps if a.steps is not None else (2 if a.tiny else V4["steps"] if v4 else 12)
    a.n_eval = a.n_eval if a.n_eval is not None else (3 if a.tiny else V4["n_eval"] if v4 else 64)
    a.n_tf = a.n_tf if a.n_tf is not None else (4 if a.tiny else 256)
    a.n_rehearsal = a.n_rehearsal if a.n_rehearsal is not None else (2 if a.tiny else 64)
    if v4 and not a.tiny:   # one teacher-forced pass: its log-prob and rehearsal items are the same 64
        a.n_tf = a.n_rehearsal = V4["n_rehearsal"]
    name = "learning_v4" if v4 else "learning_v2"
    a.runs = Path(a.runs or f"runs/{name}{'_tiny' if a.tiny else ''}")
    if a.out and a.record:
        p.error("--out and --record: give one")
    a.out = Path(a.out) if a.out else (a.runs / f"{name}_tiny" if a.tiny else
                                       (RESULTS if a.record else SCRATCH) / f"{name}_smollm2")
    a.arms = [x.strip() for x in a.arms.split(",") if x.strip()]
    bad = [x for x in a.arms if x not in KNOWN_ARMS]
    if bad or not a.arms:
        p.error(f"--arms: unknown {bad or 'empty'}; choose from {list(KNOWN_ARMS)}")
    try:
        a.seeds = parse_seeds(a.seeds, a.arms)
    except ValueError as e:
        p.error(str(e))
    for name, v, lo in (("--steps", a.steps, 1), ("--n-eval", a.n_eval, 1), ("--n-tf", a.n_tf, 1),
                        ("--n-rehearsal", a.n_rehearsal, 0), ("--jobs", a.jobs, 1), ("--threads", a.threads, 1),
                        *((f"--seeds {k}", v, 1) for k, v in a.seeds.items())):
        if v < lo:
            p.error(f"{name} must be >= {lo}, got {v}")
    base, _, fam = a.level.partition("@")
    if not v4 and (not fam.startswith("-") or len(fam) < 2):
        p.error(f"--level must hold out a tool family as LEVEL@-FAMILY (e.g. easy@-accounts), got {a.level!r}")
    return a


# ---- the plan --------------------------------------------------------------------------------
def base_sets(a) -> list[str]:
    return [f"env.options.level={a.level}", *([] if a.design == "v4" else V2_SETS), *a.sets]


def load_cfg(a):
    from fastrehearse.train.config import load_config
    path = ROOT / a.config if not Path(a.config).is_absolute() else Path(a.config)
    return load_config(path, base_sets(a))


def categories(a, cfg) -> dict[str, str]:
    """The eval categories: seen families' held-out tasks and the held-out family, answer checked
    (v4: the rules family's test tasks, primary; the mixed levels 1-3, secondary)."""
    tools = str(cfg.env.options.get("tools", "auto"))
    if a.design == "v4":
        return {"primary": f"test:{a.level}:{tools}", "mixed": f"test:mixed:{tools}"}
    base, _, fam = a.level.partition("@")
    return {"seen": f"test:{a.level}:{tools}:answer", "heldout": f"test:{base}@{fam[1:]}:{tools}:answer"}


def train_cmd(a, run_dir: Path, sets: list[str]) -> list[str]:
    return [CLI, "train", "--config", str(a.config),
            *[x for s in [f"run_dir={run_dir}", *base_sets(a), *sets] for x in ("--set", s)]]


def _eval_common(cfg, export: Path) -> list[str]:
    # episode tokens: the model's context (no item refused for length)
    return ["--suite", "builtin", "--policy", str(export), "--max-turns", str(cfg.rollout.engine.max_turns),
            "--max-new-tokens", str(cfg.rollout.engine.max_new_tokens), "--seed", "0", "--quiet"]


def _eval_job(cfg, export: Path, out: Path, category: str, *window: str) -> tuple[str, Path, list[str]]:
    """One `fastrehearse eval` of `category` (window: its --limit / --offset flags) into `out`."""
    return ("eval", out, [CLI, "eval", *_eval_common(cfg, export), "--categories", category, *window,
                          "--out", str(out)])


def pilot_eval_cmd(a, cfg, export: Path, run_dir: Path) -> tuple[str, Path, list[str]]:
    """v4 pilot items: test-split rules tasks 100-163, disjoint from the primary 0-99."""
    off, n = V4["pilot_items"] if not a.tiny else (a.n_eval, a.n_eval)
    return _eval_job(cfg, export, run_dir / "eval_pilot", categories(a, cfg)["primary"],
                     "--offset", str(off), "--limit", str(n))


def eval_cmds(a, cfg, export: Path, run_dir: Path) -> list[tuple[str, Path, list[str]]]:
    """(kind, out dir or file, command) for one checkpoint."""
    cats = categories(a, cfg)
    if a.design == "v4":
        n_mixed = a.n_eval if a.tiny else V4["n_mixed"]
        tf = [sys.executable, "-m", "fastrehearse.eval.teacher_forced", "--model", str(export),
              "--tools", str(cfg.env.options.get("tools", "auto")), "--threads", str(a.threads)]
        return [_eval_job(cfg, export, run_dir / "eval", cats["primary"], "--limit", str(a.n_eval)),
                _eval_job(cfg, export, run_dir / "eval_mixed", cats["mixed"], "--limit", str(n_mixed)),
                ("tf", run_dir / "teacher_forced.json",
                 [*tf, "--level", a.level, "--n", str(a.n_rehearsal), "--n-rehearsal", str(a.n_rehearsal),
                  "--out", str(run_dir / "teacher_forced.json")])]
    common = [*_eval_common(cfg, export), "--limit", str(a.n_eval)]
    tools = str(cfg.env.options.get("tools", "auto"))
    base, _, fam = a.level.partition("@")
    tf = [sys.executable, "-m", "fastrehearse.eval.teacher_forced", "--model", str(export), "--tools", tools,
          "--threads", str(a.threads)]
    out = [("eval", run_dir / "eval", [CLI, "eval", *common, "--categories", cats["seen"], cats["heldout"],
                                        "--out", str(run_dir / "eval")]),
           ("tf", run_dir / "teacher_forced.json",
            [*tf, "--level", a.level, "--n", str(a.n_tf), "--n-rehearsal", str(a.n_rehearsal),
             "--out", str(run_dir / "teacher_forced.json")]),
           ("tf_heldout", run_dir / "teacher_forced_heldout.json",
            [*tf, "--level", f"{base}@{fam[1:]}", "--n", str(a.n_eval), "--n-rehearsal", str(a.n_rehearsal),
             "--out", str(run_dir / "teacher_forced_heldout.json")])]
    if not a.no_drift:
        out.append(("drift", run_dir / "eval_drift", [CLI, "eval", *common, "--categories", cats["seen"],
                                                       "--drift", DRIFT, "--out", str(run_dir / "eval_drift")]))
    return out


def warmup_of(a, cfg, k: int | None = None) -> dict:
    """The warm-up job: v2/v3 one (the config's sft.steps); v4 W_k (sft.steps=k) of the ladder."""
    if a.design != "v4":
        warm = a.runs / "warmup"
        return {"run_dir": warm, "train": train_cmd(a, warm, []), "total_steps": cfg.sft.steps,
                "evals": eval_cmds(a, cfg, warm / "export", warm)}
    k = a.warmup if k is None else k
    warm = a.runs / f"W{k}"
    return {"run_dir": warm, "train": train_cmd(a, warm, [f"sft.steps={k}"]), "total_steps": k,
            "evals": eval_cmds(a, cfg, warm / "export", warm), "pilot_eval": pilot_eval_cmd(a, cfg, warm / "export", warm)}


def plan(a, cfg) -> dict:
    warmup = warmup_of(a, cfg, a.warmup or (V4["ladder"][0] if a.design == "v4" else None))
    warm = warmup["run_dir"]
    runs = {}   # seed-major: with --jobs 2 the first seeds of every arm finish first
    per_step = cfg.rollout.tasks_per_step * cfg.rollout.group_size
    for seed in range(max(a.seeds.values())):
        for arm in a.arms:
            if seed >= a.seeds[arm]:
                continue
            d = a.runs / f"{arm}-s{seed}"
            steps = (["steps=0", f"sft.steps={a.steps}", f"sft.tasks_per_step={per_step}", f"sft.lr={cfg.optim.lr}"]
                     if arm == "S" else
                     # Sr: its SFT steps sample tasks_per_step x group_size episodes as an RL step does
                     ["steps=0", f"sft.steps={a.steps}", f"sft.lr={cfg.optim.lr}"] if arm == "Sr" else
                     ["sft.steps=0", f"steps={a.steps}"])
            sets = [f"model.spec={warm / 'export'}", f"seed={seed}", *steps, *ARM_SETS[arm]]
            runs[(arm, seed)] = {"run_dir": d, "train": train_cmd(a, d, sets), "total_steps": a.steps,
                                 "warmup": warm, "evals": eval_cmds(a, cfg, d / "export", d)}
    return {"warmup": warmup, "runs": runs}


def estimate_s(a, cfg, kept=frozenset()) -> dict:
    """Seconds of the plan, less the runs `kept` from --prior."""
    c = COST_S
    per_step = cfg.rollout.tasks_per_step * cfg.rollout.group_size
    todo = {arm: n - sum(1 for k in kept if k[0] == arm) for arm, n in a.seeds.items()}
    rl = sum(n for arm, n in todo.items() if arm != "S")
    sft = todo.get("S", 0)
    n_ckpt = sum(todo.values()) + 1
    evals = (2 + (0 if a.no_drift else 2)) * a.n_eval * c["eval_item"] + (a.n_tf + a.n_eval) * c["tf_item"] \
        + 2 * a.n_rehearsal * c["tf_rehearsal"] + 5 * c["start"]
    core = (c["start"] + cfg.sft.steps * cfg.sft.tasks_per_step * c["sft_traj"]
            + rl * (c["start"] + a.steps * c["rl_step"]) + sft * (c["start"] + a.steps * per_step * c["sft_traj"])
            + n_ckpt * evals)
    return {"core_s": core, "wall_s": core / min(a.jobs, 2), "per_unit_s": dict(c), "checkpoints": n_ckpt,
            "how": "per-unit costs measured on the loaded shared 2-core box, 1 thread, 2 runs side by side "
                   "(COST_S in this file; the drift eval counts twice: its fidelity pass); wall = core "
                   "seconds / min(jobs, 2)"}


def shell(cmd: list[str], threads: int) -> str:
    head = "fastrehearse" if cmd[0] == CLI else ("python" if cmd[0] == sys.executable else cmd[0])
    return f"OMP_NUM_THREADS={threads} " + shlex.join([head, *cmd[1:]])


# ---- running ---------------------------------------------------------------------------------
def _run(cmd: list[str], log: Path, threads: int, resume: list[str] | None = None) -> int:
    """Run `cmd` (logging to `log`); when a signal kills it (rc < 0: the OOM killer on a shared box)
    run it again, with `resume` appended when given, up to KILLED_RETRIES times."""
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           "TOKENIZERS_PARALLELISM": "false"}
    for attempt in range(KILLED_RETRIES + 1):
        with open(log, "a") as f:
            f.write(f"\n$ {shell(cmd, threads)}\n")
            f.flush()
            rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
            if rc >= 0 or attempt == KILLED_RETRIES:
                return rc
            f.write(f"\n[bench_learning] killed by signal {-rc}; running it again ({attempt + 1}/{KILLED_RETRIES})\n")
        if resume and resume[0] not in cmd:
            cmd = cmd + resume
    return rc


def _finished(run_dir: Path, total_steps: int) -> bool:
    try:
        s = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return False
    return s.get("steps") == total_steps and (run_dir / "export" / "config.json").exists()


def _fingerprint(export: Path) -> dict:
    return {str(p.name): [p.stat().st_size, p.stat().st_mtime_ns] for p in sorted(export.glob("*.safetensors"))}


def weights_sha256(export: Path) -> str:
    """sha256 over the bytes of the export's *.safetensors files (in name order)."""
    h = hashlib.sha256()
    for f in sorted(export.glob("*.safetensors")):
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 24), b""):
                h.update(block)
    return h.hexdigest()


SAME_AS_WARMUP = "same_weights_as_warmup.json"
_SHA_MEMO: dict[tuple[str, str], str] = {}


def _sha_of(export: Path) -> str:
    key = (str(export.resolve()), json.dumps(_fingerprint(export)))
    if key not in _SHA_MEMO:
        _SHA_MEMO[key] = weights_sha256(export)
    return _SHA_MEMO[key]


def same_as_warmup(run_dir: Path, warm: Path) -> str | None:
    """The shared sha256 when the arm's export is byte for byte the warm-up's (an arm that got no
    gradient). Greedy evaluation is then deterministic in the weights, so the warm-up's eval dirs
    are its numbers and are not run twice. Recorded in run_dir/same_weights_as_warmup.json, checked
    against the current files every time (a retrained arm loses it)."""
    mark = run_dir / SAME_AS_WARMUP
    try:
        rec = json.loads(mark.read_text())
        if rec.get("fingerprint") == _fingerprint(run_dir / "export") and \
                rec.get("warmup_fingerprint") == _fingerprint(warm / "export"):
            return rec["sha256"]
    except (OSError, ValueError, KeyError):
        pass
    if not list((run_dir / "export").glob("*.safetensors")):
        return None
    sha = _sha_of(run_dir / "export")
    if sha != _sha_of(warm / "export"):
        mark.unlink(missing_ok=True)
        return None
    mark.write_text(json.dumps({"sha256": sha, "fingerprint": _fingerprint(run_dir / "export"),
                                "warmup_fingerprint": _fingerprint(warm / "export")}))
    return sha


def _eval_complete(out: Path, n: int) -> bool:
    """Every category scored on n items without errors (the drift run's fidelity pass included)."""
    try:
        r = json.loads((out / "results.json").read_text())
    except (OSError, ValueError):
        return False
    return all(c.get("n") == n and c.get("errors") == 0 for c in r["categories"].values()) and \
        (r.get("fidelity_measured", False) or not r.get("drift"))


def _tf_complete(path: Path, fp: dict, n: int, n_rehearsal: int) -> bool:
    try:
        r = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return r.get("checkpoint") == fp and len(r.get("logprob_items", [])) == n and \
        len(r.get("rehearsal_items", [])) == n_rehearsal and \
        all("value_logprob" in x for x in r["logprob_items"])   # files from before that field: redo


def train_then_eval(a, job: dict, failures: list) -> None:
    d = Path(job["run_dir"])
    total = job["total_steps"]
    log = d.parent / f"{d.name}.log"
    if not _finished(d, total):
        started = any((d / n).exists() for n in ("config.yaml", "metrics.jsonl", "checkpoints"))
        cmd = job["train"] + (["--resume"] if started else [])
        rc = _run(cmd, log, a.threads, resume=["--resume"])
        if rc != 0 or not _finished(d, total):
            failures.append({"command": shell(cmd, a.threads), "rc": rc, "log": str(log)})
            return
    if job.get("warmup") is not None and same_as_warmup(d, Path(job["warmup"])):
        return                     # evaluated once, as the warm-up (the report reads its files)
    fp = _fingerprint(d / "export")
    for kind, out, cmd in job["evals"]:
        if kind.startswith("tf"):
            n = a.n_tf if kind == "tf" else a.n_eval
            if _tf_complete(out, fp, n, a.n_rehearsal):
                continue
            rc = _run(cmd, log, a.threads)
            if rc == 0:            # tie the file to the checkpoint it measured
                r = json.loads(out.read_text())
                out.write_text(json.dumps({**r, "checkpoint": fp}, indent=1))
        else:
            mark = out / "bench_checkpoint.json"
            if out.exists() and (not mark.exists() or json.loads(mark.read_text()) != fp):
                shutil.rmtree(out)   # an eval of another checkpoint (the arm was retrained): start over
            if _eval_complete(out, a.n_eval):
                continue
            out.mkdir(parents=True, exist_ok=True)
            mark.write_text(json.dumps(fp))
            rc = _run(cmd, log, a.threads)
        if rc != 0:
            failures.append({"command": shell(cmd, a.threads), "rc": rc, "log": str(log)})


def _in_window(success: float) -> bool:
    return WINDOW[0] <= success <= WINDOW[1]


def choose_warmup(rungs: list[dict]) -> int | None:
    """The pre-registered rule over the rungs evaluated so far ({"k", "success"} in ladder order):
    the first inside WINDOW; none inside: the one nearest the window's middle when it lies within
    V4["fallback"] (ties: the earlier rung); else None (stop)."""
    for r in rungs:
        if _in_window(r["success"]):
            return r["k"]
    if not rungs:
        return None
    mid = sum(WINDOW) / 2
    best = min(rungs, key=lambda r: abs(r["success"] - mid))
    return best["k"] if V4["fallback"][0] <= best["success"] <= V4["fallback"][1] else None


def pilot_ladder(a, cfg, failures: list) -> int:
    """v4 pilot step 1 (docs/learning.md): W_8, W_16, W_32, W_64 in that order, each trained and
    evaluated on the pilot items; the first inside WINDOW is chosen, none inside: the one nearest the
    window's middle if within V4["fallback"], else stop. Writes RUNS/pilot_ladder.json."""
    rungs = []
    for k in (V4["ladder"] if not a.tiny else V4["ladder"][:2]):
        job = warmup_of(a, cfg, k)
        train_then_eval(a, {**job, "evals": [job["pilot_eval"]]}, failures)
        if failures:
            print(f"pilot: W_{k} failed: {failures}")
            return 1
        res = json.loads((job["pilot_eval"][1] / "results.json").read_text())
        cat = res["categories"][categories(a, cfg)["primary"]]
        rungs.append({"k": k, "success": cat["accuracy"], "n": cat["n"], "run_dir": str(job["run_dir"]),
                      "eval_command": shell(job["pilot_eval"][2], a.threads)})
        print(f"pilot: W_{k} solves {100 * cat['accuracy']:.1f}% of {cat['n']} pilot items")
        if _in_window(cat["accuracy"]):
            break
    chosen = choose_warmup(rungs)
    out = {"window": WINDOW, "fallback": V4["fallback"], "rungs": rungs, "chosen": chosen,
           "rule": "the first W_k inside the window; none: nearest the middle if within the fallback, else stop"}
    (a.runs / "pilot_ladder.json").write_text(json.dumps(out, indent=1))
    if chosen is None:
        print("pilot: no warm-up within the fallback range: the family does not fit this model (stop, report it)")
        return 3
    print(f"pilot: chosen warm-up W_{chosen}; next: pilot steps 2-3 from it (--warmup {chosen}), see docs/learning.md")
    return 0


def _rl_rows(run_dir: Path) -> list[dict]:
    """The RL rows of a run's metrics.jsonl ([] before its first row)."""
    f = run_dir / "metrics.jsonl"
    return [r for r in map(json.loads, f.read_text().splitlines()) if r.get("stage") == "rl"] if f.exists() else []


def pilot_signal(a, cfg, failures: list) -> int:
    """v4 pilot steps 2-3 (docs/learning.md) from W_{--warmup}: 2 RL steps of Ca and of R at
    group_size 8 (16 when Ca's zero-signal fraction of ACT groups is above 0.5), the stop check on
    Ca's mean `consistent` rollout reward, and one whole RL step of Ca timed on HF and on vLLM
    (each run's second step: time between its metrics rows). Writes RUNS/pilot_signal.json with the
    projected cost of the minimum design on this machine."""
    warm = warmup_of(a, cfg)["run_dir"]
    root = a.runs / "pilot"
    out: dict = {"warmup": a.warmup, "runs": {}}

    def run(name: str, arm: str, sets: list[str]) -> dict | None:
        d = root / name
        # checkpoint.every=1: one RL step at 8 x 8 episodes takes longer than a CPU session can
        # hold (docs/learning.md, v4 pilot), so a run interrupted after its first step resumes there
        job = {"run_dir": d, "total_steps": 2, "evals": [],
               "train": train_cmd(a, d, [f"model.spec={warm / 'export'}", "seed=0", "sft.steps=0", "steps=2",
                                         "checkpoint.every=1", *ARM_SETS[arm], *sets])}
        rows = _rl_rows(d)
        if len(rows) != 2:   # finished runs are read, not rerun
            train_then_eval(a, job, failures)
            rows = _rl_rows(d)
        if failures or len(rows) != 2:
            return None
        rec = {"command": shell(job["train"], a.threads),
               "zero_signal_act": [r["zero_signal_groups"] for r in rows], "reward": [r["reward"] for r in rows],
               "step2_s": rows[1]["time"] - rows[0]["time"], "rollout_s": [r["rollout_s"] for r in rows],
               "update_s": [r.get("train_s") for r in rows], "episode_tokens": [r.get("episode_tokens") for r in rows]}
        out["runs"][name] = rec
        return rec

    for group in (8, 16):
        ca, r = [run(f"{arm}-g{group}", arm, [f"rollout.group_size={group}"]) for arm in ("Ca", "R")]
        if ca is None or r is None:
            print(f"pilot: a signal run failed: {failures}")
            return 1
        zs = sum(ca["zero_signal_act"]) / 2
        print(f"pilot: group {group}: Ca zero-signal ACT groups {zs:.2f}, R {sum(r['zero_signal_act']) / 2:.2f}; "
              f"Ca mean consistent reward {sum(ca['reward']) / 2:.3f}")
        if zs <= 0.5:
            break
    out["group_size"] = group
    ca_reward = sum(out["runs"][f"Ca-g{group}"]["reward"]) / 2
    out["stop"] = not (0.05 <= ca_reward <= 0.95)
    vl = run(f"Ca-g{group}-vllm", "Ca", [f"rollout.group_size={group}", "rollout.backend=vllm"])
    hf_s = out["runs"][f"Ca-g{group}"]["step2_s"]
    out["step_s"] = {"hf": hf_s, "vllm": vl["step2_s"] if vl else None}
    best = min(v for v in out["step_s"].values() if v is not None)
    n_runs = sum(V4["seeds"].values())
    out["projection_h"] = {"rl_steps_only": n_runs * V4["steps"] * best / 3600,
                           "how": f"{n_runs} runs x {V4['steps']} steps x the faster backend's whole step "
                                  f"({best:.0f} s), evals not included; one job at a time at {a.threads} thread(s)"}
    out["fits_budget_16h"] = out["projection_h"]["rl_steps_only"] <= 16
    out["load_1min"] = os.getloadavg()[0]
    (a.runs / "pilot_signal.json").write_text(json.dumps(out, indent=1))
    print(f"pilot: whole RL step of Ca: HF {hf_s:.0f} s, vLLM {out['step_s']['vllm'] or float('nan'):.0f} s; "
          f"minimum design ~{out['projection_h']['rl_steps_only']:.0f} h of RL steps alone "
          f"({'within' if out['fits_budget_16h'] else 'ABOVE'} the 16 h budget)")
    if out["stop"]:
        print(f"pilot: Ca's mean consistent reward {ca_reward:.3f} is outside [0.05, 0.95]: stop (no signal)")
        return 3
    return 0 if out["fits_budget_16h"] else 4


def record_pilot(a) -> Path:
    """The v4 pilot's record: RUNS/pilot_ladder.json and RUNS/pilot_signal.json (what exists of
    them) with every pilot eval's per-item scores, into OUT_pilot.json (--record:
    benchmarks/results/learning_v4_smollm2_pilot.json)."""
    rec: dict = {"hardware": hardware(), "pre_registration": "docs/learning.md, v4 pre-registration + addendum"}
    for step in ("ladder", "signal"):
        f = a.runs / f"pilot_{step}.json"
        rec[step] = json.loads(f.read_text()) if f.exists() else None
    for rung in (rec["ladder"] or {}).get("rungs", []):
        items = Path(rung["run_dir"]) / "eval_pilot" / "items.jsonl"
        if not items.is_absolute():
            items = ROOT / items
        rung["items"] = {r["id"]: r["score"] for r in map(json.loads, items.read_text().splitlines())}
    out = Path(f"{a.out}_pilot.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rec, indent=1))
    print(f"wrote {out}")
    return out


def read_pilot(a) -> dict | None:
    """The v4 pilot's record (record_pilot): beside this report's output, else the committed one."""
    for f in (Path(f"{a.out}_pilot.json"), RESULTS / "learning_v4_smollm2_pilot.json"):
        if f.exists():
            return json.loads(f.read_text())
    return None


def main(argv=None) -> int:
    a = parse_args(argv)
    cfg = load_cfg(a)
    pl = plan(a, cfg)
    import learning_report as lr
    try:
        priors = lr.load_priors(a, cfg, a.prior)
    except ValueError as e:
        print(f"bench_learning: error: {e}", file=sys.stderr)
        return 2
    # a finished run dir here wins over an earlier report's record of it
    priors = {k: v for k, v in priors.items() if not _finished(pl["runs"][k]["run_dir"], pl["runs"][k]["total_steps"])}
    kept = set(priors)
    pl_run = {k: j for k, j in pl["runs"].items() if k not in kept}
    est = estimate_s(a, cfg, kept)
    jobs = [pl["warmup"], *pl_run.values()]
    print(f"plan: warm-up ({cfg.sft.steps} SFT steps, level {a.level}) -> arms {a.seeds} seeds x {a.steps} steps; "
          f"eval n={a.n_eval} per success metric, teacher-forced n={a.n_tf}, rehearsal split n={a.n_rehearsal}; "
          f"{a.jobs} jobs x {a.threads} threads; run dirs under {a.runs}")
    if a.design == "v4" and not a.tiny:   # COST_S is v2/v3's EASY episodes: v4's are ~3x longer
        print("estimate: none before the pilot times a whole RL step (docs/learning.md, pilot step 3)")
    elif not a.tiny:   # the per-unit costs are SmolLM2's
        print(f"estimate: {est['core_s'] / 3600:.1f} core-hours, ~{est['wall_s'] / 3600:.1f} h wall "
              f"({est['checkpoints']} checkpoints; {est['how']})")
    print("commands (each train command is rerun with --resume after an interruption):")
    for j in (jobs[:1] if a.pilot else jobs):
        print("  " + shell(j["train"], a.threads))
        for _, _, c in ([j["pilot_eval"]] if a.pilot and "pilot_eval" in j else j["evals"]):
            print("  " + shell(c, a.threads))
    if kept:
        print(f"kept from --prior (not run): {', '.join(f'{arm}-s{seed}' for arm, seed in sorted(kept))}")
    if a.dry_run:
        return 0
    failures: list = []
    t0 = time.perf_counter()
    if a.pilot and a.design == "v4":   # --warmup K: steps 2-3 from the chosen W_K
        if a.report_only:
            record_pilot(a)
            return 0
        rc = pilot_signal(a, cfg, failures) if a.warmup else pilot_ladder(a, cfg, failures)
        record_pilot(a)
        return rc
    if not a.report_only:
        train_then_eval(a, {**pl["warmup"], "evals": []}, failures)   # every arm starts from its export
        if a.pilot:
            if not failures:
                train_then_eval(a, pl["warmup"], failures)
            return lr.pilot_verdict(a, cfg, pl, failures, WINDOW)
        if not failures:   # the warm-up's own eval runs beside the arms
            with cf.ThreadPoolExecutor(max_workers=a.jobs) as ex:
                for f in [ex.submit(train_then_eval, a, j, failures) for j in jobs]:
                    f.result()
    wall = None if a.report_only else time.perf_counter() - t0
    if a.design == "v4":
        import learning_report_v4 as lr4
        res = lr4.report_v4(a, cfg, pl, failures, wall, read_pilot(a), priors)
        lr4.write_outputs(res, a.out)
    else:
        res = lr.report(a, cfg, pl, failures, wall, est, priors)
        lr.write_outputs(res, a.out)
    if failures or res["missing"]:
        print(f"{len(failures)} command(s) failed, {len(res['missing'])} number(s) missing: see {a.out}.md")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
