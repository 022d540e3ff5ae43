"""Does world rehearsal teach? Rehearsal with a reward computable inside the rehearsed world,
against real-environment RL, a format-learning control, hybrid and SFT-only, at matched compute
(issue 25; docs/learning.md). Version 2 of the issue-15 experiment (benchmarks/results/learning_smollm2.*).

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
from _common import RESULTS, SCRATCH  # noqa: E402

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
    p.add_argument("--config", default=None, help="train config (default configs/learning_smollm2.yaml, "
                                                  "--tiny: configs/learning_tiny.yaml)")
    p.add_argument("--level", default="easy@-accounts",
                   help="builtin level of every run, holding out a family as LEVEL@-FAMILY")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma list from {KNOWN_ARMS} (default: {ARMS})")
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
    a.config = a.config or f"configs/learning_{'tiny' if a.tiny else 'smollm2'}.yaml"
    a.steps = a.steps if a.steps is not None else (2 if a.tiny else 12)
    a.n_eval = a.n_eval if a.n_eval is not None else (3 if a.tiny else 64)
    a.n_tf = a.n_tf if a.n_tf is not None else (4 if a.tiny else 256)
    a.n_rehearsal = a.n_rehearsal if a.n_rehearsal is not None else (2 if a.tiny else 64)
    a.runs = Path(a.runs or f"runs/learning_v2{'_tiny' if a.tiny else ''}")
    if a.out and a.record:
        p.error("--out and --record: give one")
    a.out = Path(a.out) if a.out else (a.runs / "learning_v2_tiny" if a.tiny else
                                       (RESULTS if a.record else SCRATCH) / "learning_v2_smollm2")
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
    if not fam.startswith("-") or len(fam) < 2:
        p.error(f"--level must hold out a tool family as LEVEL@-FAMILY (e.g. easy@-accounts), got {a.level!r}")
    return a


# ---- the plan --------------------------------------------------------------------------------
def base_sets(a) -> list[str]:
    return [f"env.options.level={a.level}", *V2_SETS, *a.sets]


def load_cfg(a):
    from fastrehearse.train.config import load_config
    path = ROOT / a.config if not Path(a.config).is_absolute() else Path(a.config)
    return load_config(path, base_sets(a))


def categories(a, cfg) -> dict[str, str]:
    """The eval categories: seen families' held-out tasks and the held-out family, answer checked."""
    tools = str(cfg.env.options.get("tools", "auto"))
    base, _, fam = a.level.partition("@")
    return {"seen": f"test:{a.level}:{tools}:answer", "heldout": f"test:{base}@{fam[1:]}:{tools}:answer"}


def train_cmd(a, run_dir: Path, sets: list[str]) -> list[str]:
    return [CLI, "train", "--config", str(a.config),
            *[x for s in [f"run_dir={run_dir}", *base_sets(a), *sets] for x in ("--set", s)]]


def eval_cmds(a, cfg, export: Path, run_dir: Path) -> list[tuple[str, Path, list[str]]]:
    """(kind, out dir or file, command) for one checkpoint."""
    cats = categories(a, cfg)
    common = ["--suite", "builtin", "--policy", str(export), "--limit", str(a.n_eval),
              "--max-turns", str(cfg.rollout.engine.max_turns), "--max-new-tokens", str(cfg.rollout.engine.max_new_tokens),
              "--seed", "0", "--quiet"]   # episode tokens: the model's context (no item refused for length)
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


def plan(a, cfg) -> dict:
    warm = a.runs / "warmup"
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
    return {"warmup": {"run_dir": warm, "train": train_cmd(a, warm, []), "total_steps": cfg.sft.steps,
                       "evals": eval_cmds(a, cfg, warm / "export", warm)}, "runs": runs}


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
    if not a.tiny:   # the per-unit costs are SmolLM2's
        print(f"estimate: {est['core_s'] / 3600:.1f} core-hours, ~{est['wall_s'] / 3600:.1f} h wall "
              f"({est['checkpoints']} checkpoints; {est['how']})")
    print("commands (each train command is rerun with --resume after an interruption):")
    for j in (jobs[:1] if a.pilot else jobs):
        print("  " + shell(j["train"], a.threads))
        for _, _, c in j["evals"]:
            print("  " + shell(c, a.threads))
    if kept:
        print(f"kept from --prior (not run): {', '.join(f'{arm}-s{seed}' for arm, seed in sorted(kept))}")
    if a.dry_run:
        return 0
    failures: list = []
    t0 = time.perf_counter()
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
    res = lr.report(a, cfg, pl, failures, None if a.report_only else time.perf_counter() - t0, est, priors)
    lr.write_outputs(res, a.out)
    if failures or res["missing"]:
        print(f"{len(failures)} command(s) failed, {len(res['missing'])} number(s) missing: see {a.out}.md")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
