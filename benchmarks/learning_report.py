"""The learning experiment's report (benchmarks/bench_learning.py): reads every run directory's own
files -- eval items.jsonl, teacher_forced*.json, metrics.jsonl, the export -- and writes per-item
results, per-seed and per-arm numbers, contrasts with 95% intervals (learning_stats.py), the
minimum detectable effect, the training signal of each RL run, and the JSON / MD / PNG.

Per checkpoint, per item (item ids are the same for every checkpoint, so contrasts are paired):
  answer_seen     answer-checked success, held-out tasks of the trained tool families (real tools)
  call_seen       the same episodes graded on the call alone (the builtin `calls` mode: the gold
                  call made and succeeded), rescored from the eval's transcripts
  answer_heldout  answer-checked success on the held-out family (its answers copy a response field)
  call_heldout    call success there
  answer_drift    answer-checked success under API drift (rename, errors, units, formats)
  tf_answer       log-prob (nats) of the gold final answer given the real responses (256 items)
  tf_answer_heldout  the same on the held-out family
  tf_value / tf_value_heldout  the same over the tokens that spell the answer's value only (the
                  answer's log-prob also pays for the gold phrasing, which RL moves away from)
  reh_schema / reh_echo / reh_hidden / reh_f1   teacher-forced rehearsal of the first gold call:
                  key paths, echoed arguments, hidden values, field F1 (seen families)
  reh_hidden_heldout  hidden values on the held-out family
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

import learning_stats as ls
from _common import hardware

METRICS = {   # key -> (label, kind): kind "rate" in [0, 1] shown in %, "nats" a log-prob
    "answer_seen": ("answer-checked, seen families", "rate"),
    "call_seen": ("call success, seen families", "rate"),
    "answer_heldout": ("answer-checked, held-out family", "rate"),
    "call_heldout": ("call success, held-out family", "rate"),
    "answer_drift": ("answer-checked under API drift", "rate"),
    "tf_answer": ("teacher-forced log p(gold answer), nats", "nats"),
    "tf_answer_heldout": ("teacher-forced log p(gold answer), held-out family", "nats"),
    "tf_value": ("teacher-forced log p(answer value tokens), nats", "nats"),
    "tf_value_heldout": ("teacher-forced log p(answer value tokens), held-out family", "nats"),
    "reh_schema": ("rehearsal: schema (key paths)", "rate"),
    "reh_echo": ("rehearsal: echoed arguments", "rate"),
    "reh_hidden": ("rehearsal: hidden values", "rate"),
    "reh_f1": ("rehearsal: field F1", "rate"),
    "reh_hidden_heldout": ("rehearsal: hidden values, held-out family", "rate"),
}
PRIMARY = [("Ca", "Cc", "answer_seen"), ("Ca", "R", "answer_seen")]
SECONDARY = [("Ca", "Cc", "reh_schema"), ("Ca", "Cc", "reh_hidden"), ("H", "Ca", "reh_hidden"),
             ("H", "Ca", "answer_seen"), ("R", "S", "answer_seen"), ("Ca", "S", "answer_seen"),
             ("Ca", "Cc", "call_heldout"), ("Ca", "Cc", "answer_heldout"), ("Ca", "Cc", "tf_answer"),
             ("Ca", "R", "tf_answer"), ("Ca", "Cc", "tf_value"), ("Ca", "R", "tf_value"),
             ("Ca", "Cc", "answer_drift"), ("Cag", "Ca", "answer_seen"), ("Cag", "Ca", "call_seen")]


# ---- reading one checkpoint --------------------------------------------------------------------
def _items(path: Path) -> list[dict]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    out = []
    for ln in lines:
        try:
            out.append(json.loads(ln))
        except ValueError:
            pass   # a line cut short by a kill
    return out


def _suite_tasks(category: str, n: int) -> dict:
    """The tasks of a builtin eval category 'test:LEVEL:TOOLS:answer', by id."""
    from fastrehearse.envs.builtin import BuiltinSuite
    split, level, tools, *_ = category.split(":")
    suite = BuiltinSuite(level=level, tools=tools, easy_answer=True)
    return suite, {t.id: t for t in suite.tasks(split, limit=n)}


def task_kinds(category: str, n: int) -> dict:
    """{item id: "first tool (answer kind)"} of a builtin eval category -- finer than the suite's
    tool families (calendar, shop, ...): the report splits answer success by kind, because one kind
    an arm never solves caps its mean (v3: RL arms 0 of 16 `list_events` counts, so 48 of 64 =
    75.0% was their ceiling)."""
    _, tasks = _suite_tasks(category, n)
    return {i: f"{t.payload['tools'][0]} ({t.payload['answer']['kind']})" for i, t in tasks.items()}


def _kind_sizes(kinds: dict) -> dict:
    return {k: sum(v == k for v in kinds.values()) for k in sorted(set(kinds.values()))}


def task_kind_table(res: dict) -> list[str]:
    """Markdown: items solved / items per task kind of the seen categories, warm-up and every seed."""
    kinds = res.get("task_kinds", {}).get("answer_seen")
    if not kinds:
        return []
    size = _kind_sizes(kinds)

    def row(label: str, items: dict) -> str:
        if set(items) != set(kinds):     # an incomplete eval is missing, never counted as 0 solved
            return f"| {label} | " + " | ".join("missing" for _ in size) + " |"
        got = {k: sum(v for i, v in items.items() if kinds[i] == k) for k in size}
        return f"| {label} | " + " | ".join(f"{got[k]:.0f}/{n}" for k, n in size.items()) + " |"
    out = ["", "## Answer-checked by task kind (first tool, answer kind; seen families; items solved / items)", "",
           "| run | " + " | ".join(size) + " |", "|---|" + "---:|" * len(size),
           row("warm-up", res["warmup"]["items"].get("answer_seen", {}))]
    for arm, r in res["arms"].items():
        out += [row(f"{arm}-s{seed}", s["items"].get("answer_seen", {})) for seed, s in r["seeds"].items()]
    return out


def unsolved_kinds(items: dict, kinds: dict) -> list[tuple[str, int]]:
    """[(kind, n items)] of the task kinds where not one item is solved: an RL arm sampling from
    this model gets (almost) no reward there, so they cap its success at the other kinds' share."""
    solved = {kinds[i] for i, v in items.items() if v > 0 and i in kinds}
    return [(k, n) for k, n in _kind_sizes(kinds).items() if k not in solved]


def call_success(suite, task, transcript: list[dict]) -> float:
    """The builtin `calls` score (gold call made and succeeded, replayed on the real world) of an
    eval transcript: its assistant texts are re-parsed with the task's tool schemas, as the engine
    parsed them."""
    from fastrehearse.envs.base import Trajectory
    from fastrehearse.envs.builtin.tools import SCHEMAS
    from fastrehearse.rollout.text.toolcall import parse_tool_calls
    schemas = [SCHEMAS[t] for t in task.payload["tools"]]
    msgs = []
    for m in transcript:
        if m.get("role") != "assistant":
            continue
        calls = [c.call for c in parse_tool_calls(m.get("content") or "", schemas).calls if c.ok]
        msgs.append({"role": "assistant", "content": m.get("content") or "",
                     "tool_calls": [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                    for c in calls]})
    return suite.task_reward(task, Trajectory(messages=msgs), "calls")


def read_checkpoint(a, cfg, run_dir: Path, cats: dict) -> tuple[dict, list[str]]:
    """{metric: {item_id: value}} of one checkpoint from its own files, and what is missing."""
    out: dict[str, dict] = {k: {} for k in METRICS}
    missing = []
    for key, cat in (("seen", cats["seen"]), ("heldout", cats["heldout"])):
        rows = [r for r in _items(run_dir / "eval" / "items.jsonl") if r.get("category") == cat]
        ok = [r for r in rows if r.get("error") is None and r.get("score") is not None]
        if len(ok) != a.n_eval:
            missing.append(f"{run_dir}/eval: {cat} has {len(ok)} scored items of {a.n_eval}")
            continue
        suite, tasks = _suite_tasks(cat, a.n_eval)
        for r in ok:
            out[f"answer_{key}"][r["id"]] = float(r["score"])
            tr = (r.get("extra") or {}).get("transcript")
            if tr is None or r["id"] not in tasks:
                missing.append(f"{run_dir}/eval: {r['id']} has no transcript to rescore the call")
                continue
            out[f"call_{key}"][r["id"]] = call_success(suite, tasks[r["id"]], tr)
    if not a.no_drift:
        rows = [r for r in _items(run_dir / "eval_drift" / "items.jsonl") if r.get("category") == cats["seen"]]
        ok = [r for r in rows if r.get("error") is None and r.get("score") is not None]
        if len(ok) == a.n_eval:
            out["answer_drift"] = {r["id"]: float(r["score"]) for r in ok}
        else:
            missing.append(f"{run_dir}/eval_drift: {len(ok)} scored items of {a.n_eval}")
    for name, suffix, n in (("teacher_forced.json", "", a.n_tf), ("teacher_forced_heldout.json", "_heldout", a.n_eval)):
        try:
            tf = json.loads((run_dir / name).read_text())
        except (OSError, ValueError):
            missing.append(f"{run_dir}/{name}: not written")
            continue
        if len(tf["logprob_items"]) != n or len(tf["rehearsal_items"]) != a.n_rehearsal:
            missing.append(f"{run_dir}/{name}: {len(tf['logprob_items'])} / {len(tf['rehearsal_items'])} items")
            continue
        out[f"tf_answer{suffix}"] = {r["id"]: r["answer_logprob"] for r in tf["logprob_items"]}
        out[f"tf_value{suffix}"] = {r["id"]: r["value_logprob"] for r in tf["logprob_items"]
                                    if r.get("value_logprob") is not None}
        for r in tf["rehearsal_items"]:
            if suffix:
                if r.get("hidden") is not None:
                    out["reh_hidden_heldout"][r["id"]] = r["hidden"]
                continue
            for k in ("schema", "echo", "hidden"):
                if r.get(k) is not None:
                    out[f"reh_{k}"][r["id"]] = r[k]
            out["reh_f1"][r["id"]] = r["field_f1"]
    return out, missing


def curves(run_dir: Path) -> dict:
    keys = ("reward", "reward_real", "world_reward", "world_format", "world_grounded", "fidelity",
            "zero_signal_groups", "real_stratum_frac", "malformed_frac", "loss", "episodes")
    out = {"step": [], "stage": [], **{k: [] for k in keys}}
    rows: dict[int, dict] = {}
    for r in _items(run_dir / "metrics.jsonl"):
        if "step" in r:       # a run resumed from an earlier checkpoint rewrites later steps: last wins
            rows[r["step"]] = r
    for r in (rows[s] for s in sorted(rows)):
        out["step"].append(r["step"])
        out["stage"].append(r.get("stage"))
        for k in keys:
            out[k].append(r.get(k))
    return out


def training_signal(c: dict) -> dict:
    """What the RL steps had to learn from: mean trained reward, mean real-world reward, the share
    of groups with zero ACT advantage, steps with at least one group carrying signal."""
    rl = [i for i, st in enumerate(c.get("stage", [])) if st == "rl"]

    def mean(key):
        v = [c[key][i] for i in rl if c[key][i] is not None]
        return sum(v) / len(v) if v else None
    z = [c["zero_signal_groups"][i] for i in rl if c["zero_signal_groups"][i] is not None]
    return {"rl_steps": len(rl), "mean_reward": mean("reward"), "mean_reward_real": mean("reward_real"),
            "mean_world_reward": mean("world_reward"), "zero_signal_share": sum(z) / len(z) if z else None,
            "steps_with_signal": sum(1 for x in z if x < 1.0), "mean_rollout_fidelity": mean("fidelity")}


def weight_change(export: Path, ref: Path) -> float | None:
    """||W - W_warmup|| / ||W_warmup|| over every stored tensor (float64)."""
    from safetensors.torch import load_file
    try:
        x = {k: v for f in sorted(export.glob("*.safetensors")) for k, v in load_file(f).items()}
        y = {k: v for f in sorted(ref.glob("*.safetensors")) for k, v in load_file(f).items()}
    except (OSError, ValueError):
        return None
    if not x or x.keys() != y.keys():
        return None
    num = sum(float((x[k].double() - y[k].double()).pow(2).sum()) for k in x)
    den = sum(float(y[k].double().pow(2).sum()) for k in y)
    return math.sqrt(num / den) if den > 0 else None


def _mean(d: dict) -> float | None:
    return sum(d.values()) / len(d) if d else None


def summary(xs: list) -> dict:
    v = [x for x in xs if x is not None]
    if not v:
        return {"mean": None, "std": None, "n_seeds": 0, "seeds": []}
    m = sum(v) / len(v)
    sd = math.sqrt(sum((x - m) ** 2 for x in v) / (len(v) - 1)) if len(v) > 1 else None
    return {"mean": m, "std": sd, "n_seeds": len(v), "seeds": v}


def contrast(arms: dict, a: str, b: str, metric: str) -> dict | None:
    """A - B on `metric`: the permutation test over seed labels (primary), Welch over seed means,
    paired bootstrap over seeds and items, the MDE."""
    if a not in arms or b not in arms:
        return None
    A = {s: r["items"][metric] for s, r in arms[a]["seeds"].items() if r["items"].get(metric)}
    B = {s: r["items"][metric] for s, r in arms[b]["seeds"].items() if r["items"].get(metric)}
    if not A or not B:
        return {"a": a, "b": b, "metric": metric, "missing": True}
    w = ls.welch([_mean(v) for v in A.values()], [_mean(v) for v in B.values()])
    try:
        bs = ls.bootstrap(A, B)
    except ValueError:
        bs = None
    perm = ls.permutation_test([_mean(v) for v in A.values()], [_mean(v) for v in B.values()])
    return {"a": a, "b": b, "metric": metric, "n_seeds": [len(A), len(B)], "permutation": perm, "welch": w,
            "bootstrap": bs, "mde": ls.mde([_mean(v) for v in A.values()], [_mean(v) for v in B.values()])}


# ---- seeds kept from an earlier report (--prior) -------------------------------------------------
# Run directories hold the weights (~0.5 GB each) and are not committed, so a later session would
# have to retrain every earlier seed to add one more. An earlier report keeps, per arm and seed,
# everything the report reads (per-item results, curves, signal, weight change); --prior reuses
# those records when the earlier run had the same plan and started from the same warm-up.
PLAN_KEYS = ("steps_per_arm", "n_eval", "n_tf", "n_rehearsal", "warmup_sft_steps", "tasks_per_step",
             "group_size", "lr", "min_lr_ratio", "categories", "drift")
LOGPROB_TOL = 1e-3   # nats: two runs of the teacher-forced pass on one warm-up differ by ~5e-5


def plan_of(a, cfg) -> dict:
    from bench_learning import categories
    return {"tiny": a.tiny, "config": str(a.config), "level": a.level, "extra_sets": list(a.sets),
            "steps_per_arm": a.steps, "n_eval": a.n_eval, "n_tf": a.n_tf, "n_rehearsal": a.n_rehearsal,
            "warmup_sft_steps": cfg.sft.steps, "tasks_per_step": cfg.rollout.tasks_per_step,
            "group_size": cfg.rollout.group_size, "lr": cfg.optim.lr, "min_lr_ratio": cfg.optim.min_lr_ratio,
            "categories": categories(a, cfg), "drift": None if a.no_drift else "rename,errors,units,formats"}


def same_sets(a: list[str], b: list[str]) -> bool:
    """Two lists of --set overrides configure the same run (a key written at its old path, read
    at its new one, included)."""
    from fastrehearse.train.config import TrainConfig, apply_override, to_dict

    def applied(sets):
        cfg = TrainConfig()
        for s in sets:
            apply_override(cfg, s, notify=None)
        return to_dict(cfg)
    return applied(a) == applied(b)


def load_priors(a, cfg, paths: list) -> dict:
    """{(arm, seed): {"record", "source", "time", "warmup"}} of the planned runs an earlier report
    holds. ValueError (one line, naming the file and the setting) when a file is unreadable or was
    run with another plan, when an arm's --set overrides changed, or when two files hold one run."""
    from bench_learning import ARM_SETS
    want = plan_of(a, cfg)
    out: dict = {}
    for path in paths:
        try:
            r = json.loads(Path(path).read_text())
            have = {"tiny": r["tiny"], "config": r["config"], "level": r["level"], "extra_sets": r["extra_sets"],
                    **{k: r["plan"][k] for k in PLAN_KEYS}}
            arms, warm = r["arms"], r["warmup"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"--prior {path}: not a learning_v2 report ({type(e).__name__}: {e})") from None
        diff = [k for k in want if have[k] != want[k]]
        if diff:
            k = diff[0]
            raise ValueError(f"--prior {path}: run with {k}={have[k]!r}, this run has {k}={want[k]!r}")
        for arm, rec in arms.items():
            if arm not in a.seeds:
                continue
            if not same_sets(rec.get("sets") or [], ARM_SETS[arm]):
                raise ValueError(f"--prior {path}: arm {arm} was run with --set {rec.get('sets')}, "
                                 f"now {ARM_SETS[arm]}")
            for seed, srec in rec["seeds"].items():
                if int(seed) >= a.seeds[arm]:
                    continue
                if (arm, int(seed)) in out:
                    raise ValueError(f"--prior {path}: {arm} seed {seed} is also in {out[(arm, int(seed))]['source']}")
                out[(arm, int(seed))] = {"record": srec, "source": str(path), "time": r.get("time"),
                                         "warmup": warm}
    return out


def same_warmup(prior_warm: dict, items: dict, sha: str | None, metrics: dict = METRICS) -> str | None:
    """None when an earlier report's warm-up is this run's, else why not. Weights by sha256 when
    both reports have it; else every success / fidelity item equal and log-probs within LOGPROB_TOL
    (`metrics`: the design's {key: (label, kind)})."""
    if sha and prior_warm.get("weights_sha256"):
        return None if sha == prior_warm["weights_sha256"] else "warm-up weights differ (sha256)"
    for k, (_, kind) in metrics.items():
        p, q = prior_warm["items"].get(k, {}), items.get(k, {})
        if p.keys() != q.keys():
            return f"warm-up {k}: other items"
        if kind == "nats":
            worst = max((abs(p[i] - q[i]) for i in p), default=0.0)
            if worst > LOGPROB_TOL:
                return f"warm-up {k} differs by {worst:.2g} nats"
        elif p != q:
            return f"warm-up {k}: {sum(p[i] != q[i] for i in p)} items differ"
    return None


def read_arms(a, pl: dict, read, metrics: dict, priors: dict | None,
              extra=lambda run_dir: {}) -> tuple[dict, dict, str | None, list[str]]:
    """(arms, warm-up items, warm-up weights sha256, missing) of a plan, any design: every planned
    arm and seed read from its own run dir by `read(run_dir) -> (items, missing)` (a run whose
    weights equal the warm-up's is read from the warm-up), or kept from --prior when its warm-up is
    this one; `metrics` the design's {key: (label, kind)}; `extra(run_dir)` adds design-specific
    per-seed fields."""
    from bench_learning import ARM_NAMES, ARM_SETS, _sha_of, same_as_warmup, shell
    warm = pl["warmup"]["run_dir"]
    w_items, missing = read(warm)
    w_sha = _sha_of(warm / "export") if list((warm / "export").glob("*.safetensors")) else None
    priors = priors or {}
    arms = {}
    for arm in a.arms:
        seeds = {}
        for seed in range(a.seeds[arm]):
            job = pl["runs"][(arm, seed)]
            d = job["run_dir"]
            prior = priors.get((arm, seed))
            if prior is not None:
                why = same_warmup(prior["warmup"], w_items, w_sha, metrics)
                if why:
                    missing.append(f"{arm}-s{seed}: kept in {prior['source']} but not usable: {why}")
                else:
                    seeds[str(seed)] = {**prior["record"],   # a record kept twice names where it was run
                                        "kept_from": prior["record"].get("kept_from") or f"{prior['source']} ({prior['time']})"}
                continue
            shared = same_as_warmup(d, warm) if (d / "export").exists() else None
            items, miss = read(warm if shared else d)
            missing += miss
            cv = curves(d)
            seeds[str(seed)] = {"run_dir": str(d), "items": items,
                                "metrics": {k: _mean(v) for k, v in items.items()},
                                "weights_same_as_warmup": shared,
                                "weight_change": weight_change(d / "export", warm / "export"),
                                "curves": cv, "signal": training_signal(cv), **extra(d),
                                "train_command": shell(job["train"], a.threads),
                                "eval_commands": [shell(c, a.threads) for _, _, c in job["evals"]]}
        summ = {k: summary([s["metrics"][k] for s in seeds.values()]) for k in metrics}
        summ["weight_change"] = summary([s["weight_change"] for s in seeds.values()])
        arms[arm] = {"name": ARM_NAMES[arm], "sets": ARM_SETS[arm], "seeds": seeds, "summary": summ}
    return arms, w_items, w_sha, missing


# ---- the report --------------------------------------------------------------------------------
def report(a, cfg, pl: dict, failures: list, wall_s: float | None, est: dict, priors: dict | None = None) -> dict:
    """`priors`: the runs kept from --prior (bench_learning.main: planned, in an earlier report, no
    finished run dir here), each used when its warm-up is this one, else listed as missing."""
    from bench_learning import shell
    pk = plan_of(a, cfg)
    cats = pk["categories"]
    warm = pl["warmup"]["run_dir"]
    arms, w_items, w_sha, missing = read_arms(a, pl, lambda d: read_checkpoint(a, cfg, d, cats), METRICS, priors)
    contrasts = {"primary": [c for c in (contrast(arms, *x) for x in PRIMARY) if c],
                 "secondary": [c for c in (contrast(arms, *x) for x in SECONDARY) if c],
                 "answer_seen_all_pairs": [c for c in (contrast(arms, x, y, "answer_seen")
                                                       for i, x in enumerate(a.arms) for y in a.arms[i + 1:]) if c]}
    ca = arms.get("Ca", {}).get("seeds", {})
    sig = [s["signal"] for s in ca.values() if s["signal"]["rl_steps"]]
    judged = None
    if sig:
        r = [x["mean_reward"] for x in sig if x["mean_reward"] is not None]
        mr = sum(r) / len(r) if r else None
        judged = {"mean_reward": mr, "in_open_interval": mr is not None and 0.05 < mr < 0.95,
                  "steps_with_nonzero_advantage_groups": sum(x["steps_with_signal"] for x in sig),
                  "rl_steps": sum(x["rl_steps"] for x in sig)}
    return {
        "what": "issue 25: rehearsal with a reward computable inside the rehearsed world (Ca) vs "
                "real-environment GRPO (R), the calls-only control (Cc), hybrid with a grounded "
                "world-model reward (H) and SFT-only (S), from one SFT warm-up, matched steps / lr / "
                "trajectories per step; held-out eval by `fastrehearse eval` (real tools, greedy) and "
                "fastrehearse.eval.teacher_forced",
        **{k: pk[k] for k in ("tiny", "config", "level", "extra_sets")},   # what --prior compares
        "hardware": hardware(), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "wall_s_this_invocation": wall_s,
        "plan": {"arms": a.arms, "seeds": a.seeds, **{k: pk[k] for k in PLAN_KEYS}, "estimate": est},
        "metrics": {k: v[0] for k, v in METRICS.items()},
        "prior": sorted({p["source"] for p in (priors or {}).values()}),
        "warmup": {"run_dir": str(warm), "weights_sha256": w_sha, "items": w_items, "metrics": {k: _mean(v) for k, v in w_items.items()},
                   "train_command": shell(pl["warmup"]["train"], a.threads),
                   "eval_commands": [shell(c, a.threads) for _, _, c in pl["warmup"]["evals"]]},
        "task_kinds": {"answer_seen": task_kinds(cats["seen"], a.n_eval)},
        "arms": arms, "contrasts": contrasts, "consistent_arm_signal": judged,
        "missing": missing, "failures": failures,
    }


def pilot_verdict(a, cfg, pl: dict, failures: list, window: tuple[float, float]) -> int:
    from bench_learning import categories
    if failures:
        print(f"pilot: {len(failures)} command(s) failed: {failures}")
        return 1
    items, missing = read_checkpoint(a, cfg, pl["warmup"]["run_dir"], categories(a, cfg))
    ans = _mean(items["answer_seen"])
    if ans is None:
        print(f"pilot: the warm-up's answer-checked success is missing: {missing}")
        return 1
    ok = window[0] <= ans <= window[1]
    print(f"pilot: warm-up answer-checked success {100 * ans:.1f}% on {len(items['answer_seen'])} held-out tasks "
          f"of {a.level} (call success {100 * (_mean(items['call_seen']) or 0):.1f}%); window "
          f"{100 * window[0]:.0f}-{100 * window[1]:.0f}%: {'inside, run the arms' if ok else 'OUTSIDE: pick another level'}")
    cold = unsolved_kinds(items["answer_seen"], task_kinds(categories(a, cfg)["seen"], a.n_eval))
    if cold:    # a warning, not a verdict: S can still learn them from gold; the RL arms likely cannot
        k = sum(n for _, n in cold)
        print(f"pilot: WARNING: the warm-up solves no item of {', '.join(f'{f} ({n} items)' for f, n in cold)}: "
              f"RL arms get no reward there from their own rollouts, so {100 * (1 - k / len(items['answer_seen'])):.1f}% "
              f"is likely their ceiling (v3: no RL seed learned such a task kind); report them apart or change the level")
    return 0 if ok else 3


# ---- v4: the pre-registered decision (docs/learning.md, "v4 pre-registration") -------------
V4_TESTS = (("P1", "Ca", "Cv", "the rehearsed world's content helps (beyond its format)"),
            ("P2", "Ca", "Sr", "RL adds to SFT on the same consistent rehearsals"))


def v4_decision(seeds: dict[str, list[float]], warmup: float, planned_mde: dict[str, float],
                alpha: float = 0.05) -> dict:
    """The v4 rule on per-seed primary success (fractions): P1 = Ca - Cv and P2 = Ca - Sr by the
    exact permutation test over seed labels, Holm over the two (the smaller p against alpha / 2,
    then the other against alpha); Welch intervals secondary; the recovery ratio
    (Ca - W) / (R - W) with its Fieller interval, read against 0.5. An arm short of its
    pre-registered minimum seeds makes the whole report "incomplete: no verdict" (numbers kept).
    `planned_mde`: {"P1": ..., "P2": ...} fixed by the pilot before the runs."""
    from bench_learning import V4   # the pre-registered minimum seeds, where the plan takes them
    short = {arm: (len(seeds.get(arm, [])), n) for arm, n in V4["seeds"].items() if len(seeds.get(arm, [])) < n}
    tests = {}
    for name, a, b, claim in V4_TESTS:
        if len(seeds.get(a, [])) < 2 or len(seeds.get(b, [])) < 2:
            tests[name] = {"a": a, "b": b, "claim": claim, "p": None, "why": "fewer than 2 seeds in an arm"}
            continue
        perm = ls.permutation_test(seeds[a], seeds[b])
        tests[name] = {"a": a, "b": b, "claim": claim, "diff": perm["diff"], "p": perm["p"],
                       "exact": perm["exact"], "n_labelings": perm["n_labelings"],
                       "welch": ls.welch(seeds[a], seeds[b]), "planned_mde": planned_mde.get(name)}
    ranked = sorted((t for t in tests.values() if t["p"] is not None), key=lambda t: t["p"])
    still = True
    for i, t in enumerate(ranked):          # Holm: step down, stop at the first failure
        t["holm_alpha"] = alpha / (len(ranked) - i)
        t["significant"] = still and t["p"] <= t["holm_alpha"]
        still = t["significant"]
    for name, t in tests.items():
        if t["p"] is None:
            t["verdict"] = "not tested: " + t["why"]
        elif t["significant"]:
            t["verdict"] = t["claim"] if t["diff"] > 0 else f"significantly NEGATIVE: {t['a']} below {t['b']}"
        else:
            mde = t["planned_mde"]
            below = mde is not None and abs(t["diff"]) < mde
            t["verdict"] = (f"not shown ({t['a']} - {t['b']} = {100 * t['diff']:+.1f} pp"
                            + (f", below this run's resolution (planned MDE {100 * mde:.1f} pp)" if below else
                               f", planned MDE {100 * mde:.1f} pp" if mde is not None else "") + ")")
    rho = None
    if len(seeds.get("Ca", [])) >= 2 and len(seeds.get("R", [])) >= 2:
        rho = ls.recovery_ratio(seeds["Ca"], seeds["R"], [warmup])
        if rho["lo"] is None:
            rho["verdict"] = "no statement about rho (" + rho["why"] + ")"
        elif rho["lo"] > 0.5:
            rho["verdict"] = "Ca recovers most of R's gain"
        elif rho["hi"] < 0.5:
            rho["verdict"] = "Ca recovers less than half of R's gain"
        else:
            rho["verdict"] = "undetermined"
    return {"complete": not short, "short_arms": short, "tests": tests, "recovery": rho,
            "verdict": "incomplete: no verdict" if short else
                       "; ".join(f"{n}: {t['verdict']}" for n, t in tests.items())
                       + (f"; recovery: {rho['verdict']}" if rho else "")}


# ---- outputs -----------------------------------------------------------------------------------
def _cell(s: dict, kind: str) -> str:
    if s["mean"] is None:
        return "missing"
    f = (lambda x: f"{100 * x:.1f}") if kind == "rate" else (lambda x: f"{x:.2f}")
    sd = f" ± {f(s['std'])}" if s["std"] is not None else ""
    return f"{f(s['mean'])}{sd}"


def _ci(c: dict, kind: str) -> str:
    if c.get("missing"):
        return "missing | - | - | - | -"
    f = (lambda x: f"{100 * x:+.1f}") if kind == "rate" else (lambda x: f"{x:+.2f}")
    w, b = c["welch"], c["bootstrap"]
    wt = f"[{f(w['lo'])}, {f(w['hi'])}]" if w["lo"] is not None else f"n/a ({w.get('why', '< 2 seeds')})"
    bt = f"[{f(b['lo'])}, {f(b['hi'])}]" if b else "n/a"
    mde = "-" if c["mde"] is None else (f"{100 * c['mde']:.1f}" if kind == "rate" else f"{c['mde']:.2f}")
    perm = c.get("permutation")   # absent in records written before the permutation test
    pt = "-" if perm is None else f"{perm['p']:.3f}" + ("" if perm["exact"] else " (MC)")
    return f"{f(w['diff'])} | {pt} | {wt} | {bt} | {mde}"


def md_tail(res: dict) -> list[str]:
    """The report's closing lines, any design: runs kept from --prior, what is missing or failed,
    where the per-item records are, and every command that produced a number."""
    lines: list[str] = []
    kept = [(f"{arm}-s{seed}", s["kept_from"]) for arm, r in res["arms"].items() for seed, s in r["seeds"].items()
            if s.get("kept_from")]
    if kept:
        lines += ["", "Kept from an earlier report of the same plan and warm-up (`--prior`; their run dirs were "
                      "not here, so their records were reused, not retrained): "
                  + "; ".join(f"{k} from {src}" for k, src in kept) + "."]
    if res["missing"] or res["failures"]:
        lines += ["", "## Missing / failed (never counted as scores)", ""]
        lines += [f"- {m}" for m in res["missing"]] + [f"- rc {f['rc']}: `{f['command']}` (log {f['log']})"
                                                        for f in res["failures"]]
    lines += ["", "Per-item results: the JSON's `warmup.items` and `arms.<arm>.seeds.<seed>.items` ({metric: "
                  "{item id: value}}).", "", "## Commands", "", "```", res["warmup"]["train_command"],
              *res["warmup"]["eval_commands"]]
    for r in res["arms"].values():
        for s in r["seeds"].values():
            lines += [s["train_command"], *s["eval_commands"]]
    lines += ["```", ""]
    return lines


def write_md(res: dict, path: Path) -> None:
    p = res["plan"]
    if p.get("drift") is None:     # --no-drift: not run, so no column (never a row of "missing")
        res = {**res, "metrics": {k: v for k, v in res["metrics"].items() if k != "answer_drift"},
               "contrasts": {k: [c for c in v if c["metric"] != "answer_drift"] for k, v in res["contrasts"].items()}}
    tiny = " (TINY random model: pipeline check, not a result)" if res["tiny"] else ""
    lines = [f"# Learning experiment {path.stem}{tiny}", "", f"{res['what']}.", "",
             f"Hardware: {res['hardware']['cpu']} ({res['hardware']['cpu_cores']} cores, shared), torch "
             f"{res['hardware']['torch']}. Level `{res['level']}`; seeds {p['seeds']}; {p['steps_per_arm']} "
             f"optimizer steps per arm after {p['warmup_sft_steps']} warm-up SFT steps; {p['tasks_per_step']} tasks x "
             f"{p['group_size']} samples per RL step (S: as many gold trajectories per step); lr {p['lr']} constant "
             f"(min_lr_ratio {p['min_lr_ratio']}); n = {p['n_eval']} held-out tasks per success metric, "
             f"{p['n_tf']} for the teacher-forced log-prob, {p['n_rehearsal']} for the rehearsal split; "
             f"categories {p['categories']}.", "",
             "## Arms (mean ± sample std over seeds; rates in %, log-probs in nats per answer)", "",
             "| arm | seeds | " + " | ".join(res["metrics"].values()) + " | rel. weight change |",
             "|---|---:|" + "---:|" * (len(res["metrics"]) + 1)]
    w = res["warmup"]["metrics"]
    kinds = {k: ("nats" if k.startswith("tf_") else "rate") for k in res["metrics"]}
    lines.append("| warm-up (start) | 1 | " + " | ".join(
        "missing" if w.get(k) is None else (f"{100 * w[k]:.1f}" if kinds[k] == "rate" else f"{w[k]:.2f}")
        for k in res["metrics"]) + " | 0 |")
    for arm, r in res["arms"].items():
        wc = r["summary"]["weight_change"]["mean"]
        wc = "missing" if wc is None else f"{wc:.2e}"
        lines.append(f"| {arm}: {r['name']} | {r['summary']['answer_seen']['n_seeds']} | "
                     + " | ".join(_cell(r["summary"][k], kinds[k]) for k in res["metrics"]) + f" | {wc} |")
    head = ["| contrast | metric | difference | permutation p (seed labels) | Welch 95% CI (seeds) | "
            "bootstrap 95% CI (seeds x items) | MDE (80% power) |",
            "|---|---|---:|---:|---|---|---:|"]

    def rows(cs):
        return [f"| {c['a']} - {c['b']} | {res['metrics'][c['metric']]} | {_ci(c, kinds[c['metric']])} |" for c in cs]
    lines += ["", "## Primary contrasts (percentage points on real-environment answer success)", "", *head,
              *rows(res["contrasts"]["primary"]), "", "## Secondary contrasts", "", *head,
              *rows(res["contrasts"]["secondary"]), "", "## Every pair of arms, answer-checked (seen families)", "",
              *head, *rows(res["contrasts"]["answer_seen_all_pairs"])]
    js = res.get("consistent_arm_signal")
    if js:
        lines += ["", f"Consistent arm (Ca) training signal: mean rollout reward {100 * js['mean_reward']:.1f}% "
                      f"(strictly inside 5-95%: {js['in_open_interval']}); {js['steps_with_nonzero_advantage_groups']} "
                      f"of {js['rl_steps']} RL steps had groups with non-zero advantage."]
    sig = [(arm, seed, s["signal"]) for arm, r in res["arms"].items() for seed, s in r["seeds"].items()
           if s["signal"]["rl_steps"]]
    if sig:
        f = lambda x: "-" if x is None else f"{100 * x:.1f}"  # noqa: E731
        lines += ["", "## Training signal (each RL run's metrics.jsonl)", "",
                  "reward = the trained reward; real = the engine's real-world score of the same episodes; "
                  "zero-signal = share of groups whose ACT advantages are all 0.", "",
                  "| arm | seed | RL steps | reward % | real reward % | world reward % | zero-signal groups % | "
                  "steps with signal | rollout fidelity % |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        lines += [f"| {arm} | {seed} | {g['rl_steps']} | {f(g['mean_reward'])} | {f(g['mean_reward_real'])} | "
                  f"{f(g['mean_world_reward'])} | {f(g['zero_signal_share'])} | {g['steps_with_signal']} | "
                  f"{f(g['mean_rollout_fidelity'])} |" for arm, seed, g in sig]
    lines += task_kind_table(res)
    lines += ["", "## Per seed (answer-checked seen / held-out call / held-out answer / rehearsal hidden, %)", ""]
    for arm, r in res["arms"].items():
        cells = []
        for seed, s in r["seeds"].items():
            m = s["metrics"]
            cells.append(f"s{seed}: " + " / ".join("-" if m.get(k) is None else f"{100 * m[k]:.1f}"
                                                   for k in ("answer_seen", "call_heldout", "answer_heldout", "reh_hidden")))
        lines.append(f"- {arm}: " + "; ".join(cells))
    lines += md_tail(res)
    path.write_text("\n".join(lines))


def write_png(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = list(res["arms"])
    fig, axes = plt.subplots(2, 2, figsize=(16, 10))
    keys = ["answer_seen", "call_seen", "answer_heldout", "call_heldout", "answer_drift", "reh_schema", "reh_hidden"]
    ax = axes[0][0]
    width = 0.8 / max(len(arms) + 1, 1)
    for i, arm in enumerate(["warm-up", *arms]):
        if arm == "warm-up":
            vals = [[res["warmup"]["metrics"].get(k)] for k in keys]
        else:
            vals = [[s["metrics"].get(k) for s in res["arms"][arm]["seeds"].values()] for k in keys]
        xs = [j + i * width for j in range(len(keys))]
        means = [100 * sum(v for v in vs if v is not None) / max(1, sum(v is not None for v in vs)) for vs in vals]
        ax.bar(xs, means, width, label=arm, alpha=0.8)
        for x, vs in zip(xs, vals):
            pts = [100 * v for v in vs if v is not None]
            ax.scatter([x] * len(pts), pts, color="k", s=7, zorder=3)
    ax.set_xticks([j + 0.4 for j in range(len(keys))])
    ax.set_xticklabels(["answer\nseen", "call\nseen", "answer\nheld-out", "call\nheld-out", "answer\ndrift",
                        "rehearsal\nschema", "rehearsal\nhidden"], fontsize=8)
    ax.set_ylabel("% (bars: mean over seeds; dots: seeds)")
    ax.set_title(f"held-out eval, n={res['plan']['n_eval']} per success metric")
    ax.legend(fontsize=7)
    ax = axes[0][1]
    cs = [c for c in res["contrasts"]["primary"] + res["contrasts"]["secondary"]
          if not c.get("missing") and not c["metric"].startswith("tf_")]
    for y, c in enumerate(cs):
        w, b = c["welch"], c["bootstrap"]
        if w["lo"] is not None:
            ax.plot([100 * w["lo"], 100 * w["hi"]], [y + 0.12] * 2, color="C0", lw=2)
        if b:
            ax.plot([100 * b["lo"], 100 * b["hi"]], [y - 0.12] * 2, color="C1", lw=2)
        ax.plot([100 * w["diff"]], [y], "ko", ms=4)
    ax.axvline(0, color="grey", lw=0.8)
    # A difference of two rates lies in [-100, 100] pp; a 2-seed Welch interval can reach +-300 and
    # would squash every other bar, so the axis stops there (the JSON / MD hold the full interval).
    ax.set_xlim(-105, 105)
    ax.set_yticks(range(len(cs)))
    ax.set_yticklabels([f"{c['a']}-{c['b']} {c['metric']}" for c in cs], fontsize=7)
    ax.set_xlabel("difference, percentage points (blue: Welch 95% CI over seeds; orange: bootstrap; "
                  "axis cut at +-105)", fontsize=8)
    ax.set_title("contrasts")
    for ax, key, title in ((axes[1][0], "reward", "trained reward per RL step (mean over seeds)"),
                           (axes[1][1], "reward_real", "real-world reward of the same rollouts")):
        for arm in arms:
            per_step: dict[int, list] = {}
            for s in res["arms"][arm]["seeds"].values():
                c = s["curves"]
                for st, stage, v in zip(c.get("step", []), c.get("stage", []), c.get(key, [])):
                    if stage == "rl" and v is not None:
                        per_step.setdefault(st, []).append(v)
            if per_step:
                xs = sorted(per_step)
                ax.plot(xs, [sum(per_step[x]) / len(per_step[x]) for x in xs], marker=".", label=arm)
        ax.set_xlabel("optimizer step")
        ax.set_title(title)
        if ax.lines:
            ax.legend(fontsize=8)
    fig.suptitle(("TINY random model (pipeline check) -- " if res["tiny"] else "")
                 + f"{path.stem}, {res['hardware']['cpu']}, {res['plan']['steps_per_arm']} steps per arm")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_outputs(res: dict, out: Path, md=None, png=None) -> None:
    """OUT.json / .md / .png; `md` / `png`: the design's writers (default v2/v3's)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps(res, indent=1, default=float))
    (md or write_md)(res, Path(f"{out}.md"))
    (png or write_png)(res, Path(f"{out}.png"))
    print(f"wrote {out}.json / .md / .png")
