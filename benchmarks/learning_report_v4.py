"""The v4 learning experiment's report (docs/learning.md, "v4 pre-registration"): reads each run
directory's own files, computes what the pre-registration names and checks the run against its rule
(`learning_report.v4_decision`). Written by `bench_learning.py --design v4 --warmup K`.

Per checkpoint, per item (the ids are the same for every checkpoint, so arms are paired by item):
  primary          answer-checked real-tool success on the primary rules items (eval/items.jsonl)
  mixed            the same on test:mixed (eval_mixed/items.jsonl): does RL on rules cost the rest?
  tf_answer        teacher-forced log p(gold answer), nats (teacher_forced.json)
  tf_value         the same over the answer's value tokens only
  reh_schema / reh_echo / reh_f1   teacher-forced rehearsal of the gold calls: key paths, echoed
                   arguments, field F1 against the real response
  reh_predictable  rehearsal on the fields the tool's documented rules and the episode predict
  reh_hidden       rehearsal on the other fields (uniform random values: at chance by construction)
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import learning_stats as ls
from _common import hardware
from learning_report import _items, _mean, md_tail, read_arms, v4_decision
from learning_report import write_outputs as lr_write_outputs

V4_METRICS = {   # key -> (label, kind)
    "primary": ("answer-checked, rules (primary)", "rate"),
    "mixed": ("answer-checked, test:mixed", "rate"),
    "tf_answer": ("teacher-forced log p(gold answer), nats", "nats"),
    "tf_value": ("teacher-forced log p(answer value tokens), nats", "nats"),
    "reh_schema": ("rehearsal: schema", "rate"),
    "reh_echo": ("rehearsal: echoed arguments", "rate"),
    "reh_f1": ("rehearsal: field F1", "rate"),
    "reh_predictable": ("rehearsal: predictable fields", "rate"),
    "reh_hidden": ("rehearsal: hidden fields", "rate"),
}
PLANNING_SD = 0.121   # v3's pooled per-seed SD of Ca and R (pre-registration, pilot step 4)
# Secondary contrasts (no decision rides on them), per the pre-registration's "Secondary" list.
V4_SECONDARY = [("Ca", "R", "primary"), ("Ca", "R", "reh_predictable"), ("Ca", "R", "reh_hidden"),
                ("Ca", "Cv", "reh_predictable"), ("Ca", "Cv", "reh_hidden"), ("Sr", "Cv", "reh_predictable"),
                ("R", "S", "primary"), ("Ca", "S", "primary")]


def read_v4_checkpoint(run_dir: Path, cats: dict, n_eval: int, n_mixed: int, n_tf: int) -> tuple[dict, list[str]]:
    """{metric: {item_id: value}} of one checkpoint from its own files, and what is missing (an
    eval short of its items is missing as a whole: a partial eval is never a score)."""
    out: dict[str, dict] = {k: {} for k in V4_METRICS}
    missing = []
    for key, sub, cat, n in (("primary", "eval", cats["primary"], n_eval), ("mixed", "eval_mixed", cats["mixed"], n_mixed)):
        rows = [r for r in _items(run_dir / sub / "items.jsonl") if r.get("category") == cat]
        ok = [r for r in rows if r.get("error") is None and r.get("score") is not None]
        if len(ok) != n:
            missing.append(f"{run_dir}/{sub}: {cat} has {len(ok)} scored items of {n}")
            continue
        out[key] = {r["id"]: float(r["score"]) for r in ok}
    try:
        tf = json.loads((run_dir / "teacher_forced.json").read_text())
    except (OSError, ValueError):
        missing.append(f"{run_dir}/teacher_forced.json: not written")
        return out, missing
    if len(tf["logprob_items"]) != n_tf or len(tf["rehearsal_items"]) != n_tf:
        missing.append(f"{run_dir}/teacher_forced.json: {len(tf['logprob_items'])} / "
                       f"{len(tf['rehearsal_items'])} items of {n_tf}")
        return out, missing
    out["tf_answer"] = {r["id"]: r["answer_logprob"] for r in tf["logprob_items"]}
    out["tf_value"] = {r["id"]: r["value_logprob"] for r in tf["logprob_items"] if r.get("value_logprob") is not None}
    for r in tf["rehearsal_items"]:
        for key, field in (("reh_schema", "schema"), ("reh_echo", "echo"), ("reh_f1", "field_f1"),
                           ("reh_predictable", "rule_predictable"), ("reh_hidden", "rule_hidden")):
            if r.get(field) is not None:   # an item with no such field has no value (not a 0)
                out[key][r["id"]] = r[field]
    return out, missing


def planned_mde(r: list[float], ca: list[float], seeds: dict[str, int]) -> dict:
    """Pilot step 4: the planning SD max(pooled SD of R and Ca's first 2 seeds, v3's 12.1 pp), the
    planned MDEs (80% power, alpha 0.05) of P1 (Ca vs Cv), P2 (Ca vs Sr) and Ca vs R at the planned
    seeds, and the seeds Ca and Cv would need for an MDE of 25 pp when P1's is above it."""
    s = ls.pooled_sd(r[:2], ca[:2]) if len(r) >= 2 and len(ca) >= 2 else None
    sd = max(s or 0.0, PLANNING_SD)
    mde = {"P1": ls.mde_planned(sd, seeds["Ca"], seeds["Cv"]), "P2": ls.mde_planned(sd, seeds["Ca"], seeds["Sr"]),
           "Ca-R": ls.mde_planned(sd, seeds["Ca"], seeds["R"])}
    return {"pilot_sd": s, "planning_sd": sd, "mde": mde,
            "seeds_for_p1_25pp": ls.seeds_for_mde(sd, 0.25) if mde["P1"] > 0.25 else None,
            "from": "R and Ca seeds 0-1" if s is not None else "v3's SD (R or Ca has < 2 seeds)"}


def _arm_contrast(arms: dict, a: str, b: str, metric: str) -> dict | None:
    if a not in arms or b not in arms:
        return None
    xa = [s["metrics"][metric] for s in arms[a]["seeds"].values() if s["metrics"].get(metric) is not None]
    xb = [s["metrics"][metric] for s in arms[b]["seeds"].values() if s["metrics"].get(metric) is not None]
    if len(xa) < 2 or len(xb) < 2:
        return {"a": a, "b": b, "metric": metric, "missing": f"{len(xa)} / {len(xb)} seeds"}
    return {"a": a, "b": b, "metric": metric, "permutation": ls.permutation_test(xa, xb), "welch": ls.welch(xa, xb)}


def _kept_frac(run_dir: Path) -> float | None:
    """Sr: the mean share of its sampled rehearsed episodes that passed `consistent` (trained on)."""
    rows: dict[int, dict] = {r["step"]: r for r in _items(run_dir / "metrics.jsonl") if "kept_frac" in r}
    return sum(r["kept_frac"] for r in rows.values()) / len(rows) if rows else None


def report_v4(a, cfg, pl: dict, failures: list, wall_s: float | None, pilot: dict | None,
              priors: dict | None = None) -> dict:
    """The v4 report of the plan `pl` (bench_learning.plan) from the run dirs; `pilot`: the pilot's
    record (benchmarks/results/learning_v4_smollm2_pilot.json) or None; `priors`: runs kept from
    --prior, used when their warm-up is this one."""
    from bench_learning import V4, categories, shell
    from learning_report import plan_of
    cats = categories(a, cfg)
    n_mixed = a.n_eval if a.tiny else V4["n_mixed"]
    read = lambda d: read_v4_checkpoint(d, cats, a.n_eval, n_mixed, a.n_rehearsal)  # noqa: E731
    warm = pl["warmup"]["run_dir"]
    arms, w_items, w_sha, missing = read_arms(a, pl, read, V4_METRICS, priors,
                                              extra=lambda d: {"kept_frac": _kept_frac(d)})
    primary = {arm: [s["metrics"]["primary"] for s in r["seeds"].values() if s["metrics"].get("primary") is not None]
               for arm, r in arms.items()}
    short_items = {arm: a.seeds[arm] - len(v) for arm, v in primary.items() if len(v) < a.seeds[arm]}
    w_primary = _mean(w_items["primary"])
    deviations = []
    mde_plan = (pilot or {}).get("planned_mde")
    if mde_plan is None:   # pilot step 4 from the main run's seeds 0-1, as the pre-registration defines it
        mde_plan = planned_mde(primary.get("R", []), primary.get("Ca", []),
                               {k: a.seeds.get(k, V4["seeds"][k]) for k in ("R", "Ca", "Cv", "Sr")})
        deviations.append(f"planned MDE computed by the report from {mde_plan['from']} (the pilot record holds none)")
    if any(a.seeds.get(k, 0) != n for k, n in V4["seeds"].items()):
        deviations.append(f"seeds {a.seeds}, pre-registered minimum {V4['seeds']}")
    decision = None
    if w_primary is None:
        missing.append("the warm-up's primary success: no decision without it")
    else:
        decision = v4_decision(primary, w_primary, {k: mde_plan["mde"][k] for k in ("P1", "P2")})
        if short_items and decision["complete"]:   # planned seeds whose evals are missing
            decision = {**decision, "complete": False, "verdict": "incomplete: no verdict",
                        "short_arms": {arm: (len(primary[arm]), a.seeds[arm]) for arm in short_items}}
    pk = plan_of(a, cfg)
    return {
        "what": "v4: rehearse-only RL paid by `consistent` (Ca) vs a schema-perfect random world (Cv), "
                "SFT on its own consistent rehearsals (Sr), real-environment RL (R) and SFT on gold (S), "
                "on the builtin rules family, from one warm-up; real-tool greedy evals per item",
        "design": "v4", **{k: pk[k] for k in ("tiny", "config", "level", "extra_sets")},
        "hardware": hardware(), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "wall_s_this_invocation": wall_s,
        "plan": {"arms": a.arms, "seeds": a.seeds, **{k: pk[k] for k in pk if k not in ("tiny", "config", "level", "extra_sets")},
                 "n_mixed": n_mixed, "warmup": a.warmup},
        "metrics": {k: v[0] for k, v in V4_METRICS.items()},
        "pre_registration": "docs/learning.md, v4 pre-registration + addendum",
        "planned_mde": mde_plan, "deviations": deviations,
        "warmup": {"run_dir": str(warm), "weights_sha256": w_sha, "items": w_items,
                   "metrics": {k: _mean(v) for k, v in w_items.items()},
                   "train_command": shell(pl["warmup"]["train"], a.threads),
                   "eval_commands": [shell(c, a.threads) for _, _, c in pl["warmup"]["evals"]]},
        "arms": arms, "decision": decision,
        "secondary": [c for c in (_arm_contrast(arms, *x) for x in V4_SECONDARY) if c],
        "mixed_vs_warmup": {arm: (None if r["summary"]["mixed"]["mean"] is None or w_items["mixed"] == {}
                                  else r["summary"]["mixed"]["mean"] - _mean(w_items["mixed"]))
                            for arm, r in arms.items()},
        "prior": sorted({p["source"] for p in (priors or {}).values()}),
        "missing": missing, "failures": failures,
    }


# ---- outputs -----------------------------------------------------------------------------------
def _pct(x, signed=False) -> str:
    return "-" if x is None else (f"{100 * x:+.1f}" if signed else f"{100 * x:.1f}")


def _fmt(x, kind: str) -> str:
    return "-" if x is None else (f"{100 * x:.1f}" if kind == "rate" else f"{x:.2f}")


def write_md(res: dict, path: Path) -> None:
    p = res["plan"]
    tiny = " (TINY random model: pipeline check, not a result)" if res["tiny"] else ""
    kinds = {k: V4_METRICS[k][1] for k in res["metrics"]}
    d = res["decision"]
    lines = [f"# Learning experiment {path.stem}{tiny}", "", f"{res['what']}.", "",
             f"Hardware: {res['hardware']['cpu']} ({res['hardware']['cpu_cores']} cores), torch "
             f"{res['hardware']['torch']}. Warm-up W_{p['warmup']}; seeds {p['seeds']}; {p['steps_per_arm']} steps per arm; "
             f"{p['tasks_per_step']} tasks x {p['group_size']} samples per RL step; lr {p['lr']}; primary items "
             f"n = {p['n_eval']}, test:mixed n = {p['n_mixed']}, teacher-forced n = {p['n_rehearsal']}. "
             f"Pre-registration: {res['pre_registration']}.", "",
             "## Verdict against the pre-registered rule", "",
             f"**{d['verdict'] if d else 'no decision: ' + '; '.join(res['missing'][:1])}**", ""]
    if d:
        lines += ["| test | claim | difference (pp) | exact permutation p | Holm alpha | Welch 95% CI | planned MDE | verdict |",
                  "|---|---|---:|---:|---:|---|---:|---|"]
        for name, t in d["tests"].items():
            if t["p"] is None:
                lines.append(f"| {name}: {t['a']} - {t['b']} | {t['claim']} | - | - | - | - | - | {t['verdict']} |")
                continue
            w = t["welch"]
            wt = f"[{_pct(w['lo'], True)}, {_pct(w['hi'], True)}]" if w["lo"] is not None else f"n/a ({w.get('why')})"
            lines.append(f"| {name}: {t['a']} - {t['b']} | {t['claim']} | {_pct(t['diff'], True)} | {t['p']:.4f}"
                         f"{'' if t['exact'] else ' (MC)'} | {t.get('holm_alpha', 0):.3f} | {wt} | "
                         f"{_pct(t['planned_mde'])} | {t['verdict']} |")
        rho = d["recovery"]
        if rho:
            ci = "unbounded" if rho["lo"] is None else f"[{rho['lo']:.2f}, {rho['hi']:.2f}]"
            ratio = "-" if rho["ratio"] is None else f"{rho['ratio']:.2f}"
            lines += ["", f"Recovery ratio (Ca - W) / (R - W) = {ratio}, 95% Fieller {ci}: {rho['verdict']}."]
    m = res["planned_mde"]
    lines += ["", f"Planned MDEs (80% power, alpha 0.05; planning SD {_pct(m['planning_sd'])} pp = max(pooled SD "
              f"{_pct(m['pilot_sd'])} pp of {m['from']}, v3's {_pct(PLANNING_SD)} pp)): "
              + ", ".join(f"{k} {_pct(v)} pp" for k, v in m["mde"].items()) + "."]
    if res["deviations"]:
        lines += ["", "Deviations from the pre-registration:"] + [f"- {x}" for x in res["deviations"]]
    lines += ["", "## Arms (mean ± sample std over seeds; rates in %, log-probs in nats)", "",
              "| arm | seeds | " + " | ".join(res["metrics"].values()) + " |", "|---|---:|" + "---:|" * len(res["metrics"])]
    w = res["warmup"]["metrics"]
    lines.append("| warm-up (start) | 1 | " + " | ".join(_fmt(w.get(k), kinds[k]) for k in res["metrics"]) + " |")
    for arm, r in res["arms"].items():
        cells = []
        for k in res["metrics"]:
            s = r["summary"][k]
            cells.append("missing" if s["mean"] is None else _fmt(s["mean"], kinds[k])
                         + ("" if s["std"] is None else f" ± {_fmt(s['std'], kinds[k])}"))
        lines.append(f"| {arm}: {r['name']} | {r['summary']['primary']['n_seeds']} | " + " | ".join(cells) + " |")
    lines += ["", "## Secondary contrasts (no decision rides on them)", "",
              "| contrast | metric | difference | permutation p | Welch 95% CI |", "|---|---|---:|---:|---|"]
    for c in res["secondary"]:
        if c.get("missing"):
            lines.append(f"| {c['a']} - {c['b']} | {res['metrics'][c['metric']]} | missing ({c['missing']}) | - | - |")
            continue
        w = c["welch"]
        wt = f"[{_pct(w['lo'], True)}, {_pct(w['hi'], True)}]" if w["lo"] is not None else f"n/a ({w.get('why')})"
        lines.append(f"| {c['a']} - {c['b']} | {res['metrics'][c['metric']]} | {_pct(c['permutation']['diff'], True)} | "
                     f"{c['permutation']['p']:.4f} | {wt} |")
    lines += ["", "test:mixed vs the warm-up (pp): " + ", ".join(f"{arm} {_pct(v, True)}" for arm, v in res["mixed_vs_warmup"].items())]
    lines += ["", "## Training signal per run", "",
              "| arm | seed | RL steps | trained reward % | real reward % | zero-signal ACT groups % | Sr kept % |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for arm, r in res["arms"].items():
        for seed, s in r["seeds"].items():
            g = s["signal"]
            lines.append(f"| {arm} | {seed} | {g['rl_steps']} | {_pct(g['mean_reward'])} | {_pct(g['mean_reward_real'])} | "
                         f"{_pct(g['zero_signal_share'])} | {_pct(s.get('kept_frac'))} |")
    lines += md_tail(res)
    path.write_text("\n".join(lines))


def write_png(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = list(res["arms"])
    fig, axes = plt.subplots(1, 3, figsize=(18, 5.5))
    ax = axes[0]
    for i, arm in enumerate(arms):
        vals = [100 * s["metrics"]["primary"] for s in res["arms"][arm]["seeds"].values()
                if s["metrics"].get("primary") is not None]
        if vals:
            ax.bar(i, sum(vals) / len(vals), 0.6, alpha=0.7, label=arm)
            ax.scatter([i] * len(vals), vals, color="k", s=10, zorder=3)
    w = res["warmup"]["metrics"].get("primary")
    if w is not None:
        ax.axhline(100 * w, color="grey", ls="--", lw=1, label="warm-up")
    ax.set_xticks(range(len(arms)))
    ax.set_xticklabels(arms)
    ax.set_ylabel("% answer-checked, primary rules items (bars: mean; dots: seeds)")
    ax.set_title(f"primary metric, n={res['plan']['n_eval']} items")
    ax = axes[1]
    width = 0.38
    for j, (key, label) in enumerate((("reh_predictable", "predictable fields"), ("reh_hidden", "hidden fields"))):
        means = [res["arms"][arm]["summary"][key]["mean"] for arm in arms]
        ax.bar([i + j * width for i in range(len(arms))], [100 * (m or 0) for m in means], width, label=label)
    ax.set_xticks([i + width / 2 for i in range(len(arms))])
    ax.set_xticklabels(arms)
    ax.set_ylabel("% teacher-forced rehearsal fidelity")
    ax.set_title("world model: predictable vs hidden fields")
    ax.legend(fontsize=8)
    ax = axes[2]
    tests = list((res["decision"] or {}).get("tests", {}).items())
    for y, (name, t) in enumerate(tests):
        if t["p"] is None:
            continue
        wl = t["welch"]
        if wl["lo"] is not None:
            ax.plot([100 * wl["lo"], 100 * wl["hi"]], [y, y], color="C0", lw=2)
        ax.plot([100 * t["diff"]], [y], "ko", ms=5)
        if t["planned_mde"] is not None:
            ax.plot([100 * t["planned_mde"]], [y], "r|", ms=14)
    ax.axvline(0, color="grey", lw=0.8)
    ax.set_xlim(-105, 105)
    ax.set_yticks(range(len(tests)))
    ax.set_yticklabels([f"{n}: {t['a']} - {t['b']}" for n, t in tests])
    ax.set_xlabel("pp (dot: difference; blue: Welch 95% CI; red tick: planned MDE)")
    ax.set_title("pre-registered tests: " + ((res["decision"] or {}).get("verdict") or "no decision")[:60], fontsize=9)
    fig.suptitle(("TINY random model (pipeline check) -- " if res["tiny"] else "") + f"{path.stem}, {res['hardware']['cpu']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_outputs(res: dict, out: Path) -> None:
    lr_write_outputs(res, out, write_md, write_png)
