"""Does world rehearsal teach? SFT-only vs real-environment vs rehearse-only vs hybrid RL, matched
compute, on the builtin suite (issue 15; docs/learning.md).

One shared SFT warm-up checkpoint (configs/learning_smollm2.yaml: the embedded SmolLM2-135M, builtin
EASY tasks with the final answer checked, every tool family but the calendar), then per arm and seed
a normal `fastrehearse train` run directory starting from the warm-up export, with the same number
of optimizer steps, tasks per step, group size and seeds:
  sft-only  --steps more SFT steps (same optimizer steps, no RL: separates "more training" from "RL")
  real      GRPO with every call executed for real (rollout.mode=real)
  rehearse  role-wise GRPO on the model's own rehearsed responses (rollout.mode=rehearse, EnvACE),
            rewarded like every other arm (calls and final answer checked)
  rehearse-calls  the same, rewarded on the calls only (env.options.easy_answer=false): the answer
            check needs the real tool's value, which a rehearsing trainer never sees
  hybrid    rollout.mode=hybrid, hybrid_p=0.3, CE on the real (OBSERVED) responses (w_observed=1)
Then `fastrehearse eval` (real tools, greedy) on each final export and on the warm-up: task success
(EASY: the spelled-out call made), answer-checked success, answer-checked success under API drift,
answer-checked success on the held-out tool family (calendar: tools never seen in training), and
world-model fidelity (field F1 of rehearsed vs real responses); relative weight change from the
warm-up; reward / fidelity curves from each run's metrics.jsonl.

    python benchmarks/bench_learning.py --dry-run          # the plan, time estimate, exact commands
    nice python benchmarks/bench_learning.py               # the experiment (~2.6 h on 2 quiet cores)
    python benchmarks/bench_learning.py --tiny             # the whole pipeline on a tiny random model
    python benchmarks/bench_learning.py --report-only      # rebuild JSON/MD/PNG from the run dirs

Resumable: rerun the same command after a kill. A finished run (its summary.json counts the planned
steps) is skipped, a started one continues with `fastrehearse train --resume`, an eval directory
continues where it stopped (and is redone when its checkpoint changed). Commands that fail are
listed under "failures" in the JSON and their numbers are missing, never zero.
Writes benchmarks/results/learning_smollm2.{json,md,png} (--tiny: <runs>/learning_tiny.*).
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import hashlib
import json
import math
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, hardware  # noqa: E402

ARMS = ("sft-only", "real", "hybrid", "rehearse-calls", "rehearse")
ARM_SETS = {   # --set overrides of each arm (on top of: start from the warm-up export, seed, steps)
    "sft-only": [],
    "real": ["rollout.mode=real"],
    "rehearse": ["rollout.mode=rehearse"],
    # Rehearse-only with the reward a rehearsing trainer can compute without the real tool: the
    # calls are graded (right tool, right arguments, replayed offline on the task's world) but not
    # the final answer, whose value only the real tool's response holds. Same prompts and eval.
    "rehearse-calls": ["rollout.mode=rehearse", "env.options.easy_answer=false"],
    "hybrid": ["rollout.mode=hybrid", "rollout.hybrid_p=0.3", "algo.loss.w_observed=1.0"],
}
DRIFT = "rename,errors,units,formats"
METRICS = ("task_success", "answer_success", "drift_success", "heldout_success", "fidelity_f1")
# Measured per-unit costs (SmolLM2-135M, 1 torch thread, two processes side by side on a 2-core
# box; benchmarks/results/eval_smollm2_notes.md): a GRPO step of 3 tasks x 4 samples ~80 s (the
# rl12 runs: 3 SFT + 12 GRPO steps + 16 eval items in ~19 min each); an eval item of builtin EASY
# ~4-10 s (24-item answer-checked rows: 112-258 s; with --max-steps 2 the low end); an SFT step of
# 4 gold trajectories ~30 s (forward+backward of 2048 tokens ~22 s on 2 threads); a process start
# with the model load ~40 s.
CLI = str(Path(sys.executable).parent / "fastrehearse")   # the console script of this venv
COST_S = {"rl_step": 80.0, "sft_step": 30.0, "eval_item": 5.0, "start": 40.0}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help="train config (default configs/learning_smollm2.yaml, "
                                                  "--tiny: configs/learning_tiny.yaml)")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma list from {ARMS}")
    p.add_argument("--seeds", type=int, default=None, help="seeds per arm (default 2; --tiny 2)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per arm (default 16; --tiny 2)")
    p.add_argument("--n-eval", type=int, default=None, help="held-out tasks per metric (default 64; --tiny 3)")
    p.add_argument("--jobs", type=int, default=2, help="runs side by side (each --threads torch threads)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--runs", default=None, help="root of the run dirs (default runs/learning; --tiny "
                                                "runs/learning_tiny)")
    p.add_argument("--out", default=None, help="output prefix (default benchmarks/results/learning_smollm2;"
                                               " --tiny <runs>/learning_tiny)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="extra train override for every run, warm-up included (e.g. optim.lr=3e-5)")
    p.add_argument("--light-eval", default="", metavar="WHICH",
                   help="comma list of 'warmup' and/or 'sN' (seed N of every arm): those checkpoints get "
                        "the clean categories only, without the fidelity pass and the drift run (about "
                        "a third of the eval time); their drift / fidelity are reported missing, never 0")
    p.add_argument("--tiny", action="store_true", help="tiny random model, a handful of steps and items")
    p.add_argument("--dry-run", action="store_true", help="print the plan and the commands; run nothing")
    p.add_argument("--report-only", action="store_true", help="only rebuild JSON/MD/PNG from the run dirs")
    a = p.parse_args(argv)
    a.config = a.config or f"configs/learning_{'tiny' if a.tiny else 'smollm2'}.yaml"
    a.seeds = a.seeds if a.seeds is not None else 2
    a.steps = a.steps if a.steps is not None else (2 if a.tiny else 16)
    a.n_eval = a.n_eval if a.n_eval is not None else (3 if a.tiny else 64)
    a.runs = Path(a.runs or f"runs/learning{'_tiny' if a.tiny else ''}")
    a.out = Path(a.out) if a.out else (a.runs / "learning_tiny" if a.tiny else RESULTS / "learning_smollm2")
    a.arms = [x.strip() for x in a.arms.split(",") if x.strip()]
    bad = [x for x in a.arms if x not in ARMS]
    for name, v, lo in (("--seeds", a.seeds, 1), ("--steps", a.steps, 1), ("--n-eval", a.n_eval, 1),
                        ("--jobs", a.jobs, 1), ("--threads", a.threads, 1)):
        if v < lo:
            p.error(f"{name} must be >= {lo}, got {v}")
    if bad or not a.arms:
        p.error(f"--arms: unknown {bad or 'empty'}; choose from {list(ARMS)}")
    a.light_eval = {x.strip() for x in a.light_eval.split(",") if x.strip()}
    odd = sorted(x for x in a.light_eval
                 if x != "warmup" and not (x[:1] == "s" and x[1:].isdigit() and int(x[1:]) < a.seeds))
    if odd:
        p.error(f"--light-eval: unknown {odd}; use 'warmup' and/or s0..s{a.seeds - 1}")
    return a


# ---- the plan --------------------------------------------------------------------------------
def load_cfg(path: str, sets: list[str]):
    from fastrehearse.train.config import load_config
    return load_config(ROOT / path if not Path(path).is_absolute() else path, sets)


def categories(cfg) -> dict[str, str]:
    """Eval categories from the train config's level 'LEVEL@-FAMILY' (train side without FAMILY)."""
    opts = cfg.env.options
    level, tools = str(opts.get("level", "mixed")), str(opts.get("tools", "auto"))
    base, _, fam = level.partition("@")
    if not fam.startswith("-") or len(fam) < 2:
        raise SystemExit(f"bench_learning: env.options.level must hold out a tool family as "
                         f"'LEVEL@-FAMILY' (e.g. easy@-calendar), got {level!r}")
    seen, held = f"{base}@{fam}", f"{base}@{fam[1:]}"
    return {"task_success": f"test:{seen}:{tools}", "answer_success": f"test:{seen}:{tools}:answer",
            "heldout_success": f"test:{held}:{tools}:answer", "drift_success": f"test:{seen}:{tools}:answer"}


def train_cmd(a, run_dir: Path, sets: list[str]) -> list[str]:
    return [CLI, "train", "--config", str(a.config),
            *[x for s in [f"run_dir={run_dir}", *a.sets, *sets] for x in ("--set", s)]]


def eval_cmds(a, cfg, export: Path, run_dir: Path, light: bool = False) -> list[tuple[Path, list[str]]]:
    cats = categories(cfg)
    common = ["--suite", "builtin", "--policy", str(export), "--limit", str(a.n_eval),
              "--max-steps", str(cfg.rollout.max_turns), "--max-new-tokens", str(cfg.rollout.max_new_tokens),
              "--seed", "0", "--quiet"]   # episode tokens: the model's context (no item refused for length)
    base = [CLI, "eval"]
    clean = run_dir / "eval"
    drift = run_dir / "eval_drift"
    clean_cats = ["--categories", cats["task_success"], cats["answer_success"], cats["heldout_success"]]
    if light:
        return [(clean, base + common + clean_cats + ["--out", str(clean)])]
    return [(clean, base + common + clean_cats + ["--measure-fidelity", "--out", str(clean)]),
            (drift, base + common + ["--categories", cats["drift_success"], "--drift", DRIFT,
                                     "--out", str(drift)])]


def plan(a, cfg) -> dict:
    warm = a.runs / "warmup"
    runs = {}   # seed-major: with --jobs 2 every arm's seed 0 finishes before any seed 1 starts
    for seed in range(a.seeds):
        for arm in a.arms:
            d = a.runs / f"{arm}-s{seed}"
            steps = ["steps=0", f"sft.steps={a.steps}"] if arm == "sft-only" else \
                    ["sft.steps=0", f"steps={a.steps}"]
            sets = [f"model.spec={warm / 'export'}", f"seed={seed}", *steps, *ARM_SETS[arm]]
            runs[(arm, seed)] = {"run_dir": d, "train": train_cmd(a, d, sets), "total_steps": a.steps,
                                 "warmup": warm,
                                 "evals": eval_cmds(a, cfg, d / "export", d, f"s{seed}" in a.light_eval)}
    return {"warmup": {"run_dir": warm, "train": train_cmd(a, warm, []), "total_steps": cfg.sft.steps,
                       "evals": eval_cmds(a, cfg, warm / "export", warm, "warmup" in a.light_eval)},
            "runs": runs}


def estimate_s(a, cfg) -> dict:
    rl = sum(1 for arm in a.arms if arm != "sft-only") * a.seeds
    sft = (a.seeds if "sft-only" in a.arms else 0)
    n_ckpt = len(a.arms) * a.seeds + 1
    c = COST_S
    core = (c["start"] + cfg.sft.steps * c["sft_step"]
            + rl * (c["start"] + a.steps * c["rl_step"]) + sft * (c["start"] + a.steps * c["sft_step"])
            + n_ckpt * (2 * c["start"] + 4 * a.n_eval * c["eval_item"]))
    return {"core_s": core, "wall_s": core / min(a.jobs, 2), "per_unit_s": dict(c),
            "how": "per-unit costs measured on the 2-core box at 1 thread (COST_S in this file); wall = "
                   "core seconds / min(jobs, 2) on a quiet 2-core machine"}


def shell(cmd: list[str], threads: int) -> str:
    return f"OMP_NUM_THREADS={threads} " + shlex.join(["fastrehearse" if cmd[0] == CLI else cmd[0], *cmd[1:]])


# ---- running ---------------------------------------------------------------------------------
def _run(cmd: list[str], log: Path, threads: int) -> int:
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           "TOKENIZERS_PARALLELISM": "false"}
    with open(log, "a") as f:
        f.write(f"\n$ {shell(cmd, threads)}\n")
        f.flush()
        return subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT).returncode


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
    """weights_sha256, hashed once per invocation and file state (the warm-up's export is compared
    with every arm's, by the runs and again by the report: ~0.5 GB each time at 135M)."""
    key = (str(export.resolve()), json.dumps(_fingerprint(export)))
    if key not in _SHA_MEMO:
        _SHA_MEMO[key] = weights_sha256(export)
    return _SHA_MEMO[key]


def same_as_warmup(run_dir: Path, warm: Path) -> str | None:
    """The shared sha256 when the arm's export is byte for byte the warm-up's (an arm that got no
    gradient, e.g. rehearse-only rewarded on the answer: reward 0 in every rollout). Greedy
    evaluation is then deterministic in the weights, so the warm-up's eval dirs are its numbers and
    are not run twice. Recorded in run_dir/same_weights_as_warmup.json, checked against the
    current files every time (a retrained arm loses it)."""
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


def train_then_eval(a, job: dict, failures: list) -> None:
    d = Path(job["run_dir"])
    total = job["total_steps"]
    if not _finished(d, total):
        started = any((d / n).exists() for n in ("config.yaml", "metrics.jsonl", "checkpoints"))
        cmd = job["train"] + (["--resume"] if started else [])
        rc = _run(cmd, d.parent / f"{d.name}.log", a.threads)
        if rc != 0 or not _finished(d, total):
            failures.append({"command": shell(cmd, a.threads), "rc": rc, "log": str(d.parent / f"{d.name}.log")})
            return
    if job.get("warmup") is not None and same_as_warmup(d, Path(job["warmup"])):
        return                     # evaluated once, as the warm-up (report reads its dirs)
    fp = _fingerprint(d / "export")
    for out, cmd in job["evals"]:
        mark = out / "bench_checkpoint.json"
        if out.exists() and (not mark.exists() or json.loads(mark.read_text()) != fp):
            import shutil   # an eval of another checkpoint (the arm was retrained): start over
            shutil.rmtree(out)
        if _eval_complete(out, a.n_eval, "--measure-fidelity" in cmd or "--drift" in cmd):
            continue
        out.mkdir(parents=True, exist_ok=True)
        mark.write_text(json.dumps(fp))
        rc = _run(cmd, d.parent / f"{d.name}.log", a.threads)
        if rc != 0:
            failures.append({"command": shell(cmd, a.threads), "rc": rc, "log": str(d.parent / f"{d.name}.log")})


def _eval_complete(out: Path, n: int, fidelity: bool) -> bool:
    """Every category scored on n items without errors, and the fidelity pass ended when it is
    wanted (a light eval made full later reruns only that pass: the CLI resumes the directory)."""
    try:
        r = json.loads((out / "results.json").read_text())
        if fidelity and "fidelity_measured" not in r:   # results.json written before the key existed:
            cfg = json.loads((out / "run.json").read_text())
            done = (cfg.get("measure_fidelity") or cfg.get("drift")) and \
                (out / "results.json").stat().st_mtime >= (out / "run.json").stat().st_mtime
            r["fidelity_measured"] = bool(done)        # (a switch-on rewrites run.json first)
    except (OSError, ValueError):
        return False
    return all(c.get("n") == n and c.get("errors") == 0 for c in r["categories"].values()) and \
        (r.get("fidelity_measured", False) or not fidelity)


# ---- reading the run dirs --------------------------------------------------------------------
def read_metrics(a, cfg, run_dir: Path) -> tuple[dict, list[str]]:
    """The five numbers of one checkpoint from its own eval dirs; None (with a reason) when missing."""
    cats, out, missing = categories(cfg), {}, []
    for key, cat in cats.items():
        d = run_dir / ("eval_drift" if key == "drift_success" else "eval")
        try:
            c = json.loads((d / "results.json").read_text())["categories"][cat]
        except (OSError, ValueError, KeyError):
            out[key] = None
            missing.append(f"{d}: {cat} not evaluated")
            continue
        ok = c.get("n") == a.n_eval and c.get("errors") == 0
        out[key] = c["accuracy"] if ok else None
        out.setdefault("n", {})[key] = c.get("n")
        if not ok:
            missing.append(f"{d}: {cat} has n={c.get('n')} of {a.n_eval}, {c.get('errors')} errors")
        if key == "answer_success":
            f = c.get("fidelity")   # absent when the model made no call to compare
            out["fidelity_f1"] = f["field_f1"] if f and ok else None
            out["fidelity_items"] = f["n_items"] if f else 0
        if key == "heldout_success":
            f = c.get("fidelity")
            out["heldout_fidelity_f1"] = f["field_f1"] if f and ok else None
    return out, missing


def curves(run_dir: Path) -> dict:
    rows = []
    try:
        for line in (run_dir / "metrics.jsonl").read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                pass   # a line cut short by a kill
    except OSError:
        return {}
    keys = ("reward", "fidelity", "loss", "zero_signal_groups", "episodes")
    out = {"step": [], "stage": [], **{k: [] for k in keys}}
    for r in rows:
        if "step" not in r:
            continue
        out["step"].append(r["step"])
        out["stage"].append(r.get("stage"))
        for k in keys:
            out[k].append(r.get(k))
    return out


def training_signal(c: dict) -> dict:
    """What the RL steps had to learn from (metrics.jsonl): mean reward, the share of GRPO groups
    whose rewards were all equal (zero advantage: no policy gradient), mean rollout fidelity."""
    def mean(xs):
        v = [x for x in xs if x is not None]
        return sum(v) / len(v) if v else None
    rl = [i for i, st in enumerate(c.get("stage", [])) if st == "rl"]
    return {"rl_steps": len(rl), "mean_reward": mean([c["reward"][i] for i in rl]),
            # the trainer logs it per step as the fraction of that step's groups
            "zero_signal_share": mean([c["zero_signal_groups"][i] for i in rl]),
            "mean_rollout_fidelity": mean([c["fidelity"][i] for i in rl])}


def weight_change(export: Path, ref: Path) -> float | None:
    """||W - W_warmup|| / ||W_warmup|| over every stored tensor (float64)."""
    from safetensors.torch import load_file
    try:
        a = {k: v for f in sorted(export.glob("*.safetensors")) for k, v in load_file(f).items()}
        b = {k: v for f in sorted(ref.glob("*.safetensors")) for k, v in load_file(f).items()}
    except (OSError, ValueError):
        return None
    if not a or a.keys() != b.keys():
        return None
    num = sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in a)
    den = sum(float(b[k].double().pow(2).sum()) for k in b)
    return math.sqrt(num / den) if den > 0 else None


def stats(xs: list) -> dict:
    v = [x for x in xs if x is not None]
    if not v:
        return {"mean": None, "std": None, "min": None, "max": None, "n_seeds": 0}
    m = sum(v) / len(v)
    sd = math.sqrt(sum((x - m) ** 2 for x in v) / (len(v) - 1)) if len(v) > 1 else None
    return {"mean": m, "std": sd, "min": min(v), "max": max(v), "n_seeds": len(v)}


VERSUS = ("answer_success", "heldout_success", "drift_success", "task_success")


def versus_sft(arms: dict) -> dict:
    """Each RL arm against SFT-only: difference of seed means and the seed spread it must beat.

    spread = the larger of the two arms' seed std: the issue-15 criterion "beats SFT-only by more
    than the seed spread". With 2 seeds a std is crude; the per-seed numbers stay in the JSON.
    """
    base = arms.get("sft-only")
    if base is None:
        return {}
    out = {}
    for arm, r in arms.items():
        if arm == "sft-only":
            continue
        out[arm] = {}
        for k in VERSUS:
            a_, b_ = r["summary"][k], base["summary"][k]
            if a_["mean"] is None or b_["mean"] is None:
                out[arm][k] = {"delta": None, "spread": None, "verdict": "missing"}
                continue
            d = a_["mean"] - b_["mean"]
            sds = [x for x in (a_["std"], b_["std"]) if x is not None]
            spread = max(sds) if len(sds) == 2 else None
            verdict = ("n/a (< 2 seeds)" if spread is None else "beats" if d > spread
                       else "worse" if d < -spread else "within spread")
            out[arm][k] = {"delta": d, "spread": spread, "verdict": verdict}
    return out


def report(a, cfg, pl: dict, failures: list, wall_s: float | None) -> dict:
    warm = pl["warmup"]["run_dir"]
    wm, wmiss = read_metrics(a, cfg, warm)
    arms, missing = {}, list(wmiss)
    for arm in a.arms:
        seeds = {}
        for seed in range(a.seeds):
            d = pl["runs"][(arm, seed)]["run_dir"]
            shared = same_as_warmup(d, warm) if (d / "export").exists() else None
            m, miss = read_metrics(a, cfg, warm if shared else d)
            missing += miss
            cv = curves(d)
            seeds[str(seed)] = {"run_dir": str(d), "metrics": m, "weights_same_as_warmup": shared,
                                "weight_change": weight_change(d / "export", warm / "export"),
                                "curves": cv, "signal": training_signal(cv),
                                "train_command": shell(pl["runs"][(arm, seed)]["train"], a.threads),
                                "eval_commands": [shell(c, a.threads) for _, c in pl["runs"][(arm, seed)]["evals"]]}
        summ = {k: stats([s["metrics"].get(k) for s in seeds.values()]) for k in METRICS}
        summ["weight_change"] = stats([s["weight_change"] for s in seeds.values()])
        arms[arm] = {"seeds": seeds, "summary": summ}
    return {
        "what": "issue 15: SFT-only vs real vs rehearse vs hybrid RL from one SFT warm-up, matched "
                "optimizer steps; held-out eval by `fastrehearse eval` (real tools, greedy)",
        "tiny": a.tiny, "config": str(a.config), "extra_sets": a.sets, "hardware": hardware(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "wall_s_this_invocation": wall_s,
        "plan": {"arms": a.arms, "seeds": a.seeds, "steps_per_arm": a.steps, "n_eval": a.n_eval,
                 "light_eval": sorted(a.light_eval),
                 "warmup_sft_steps": cfg.sft.steps, "tasks_per_step": cfg.rollout.tasks_per_step,
                 "group_size": cfg.rollout.group_size, "rl_lr": cfg.optim.lr, "sft_lr": cfg.sft.lr,
                 "categories": categories(cfg), "drift": DRIFT, "estimate": estimate_s(a, cfg)},
        "warmup": {"run_dir": str(warm), "metrics": wm, "train_command": shell(pl["warmup"]["train"], a.threads),
                   "eval_commands": [shell(c, a.threads) for _, c in pl["warmup"]["evals"]]},
        "arms": arms, "versus_sft_only": versus_sft(arms), "missing": missing, "failures": failures,
    }


def _fmt(s: dict, pct: bool = True) -> str:
    if s["mean"] is None:
        return "missing"
    f = (lambda x: f"{100 * x:.1f}") if pct else (lambda x: f"{x:.2e}")
    sd = f" ± {f(s['std'])}" if s["std"] is not None else ""
    return f"{f(s['mean'])}{sd} (n={s['n_seeds']})"


def write_md(res: dict, path: Path) -> None:
    p = res["plan"]
    names = {"task_success": "task success %", "answer_success": "answer-checked %",
             "drift_success": "answer-checked under drift %", "heldout_success": "held-out family %",
             "fidelity_f1": "fidelity field F1 %"}
    lines = [f"# Learning experiment{' (TINY random model: pipeline check, not a result)' if res['tiny'] else ''}",
             "", f"{res['what']}.", "",
             f"Hardware: {res['hardware']['cpu']} ({res['hardware']['cpu_cores']} cores), torch "
             f"{res['hardware']['torch']}; {p['seeds']} seeds per arm, {p['steps_per_arm']} optimizer steps per "
             f"arm after {p['warmup_sft_steps']} warm-up SFT steps; {p['tasks_per_step']} tasks x {p['group_size']} "
             f"samples per RL step; n = {p['n_eval']} held-out tasks per metric; categories {p['categories']}; "
             f"drift {p['drift']}. Mean ± sample std over seeds."
             + (f" Light eval (clean categories only: no fidelity pass, no drift run) for "
                f"{', '.join(p['light_eval'])}: their drift / fidelity are missing, and those columns "
                f"average fewer seeds." if p.get("light_eval") else ""), "",
             "| arm | " + " | ".join(names.values()) + " | rel. weight change |",
             "|---|" + "---:|" * (len(names) + 1)]
    w = res["warmup"]["metrics"]
    lines.append("| warm-up (start of every arm) | " + " | ".join(
        ("no calls made" if k == "fidelity_f1" and w.get("fidelity_items") == 0 else "missing")
        if w.get(k) is None else f"{100 * w[k]:.1f}" for k in names) + " | 0 |")
    for arm, r in res["arms"].items():
        cells = [_fmt(r["summary"][k]) for k in names]
        if r["summary"]["fidelity_f1"]["n_seeds"] == 0 and all(
                s["metrics"].get("fidelity_items") == 0 for s in r["seeds"].values()):
            cells[-1] = "no calls made"   # nothing rehearsed to compare with a real response
        lines.append(f"| {arm} | " + " | ".join(cells)
                     + f" | {_fmt(r['summary']['weight_change'], pct=False)} |")
    same = [f"{arm} seed {seed}" for arm, r in res["arms"].items() for seed, sd in r["seeds"].items()
            if sd.get("weights_same_as_warmup")]
    if same:
        lines += ["", f"Weights byte for byte the warm-up's (sha256 of the export; no gradient reached "
                      f"them): {', '.join(same)}. Greedy evaluation is deterministic in the weights, so "
                      f"their numbers are the warm-up's eval, run once."]
    vs = res.get("versus_sft_only") or {}
    if vs:
        def cell(v: dict) -> str:
            d = "-" if v["delta"] is None else f"{100 * v['delta']:+.1f}"
            sp = "-" if v["spread"] is None else f"{100 * v['spread']:.1f}"
            return f"{d} ({sp}): {v['verdict']}"
        lines += ["", "## Against SFT-only (difference of seed means, percentage points)", "",
                  "An arm beats SFT-only when its difference exceeds the seed spread (the larger seed "
                  "std of the two arms).", "",
                  "| arm | " + " | ".join(f"Δ {names[k]} (spread): verdict" for k in VERSUS) + " |",
                  "|---|" + "---|" * len(VERSUS)]
        lines += [f"| {arm} | " + " | ".join(cell(v[k]) for k in VERSUS) + " |" for arm, v in vs.items()]
    sig = [(arm, seed, s["signal"]) for arm, r in res["arms"].items() for seed, s in r["seeds"].items()
           if s.get("signal", {}).get("rl_steps")]
    if sig:
        f = lambda x, pct=True: "-" if x is None else (f"{100 * x:.1f}" if pct else f"{x:.3f}")  # noqa: E731
        lines += ["", "## Training signal (each RL run's metrics.jsonl)", "",
                  "A GRPO group whose samples all got the same reward has zero advantage: no policy "
                  "gradient from it.", "",
                  "| arm | seed | RL steps | mean reward % | zero-signal groups % | mean rollout fidelity % |",
                  "|---|---:|---:|---:|---:|---:|"]
        lines += [f"| {arm} | {seed} | {g['rl_steps']} | {f(g['mean_reward'])} | {f(g['zero_signal_share'])} "
                  f"| {f(g['mean_rollout_fidelity'])} |" for arm, seed, g in sig]
    if res["missing"] or res["failures"]:
        lines += ["", "## Missing / failed (never counted as scores)", ""]
        lines += [f"- {m}" for m in res["missing"]] + [f"- rc {f['rc']}: `{f['command']}` (log {f['log']})"
                                                        for f in res["failures"]]
    lines += ["", "## Commands", "", "```", res["warmup"]["train_command"], *res["warmup"]["eval_commands"]]
    for r in res["arms"].values():
        for s in r["seeds"].values():
            lines += [s["train_command"], *s["eval_commands"]]
    lines += ["```", ""]
    path.write_text("\n".join(lines))


def write_png(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = list(res["arms"])
    keys = ["task_success", "answer_success", "drift_success", "heldout_success", "fidelity_f1"]
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    ax = axes[0]
    width = 0.8 / max(len(arms), 1)
    for i, arm in enumerate(arms):
        s = res["arms"][arm]["summary"]
        xs = [j + i * width for j in range(len(keys))]
        means = [100 * (s[k]["mean"] or 0.0) for k in keys]
        errs = [100 * (s[k]["std"] or 0.0) for k in keys]
        ax.bar(xs, means, width, yerr=errs, capsize=3, label=arm)
        for j, k in enumerate(keys):   # every seed as a dot: the spread is visible with 2 seeds
            vals = [sd["metrics"].get(k) for sd in res["arms"][arm]["seeds"].values()]
            ax.scatter([xs[j]] * sum(v is not None for v in vals), [100 * v for v in vals if v is not None],
                       color="k", s=8, zorder=3)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(keys))])
    ax.set_xticklabels(["task", "answer", "drift", "held-out\nfamily", "fidelity\nF1"])
    ax.set_ylabel("% (mean ± std over seeds; dots = seeds)")
    ax.set_title(f"held-out, n={res['plan']['n_eval']} per metric")
    ax.legend(fontsize=8)
    for ax, key, title in ((axes[1], "reward", "RL reward per step"),
                           (axes[2], "fidelity", "rollout fidelity (field F1) per step")):
        for arm in arms:
            for seed, s in res["arms"][arm]["seeds"].items():
                c = s["curves"]
                pts = [(st, v) for st, v in zip(c.get("step", []), c.get(key, [])) if v is not None]
                if pts:
                    ax.plot(*zip(*pts), marker=".", label=f"{arm} s{seed}")
        ax.set_xlabel("optimizer step")
        ax.set_title(title)
        if ax.lines:
            ax.legend(fontsize=7)
    fig.suptitle(("TINY random model (pipeline check) -- " if res["tiny"] else "")
                 + f"{res['hardware']['cpu']}, {res['plan']['steps_per_arm']} steps per arm")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(res: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps(res, indent=1, default=float))
    write_md(res, Path(f"{out}.md"))
    write_png(res, Path(f"{out}.png"))
    print(f"wrote {out}.json / .md / .png")


def main(argv=None) -> int:
    a = parse_args(argv)
    cfg = load_cfg(a.config, a.sets)
    pl = plan(a, cfg)
    est = estimate_s(a, cfg)
    jobs = [pl["warmup"], *pl["runs"].values()]
    print(f"plan: warm-up ({cfg.sft.steps} SFT steps) -> arms {a.arms} x {a.seeds} seeds x {a.steps} steps; "
          f"eval n={a.n_eval} per metric; {a.jobs} jobs x {a.threads} threads; run dirs under {a.runs}")
    if not a.tiny:   # the per-unit costs are SmolLM2's
        print(f"estimate: {est['core_s'] / 3600:.2f} core-hours, ~{est['wall_s'] / 3600:.2f} h wall ({est['how']})")
    print("commands (each train command is rerun with --resume after an interruption):")
    for j in jobs:
        print("  " + shell(j["train"], a.threads))
        for _, c in j["evals"]:
            print("  " + shell(c, a.threads))
    if a.dry_run:
        return 0
    failures: list = []
    t0 = time.perf_counter()
    if not a.report_only:
        train_then_eval(a, {**pl["warmup"], "evals": []}, failures)   # every arm starts from its export
        if not failures:   # the warm-up's own eval runs beside the arms
            with cf.ThreadPoolExecutor(max_workers=a.jobs) as ex:
                for f in [ex.submit(train_then_eval, a, j, failures) for j in [*pl["runs"].values(), pl["warmup"]]]:
                    f.result()
    res = report(a, cfg, pl, failures, None if a.report_only else time.perf_counter() - t0)
    write_outputs(res, a.out)
    for arm, r in res["arms"].items():
        print(f"{arm:9s} " + "  ".join(f"{k}={_fmt(r['summary'][k])}" for k in METRICS))
    if failures or res["missing"]:
        print(f"{len(failures)} command(s) failed, {len(res['missing'])} number(s) missing: see {a.out}.md")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
