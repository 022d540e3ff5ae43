"""The learning experiment (benchmarks/bench_learning.py, docs/learning.md) and the builtin suite's
held-out tool family it evaluates on.

Fast: the held-out family split (gold replay scores 1.0 on it; train tasks never expose, call or
name a held-out tool; splits stay disjoint and deterministic) and the experiment's plan (--dry-run).
Slow-marked: the --tiny pipeline end to end (a tiny random Llama through `fastrehearse train` and
`fastrehearse eval` for every arm and seed), checking the JSON schema and that every arm's numbers
are read from its own run directories.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fastrehearse.envs.builtin import DOMAINS, BuiltinSuite
from fastrehearse.envs.builtin.suite import parse_level_spec
from fastrehearse.envs.builtin.tasks import TEMPLATE_FAMILIES, TEMPLATES
from fastrehearse.envs.replay import replay_gold

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "bench_learning.py"
HELD = "accounts"


def _mentions(task, names) -> set[str]:
    """Held-out tool names anywhere in what the task shows or does (prompt, tools, gold messages)."""
    text = json.dumps({"prompt": task.payload["prompt"], "tools": task.payload["tools"], "gold": task.gold})
    return {n for n in names if n in text}


@pytest.mark.parametrize("level", ["easy", "mixed", "all"])
@pytest.mark.parametrize("tools", ["auto", "task", "all"])
def test_train_side_never_uses_the_held_out_family(level, tools):
    suite = BuiltinSuite(level=f"{level}@-{HELD}", tools=tools)
    for split in ("train", "test"):
        for t in suite.tasks(split, 40):
            assert not _mentions(t, DOMAINS[HELD]), (t.id, _mentions(t, DOMAINS[HELD]))


@pytest.mark.parametrize("level", ["easy", "mixed", "all"])
def test_held_out_family_is_its_own_tools_only_and_gold_scores_1(level):
    suite = BuiltinSuite(level=f"{level}@{HELD}", tools="auto", easy_answer=True)
    others = [n for d, ts in DOMAINS.items() if d != HELD for n in ts]
    tasks = suite.tasks("test", 24)
    assert len({t.id for t in tasks}) == 24
    for t in tasks:
        assert set(t.payload["tools"]) <= set(DOMAINS[HELD]) and not _mentions(t, others), t.id
        assert replay_gold(suite, t).score == 1.0, t.id


def test_family_split_is_deterministic_and_disjoint():
    a = BuiltinSuite(level=f"all@{HELD}")
    b = BuiltinSuite(level=f"all@{HELD}")
    ta, tb = a.tasks("test", 16), b.tasks("test", 16)
    assert [t.payload for t in ta] == [t.payload for t in tb]
    train = BuiltinSuite(level=f"all@{HELD}").tasks("train", 64)
    assert not {json.dumps(t.payload["combo"]) for t in train} & {json.dumps(t.payload["combo"]) for t in ta}
    assert not {t.payload["world_seed"] for t in train} & {t.payload["world_seed"] for t in ta}
    # a filter changes the task ids, so a filtered task is never confused with an unfiltered one
    assert not {t.id for t in ta} & {t.id for t in BuiltinSuite(level="all").tasks("test", 16)}


def test_template_family_map_matches_what_templates_do():
    for level in TEMPLATES:
        for t in BuiltinSuite(level=level).tasks("train", 30):
            fams = TEMPLATE_FAMILIES[t.payload["template"]]
            used = {d for d, ts in DOMAINS.items() for n in t.payload["tools"] if n in ts}
            assert fams is None or used <= fams, (t.id, used, fams)


@pytest.mark.parametrize("bad", ["mixed@", "mixed@weather", "mixed@-", "nope@calendar", "easy@calendar@x"])
def test_bad_family_spec_is_refused(bad):
    with pytest.raises(ValueError):
        BuiltinSuite(level=bad)


def test_plain_levels_unchanged():
    assert parse_level_spec("mixed") == ((1, 2, 3), None)
    assert parse_level_spec("easy@-convert")[1] == frozenset({"accounts", "shop", "calendar"})


# ---- the experiment ----------------------------------------------------------------------------
def _bench(*args, timeout=600):   # a hang guard only: a dry run imports torch + transformers,
    #                                  which took > 60 s on a loaded 2-core box
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(BENCH), *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_dry_run_prints_the_matched_plan(tmp_path):
    r = _bench("--dry-run", "--runs", str(tmp_path / "runs"), "--steps", "5")
    assert r.returncode == 0, r.stderr
    lines = [ln.strip() for ln in r.stdout.splitlines()]
    train = [ln for ln in lines if " fastrehearse train " in f" {ln} "]
    seeds = {"R": 4, "Ca": 4, "Cc": 3, "H": 3, "S": 2}             # the plan's minimum seeds: the default
    assert len(train) == 1 + sum(seeds.values())
    assert not (tmp_path / "runs").exists()
    warm = f"{tmp_path / 'runs'}/warmup/export"
    assert all("--set env.options.level=easy@-accounts" in ln and "--set optim.min_lr_ratio=1.0" in ln for ln in train)
    for arm, sets in (("S", ["steps=0", "sft.steps=5", "sft.tasks_per_step=12", "sft.lr=5e-05"]),
                      ("R", ["steps=5", "rollout.mode=real", "env.reward=real"]),
                      ("Ca", ["steps=5", "rollout.mode=rehearse", "env.reward=consistent",
                              "algo.world_reward.mode=world", "algo.world_reward.grounded_weight=0"]),
                      ("Cc", ["steps=5", "rollout.mode=rehearse", "env.reward=calls", "algo.world_reward.mode=world",
                              "algo.world_reward.grounded_weight=0"]),
                      ("H", ["steps=5", "rollout.mode=hybrid", "env.reward=consistent", "algo.hybrid_baseline=strata",
                             "algo.world_reward.grounded_weight=1.0", "algo.loss.w_observed=1.0"])):
        mine = [ln for ln in train if f"/{arm}-s" in ln]
        assert {w for ln in mine for w in ln.split() if w.startswith("seed=")} == {f"seed={s}" for s in range(seeds[arm])}
        for ln in mine:   # every arm starts from the one warm-up export, with the same step count
            assert f"model.spec={warm}" in ln and all(f"--set {x}" in ln for x in sets), ln
    assert "estimate:" in r.stdout
    evals = [ln for ln in lines if " fastrehearse eval " in f" {ln} "]
    tf = [ln for ln in lines if "fastrehearse.eval.teacher_forced" in ln]
    assert len(evals) == 2 * len(train) and len(tf) == 2 * len(train)
    assert all("--limit 64" in ln for ln in evals)
    clean = [ln for ln in evals if "--drift" not in ln]
    assert all("test:easy@-accounts:task:answer test:easy@accounts:task:answer" in ln for ln in clean)
    assert sum("--n 256" in ln and "--level easy@-accounts" in ln for ln in tf) == len(train)


def test_seeds_and_no_drift_options(tmp_path):
    r = _bench("--dry-run", "--runs", str(tmp_path / "r"), "--arms", "Ca,Cc", "--seeds", "Ca=2,Cc=1", "--no-drift")
    assert r.returncode == 0, r.stderr
    train = [ln for ln in r.stdout.splitlines() if " fastrehearse train " in f" {ln} "]
    assert len(train) == 1 + 3 and "--drift" not in r.stdout


def test_v4_control_arms_plan(tmp_path):
    r = _bench("--dry-run", "--runs", str(tmp_path / "r"), "--arms", "Cv,Sr", "--seeds", "Cv=1,Sr=1", "--no-drift")
    assert r.returncode == 0, r.stderr
    train = [ln for ln in r.stdout.splitlines() if " fastrehearse train " in f" {ln} "]
    cv = next(ln for ln in train if "Cv-s0" in ln)
    sr = next(ln for ln in train if "Sr-s0" in ln)
    assert "env.options.scramble=true" in cv and "env.reward=consistent" in cv and "rollout.mode=real" in cv
    assert "sft.source=own_rehearsals" in sr and "--set steps=0" in sr and "rollout.mode=rehearse" in sr
    assert "sft.tasks_per_step" not in sr   # its steps sample rollout.tasks_per_step x group_size


def test_v4_design_plan_is_the_preregistered_one(tmp_path):
    """--design v4 (docs/learning.md, v4 pre-registration + addendum): the rules level with no family
    held out, the v4 config and none of v2's --set defaults (its max_tokens=1024 cannot hold one
    rules episode), arms R/Ca/Cv/Sr/S at 8/8/4/4/2 seeds x 24 steps from W_k's export, primary eval
    on test rules 0-99, mixed 64, one teacher-forced pass of 64 items; --pilot evaluates W_8 on the
    pilot items 100-163."""
    runs = tmp_path / "r"
    r = _bench("--design", "v4", "--warmup", "16", "--dry-run", "--runs", str(runs))
    assert r.returncode == 0, r.stderr
    lines = [ln.strip() for ln in r.stdout.splitlines()]
    train = [ln for ln in lines if " fastrehearse train " in f" {ln} "]
    assert len(train) == 1 + 8 + 8 + 4 + 4 + 2
    assert all("--config configs/learning_v4_smollm2.yaml" in ln and "env.options.level=rules" in ln
               and "max_tokens=1024" not in ln and "min_lr_ratio" not in ln for ln in train)
    assert f"run_dir={runs}/W16 " in train[0] + " " and "--set sft.steps=16" in train[0]
    for ln in train[1:]:
        assert f"model.spec={runs}/W16/export" in ln and ("steps=24" in ln)
    evals = [ln for ln in lines if " fastrehearse eval " in f" {ln} "]
    assert sum("--categories test:rules:auto --limit 100" in ln for ln in evals) == len(train)
    assert sum("--categories test:mixed:auto --limit 64" in ln for ln in evals) == len(train)
    assert all("--max-turns 6" in ln and "--max-new-tokens 64" in ln and "--offset" not in ln for ln in evals)
    tf = [ln for ln in lines if "fastrehearse.eval.teacher_forced" in ln]
    assert len(tf) == len(train) and all("--level rules --n 64 --n-rehearsal 64" in ln for ln in tf)
    assert "estimate: none before the pilot" in r.stdout
    p = _bench("--design", "v4", "--pilot", "--dry-run", "--runs", str(runs))
    assert p.returncode == 0, p.stderr
    for bad in (["--design", "v4", "--dry-run", "--warmup", "12"], ["--design", "v4", "--runs", str(runs)],
                ["--warmup", "8", "--dry-run"]):
        b = _bench(*bad)
        assert b.returncode == 2 and "--warmup" in b.stderr, (bad, b.stderr)
    assert not runs.exists()


def test_v4_pilot_eval_is_the_disjoint_pilot_set(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_learning as bl
    a = bl.parse_args(["--design", "v4", "--pilot", "--runs", str(tmp_path)])
    cfg = bl.load_cfg(a)
    kind, out, cmd = bl.warmup_of(a, cfg, 32)["pilot_eval"]
    text = " ".join(cmd)
    assert out == tmp_path / "W32" / "eval_pilot"
    assert "--categories test:rules:auto --offset 100 --limit 64" in text and f"{tmp_path}/W32/export" in text


@pytest.mark.parametrize("rungs, chosen", [
    ([(8, 0.10), (16, 0.30)], 16),                       # the first inside [25, 60]%
    ([(8, 0.25)], 8), ([(8, 0.60)], 8),                  # the window's ends are inside
    ([(8, 0.05), (16, 0.10), (32, 0.20), (64, 0.70)], 32),  # none inside: nearest 42.5% (22.5 vs 27.5 pp off)
    ([(8, 0.05), (16, 0.10), (32, 0.12), (64, 0.14)], None),  # nearest is below 15%: stop
    ([(8, 0.02), (16, 0.80), (32, 0.90), (64, 0.95)], None),  # nearest is above 75%: stop
    ([(8, 0.20), (16, 0.65)], 8),                        # equally near (22.5 pp): the earlier rung
])
def test_v4_warmup_rule_hand_cases(rungs, chosen):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_learning as bl
    assert bl.choose_warmup([{"k": k, "success": s} for k, s in rungs]) == chosen


def test_contrast_intervals_hand_computed():
    sys.path.insert(0, str(BENCH.parent))
    import learning_stats as ls
    # Welch: a = (0.6, 0.8), b = (0.4, 0.5, 0.6): diff 0.2; se^2 = 0.02/2 + 0.01/3
    w = ls.welch([0.6, 0.8], [0.4, 0.5, 0.6])
    se = (0.02 / 2 + 0.01 / 3) ** 0.5
    df = (0.02 / 2 + 0.01 / 3) ** 2 / ((0.02 / 2) ** 2 / 1 + (0.01 / 3) ** 2 / 2)
    t = ls.t_ppf(0.975, df)
    assert w["diff"] == pytest.approx(0.2) and w["df"] == pytest.approx(df)
    assert (w["lo"], w["hi"]) == (pytest.approx(0.2 - t * se), pytest.approx(0.2 + t * se))
    assert ls.t_ppf(0.975, 3) == pytest.approx(3.1824, abs=1e-3) and ls.t_ppf(0.8, 5) == pytest.approx(0.9195, abs=1e-3)
    assert ls.welch([0.5], [0.1, 0.2])["lo"] is None and ls.mde([0.5], [0.1, 0.2]) is None
    # every seed of both arms on one value (a ceiling): no interval and no MDE, never a zero-width one
    flat = ls.welch([0.75, 0.75, 0.75], [0.953, 0.953])
    assert (flat["lo"], flat["hi"], flat["p"]) == (None, None, None) and flat["why"] == "no seed spread in either arm"
    assert flat["diff"] == pytest.approx(0.75 - 0.953) and ls.mde([0.75, 0.75, 0.75], [0.953, 0.953]) is None
    # one arm flat (H 75.0 x3 in v3, a cap), the other not: still no interval; the flat arm is named
    one = ls.welch([0.75, 0.75, 0.75], [0.6, 0.8])
    assert (one["lo"], one["hi"], one["p"]) == (None, None, None) and "arm a (every seed = 0.75)" in one["why"]
    assert ls.mde([0.75, 0.75, 0.75], [0.6, 0.8]) is None
    assert ls.mde([0.6, 0.8], [0.4, 0.5, 0.6]) == pytest.approx((t + ls.t_ppf(0.8, df)) * se)
    # bootstrap: identical runs give a zero-width interval at the observed difference
    A = {0: {"x": 1.0, "y": 0.0}, 1: {"x": 1.0, "y": 0.0}}
    B = {0: {"x": 0.0, "y": 0.0}}
    b = ls.bootstrap(A, B, reps=500)
    assert b["diff"] == 0.5 and 0.0 <= b["lo"] <= 0.5 <= b["hi"] <= 1.0 and b["n_items"] == 2
    same = ls.bootstrap({0: {"x": 1.0}}, {0: {"x": 0.0}}, reps=200)
    assert same["lo"] == same["hi"] == 1.0
    with pytest.raises(ValueError, match="no item"):
        ls.bootstrap({0: {"x": 1.0}}, {0: {"y": 1.0}})


def test_permutation_test_hand_computed_and_v3():
    sys.path.insert(0, str(BENCH.parent))
    import learning_stats as ls
    # pooled {3, 4, 5, 0, 1}: of the C(5, 3) = 10 labellings only the observed one ({3,4,5} vs {0,1},
    # difference 4 - 0.5 = 3.5) reaches |3.5|; the next most extreme, {0,1,3} vs {4,5}, is -3.17
    r = ls.permutation_test([3, 4, 5], [0, 1])
    assert r == {"diff": 3.5, "p": 0.1, "n_labelings": 10, "exact": True, "reps": None}
    # ties count: {1, 1} vs {1, 1} -> every labelling as extreme as the observed one
    assert ls.permutation_test([1.0, 1.0], [1.0, 1.0])["p"] == 1.0
    # {0,1} vs {2,3}: the two extreme labellings of 6 -> 2/6
    assert ls.permutation_test([0, 1], [2, 3])["p"] == pytest.approx(2 / 6)
    # Monte Carlo past max_exact: close to the exact value, never 0
    a, b = [0.1, 0.5, 0.3, 0.9, 0.7, 0.2], [0.6, 0.8, 1.0, 0.95, 0.4, 0.85]
    exact = ls.permutation_test(a, b)
    mc = ls.permutation_test(a, b, max_exact=10, reps=20000, seed=1)
    assert exact["exact"] and exact["n_labelings"] == 924 and not mc["exact"] and mc["reps"] == 20000
    assert abs(mc["p"] - exact["p"]) < 0.01 and mc["p"] > 0
    # v3's Ca vs Cc on answer_seen (benchmarks/results/learning_v3_smollm2.json): 5 of 35 labellings
    ca, cc = [0.65625, 0.328125, 0.546875, 0.671875], [0.0, 0.46875, 0.359375]
    assert ls.permutation_test(ca, cc)["p"] == pytest.approx(5 / 35)
    with pytest.raises(ValueError, match="1 seed"):
        ls.permutation_test([], [1.0])


def test_recovery_ratio_fieller_and_planned_mde():
    sys.path.insert(0, str(BENCH.parent))
    import learning_stats as ls
    # R with no spread and a constant warm-up: Fieller reduces to N/D +- t * sqrt(vN) / D
    ca, r, w = [0.5, 0.6, 0.7], [0.9, 0.9, 0.9], [0.3]
    f = ls.recovery_ratio(ca, r, w)
    t = ls.t_ppf(0.975, 2)
    N, D, vN = 0.6 - 0.3, 0.6, 0.01 / 3
    assert f["ratio"] == pytest.approx(N / D) and f["df"] == 2
    assert (f["lo"], f["hi"]) == (pytest.approx(N / D - t * vN ** 0.5 / D), pytest.approx(N / D + t * vN ** 0.5 / D))
    # the general case: the endpoints solve (N - rho D)^2 = t^2 (vN - 2 rho c + rho^2 vD)
    ca, r, w = [0.5, 0.62, 0.7, 0.58], [0.8, 0.9, 0.85, 0.95], [0.25, 0.35, 0.3, 0.3]
    g = ls.recovery_ratio(ca, r, w)
    vw = 0.005 / 3 / 4
    N, D = sum(ca) / 4 - 0.3, sum(r) / 4 - 0.3
    vN, vD = ls.statistics.variance(ca) / 4 + vw, ls.statistics.variance(r) / 4 + vw
    t2 = ls.t_ppf(0.975, 3) ** 2
    assert g["df"] == 3
    for rho in (g["lo"], g["hi"]):
        assert (N - rho * D) ** 2 == pytest.approx(t2 * (vN - 2 * rho * vw + rho ** 2 * vD))
    assert g["lo"] < g["ratio"] < g["hi"]
    # R no better than the warm-up: unbounded, no interval
    u = ls.recovery_ratio([0.5, 0.6], [0.3, 0.5], [0.38])
    assert u["lo"] is None and "unbounded" in u["why"]
    # planned MDE from a pilot SD: hand formula, and the seed count that reaches a target
    sd = ls.pooled_sd([0.5, 0.7], [0.4, 0.6, 0.5])
    assert sd == pytest.approx(((0.02 + 0.02) / 3) ** 0.5)
    m = ls.mde_planned(0.1, 8, 8)
    assert m == pytest.approx((ls.t_ppf(0.975, 14) + ls.t_ppf(0.8, 14)) * 0.1 * (2 / 8) ** 0.5)
    n = ls.seeds_for_mde(0.1, 0.15)
    assert ls.mde_planned(0.1, n, n) <= 0.15 < ls.mde_planned(0.1, n - 1, n - 1)
    for bad in (0.0, float("nan"), -1.0):
        with pytest.raises(ValueError, match="sd"):
            ls.mde_planned(bad, 4, 4)


def test_task_kind_table_counts_each_kind_per_run():
    sys.path.insert(0, str(BENCH.parent))
    import learning_report as lr
    res = {"task_kinds": {"answer_seen": {"a": "t1 (number)", "b": "t1 (number)", "c": "t2 (choice)"}},
           "warmup": {"items": {"answer_seen": {"a": 0.0, "b": 1.0, "c": 0.0}}},
           "arms": {"R": {"seeds": {"0": {"items": {"answer_seen": {"a": 1.0, "b": 1.0, "c": 1.0}}}}},
                    "Ca": {"seeds": {"1": {"items": {"answer_seen": {"a": 0.0, "b": 0.0, "c": 1.0}}}}}}}
    rows = [ln for ln in lr.task_kind_table(res) if ln.startswith("| ")]
    assert rows[0] == "| run | t1 (number) | t2 (choice) |"
    assert rows[1:] == ["| warm-up | 1/2 | 0/1 |", "| R-s0 | 2/2 | 1/1 |", "| Ca-s1 | 0/2 | 1/1 |"]
    assert lr.task_kind_table({"warmup": {"items": {}}, "arms": {}}) == []    # a report from before task kinds
    res["arms"]["Cc"] = {"seeds": {"0": {"items": {"answer_seen": {"a": 1.0}}}}}     # an incomplete eval
    assert lr.task_kind_table(res)[-1] == "| Cc-s0 | missing | missing |"


def test_unsolved_kinds_are_the_ones_with_no_solved_item():
    sys.path.insert(0, str(BENCH.parent))
    import learning_report as lr
    fam = {"a": "count", "b": "count", "c": "copy", "d": "copy", "e": "choice"}
    assert lr.unsolved_kinds({"a": 0.0, "b": 0.0, "c": 1.0, "d": 0.0, "e": 0.0}, fam) == [("choice", 1), ("count", 2)]
    assert lr.unsolved_kinds({"a": 1.0, "b": 0.0, "c": 0.5, "d": 0.0, "e": 1.0}, fam) == []


def test_call_success_rescored_from_a_transcript():
    sys.path.insert(0, str(BENCH.parent))
    import learning_report as lr
    suite, tasks = lr._suite_tasks("test:easy@-accounts:task:answer", 4)
    task = next(iter(tasks.values()))
    call = task.payload["required_calls"][0]
    text = '<tool_call>\n' + json.dumps({"name": call["name"], "arguments": call["arguments"]}) + '\n</tool_call>'
    good = [{"role": "user", "content": "x"}, {"role": "assistant", "content": text},
            {"role": "tool", "content": "{}"}, {"role": "assistant", "content": "no idea"}]
    assert lr.call_success(suite, task, good) == 1.0
    bad = [{"role": "assistant", "content": text.replace(call["name"], "get_balance")}]
    assert lr.call_success(suite, task, bad) == 0.0


def test_eval_complete_needs_every_item_and_the_drift_fidelity_pass(tmp_path):
    sys.path.insert(0, str(BENCH.parent))
    import bench_learning as bl
    cats = {"categories": {"a": {"n": 2, "errors": 0}, "b": {"n": 2, "errors": 0}}}
    (tmp_path / "results.json").write_text(json.dumps(cats))
    assert bl._eval_complete(tmp_path, 2) and not bl._eval_complete(tmp_path, 3)
    (tmp_path / "results.json").write_text(json.dumps({**cats, "drift": "units", "fidelity_measured": False}))
    assert not bl._eval_complete(tmp_path, 2)
    (tmp_path / "results.json").write_text(json.dumps({"categories": {"a": {"n": 2, "errors": 1}}}))
    assert not bl._eval_complete(tmp_path, 2)


def test_arm_with_the_warmup_weights_shares_its_eval(tmp_path):
    """An arm whose export is byte for byte the warm-up's (no gradient reached it) is recognised by
    sha256 and reads the warm-up's eval; a different export, or one retrained later, is not."""
    sys.path.insert(0, str(BENCH.parent))
    import bench_learning as bl
    warm, arm = tmp_path / "warmup", tmp_path / "Ca-s0"
    for d, data in ((warm, b"\x00weights"), (arm, b"\x00weights")):
        (d / "export").mkdir(parents=True)
        (d / "export" / "model.safetensors").write_bytes(data)
    sha = bl.same_as_warmup(arm, warm)
    assert sha is not None and (arm / bl.SAME_AS_WARMUP).exists()
    assert bl.same_as_warmup(arm, warm) == sha                    # the record is reused
    (arm / "export" / "model.safetensors").write_bytes(b"\x00weightz")   # retrained: same size
    os.utime(arm / "export" / "model.safetensors", ns=(1, 1))
    assert bl.same_as_warmup(arm, warm) is None and not (arm / bl.SAME_AS_WARMUP).exists()


@pytest.mark.parametrize("args", [["--arms", "R,bogus"], ["--seeds", "0"], ["--seeds", "Ca=x"], ["--n-eval", "0"],
                                  ["--level", "easy"], ["--n-tf", "0"]])
def test_bad_arguments_refused(args):
    r = _bench("--dry-run", *args)
    assert r.returncode == 2 and "error" in r.stderr


@pytest.mark.slow
def test_tiny_pipeline_end_to_end(tmp_path):
    runs = tmp_path / "runs"
    arms = "R,Ca,H,S"        # Cc differs from Ca by one --set (the dry run checks it)
    args = ["--tiny", "--runs", str(runs), "--arms", arms, "--seeds", "2"]
    r = _bench(*args, timeout=1800)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads((runs / "learning_v2_tiny.json").read_text())
    assert (runs / "learning_v2_tiny.md").exists() and (runs / "learning_v2_tiny.png").stat().st_size > 0
    assert res["tiny"] and res["failures"] == [] and res["missing"] == []
    assert set(res["arms"]) == set(arms.split(","))
    cats = res["plan"]["categories"]
    for arm, r_ in res["arms"].items():
        assert set(r_["seeds"]) == {"0", "1"}
        for seed, s in r_["seeds"].items():
            d = Path(s["run_dir"])
            assert d == runs / f"{arm}-s{seed}"
            if s["weights_same_as_warmup"]:
                d = runs / "warmup"
            # every number comes from this run's own files, per item
            items = [json.loads(x) for x in (d / "eval" / "items.jsonl").read_text().splitlines()]
            seen = {x["id"]: x["score"] for x in items if x["category"] == cats["seen"]}
            assert s["items"]["answer_seen"] == seen and len(seen) == 3
            assert set(s["items"]["call_heldout"]) == {x["id"] for x in items if x["category"] == cats["heldout"]}
            tf = json.loads((d / "teacher_forced.json").read_text())
            assert s["items"]["tf_answer"] == {x["id"]: x["answer_logprob"] for x in tf["logprob_items"]}
            assert len(s["items"]["answer_drift"]) == 3
            cfg = (d / "config.yaml").read_text() if d != runs / "warmup" else None
            if cfg:
                assert f"seed: {seed}" in cfg and str(runs / "warmup" / "export") in cfg
            rows = [x for x in map(json.loads, (Path(s["run_dir"]) / "metrics.jsonl").read_text().splitlines())
                    if "step" in x]
            assert s["curves"]["step"] == [x["step"] for x in rows]
            assert {x["stage"] for x in rows} == ({"sft"} if arm == "S" else {"rl"})
            if arm != "S":
                assert all("reward_real" in x for x in rows)
    assert [(c["a"], c["b"]) for c in res["contrasts"]["primary"]] == [("Ca", "R")]     # Ca - Cc: no Cc here
    # answer success split by task kind: every seen item has its kind, and each row's counts are its items
    fam = res["task_kinds"]["answer_seen"]
    assert set(fam) == set(res["arms"]["R"]["seeds"]["0"]["items"]["answer_seen"])
    md = (runs / "learning_v2_tiny.md").read_text()
    s0 = res["arms"]["R"]["seeds"]["0"]["items"]["answer_seen"]
    f0 = sorted(set(fam.values()))[0]
    cell = f"{sum(v for i, v in s0.items() if fam[i] == f0):.0f}/{sum(x == f0 for x in fam.values())}"
    assert next(ln for ln in md.splitlines() if ln.startswith("| R-s0 |")).split(" | ")[1] == cell
    # a second invocation finds everything done: nothing is retrained or re-evaluated
    before = {p: p.stat().st_mtime_ns for p in runs.rglob("*.json") if p.parent != runs}
    r2 = _bench(*args, timeout=900)
    assert r2.returncode == 0, r2.stdout[-2000:]
    assert {p: p.stat().st_mtime_ns for p in runs.rglob("*.json") if p.parent != runs} == before
    # a later session without R-s1's run dir: --prior keeps its record (same plan, same warm-up)
    prior = tmp_path / "prior.json"
    shutil.copy(runs / "learning_v2_tiny.json", prior)
    shutil.rmtree(runs / "R-s1")
    r3 = _bench(*args, "--report-only", "--prior", str(prior), timeout=900)
    assert r3.returncode == 0, r3.stdout[-2000:]
    res3 = json.loads((runs / "learning_v2_tiny.json").read_text())
    kept = res3["arms"]["R"]["seeds"]["1"]
    assert kept.pop("kept_from").startswith(str(prior)) and kept == res["arms"]["R"]["seeds"]["1"]
    assert res3["arms"]["R"]["seeds"]["0"] == res["arms"]["R"]["seeds"]["0"]      # a run dir here wins
    assert res3["arms"]["R"]["summary"] == res["arms"]["R"]["summary"] and res3["missing"] == []
    assert "R-s1 from" in (runs / "learning_v2_tiny.md").read_text()


# ---- --prior: seeds kept from an earlier report ------------------------------------------------
def _prior_report(bl, lr, a, cfg, seeds=("0",), **plan_changes) -> dict:
    plan = {**lr.plan_of(a, cfg), **plan_changes}
    top = {k: plan.pop(k) for k in ("tiny", "config", "level", "extra_sets")}
    items = {k: {"t1": 0.5, "t2": 1.0} for k in lr.METRICS}
    items["tf_answer"] = {"t1": -1.25, "t2": -0.5}
    rec = lambda s: {"run_dir": f"runs/R-s{s}", "items": items, "metrics": {}, "curves": {}, "signal": {},  # noqa: E731
                     "weight_change": 0.001, "weights_same_as_warmup": None}
    return {**top, "time": "2026-12-04T22:42:33Z", "plan": plan,
            "warmup": {"items": items, "weights_sha256": None},
            "arms": {"R": {"sets": bl.ARM_SETS["R"], "seeds": {s: rec(s) for s in seeds}},
                     "H": {"sets": bl.ARM_SETS["H"], "seeds": {"0": rec("0")}}}}


def test_prior_records_reused_only_for_the_same_plan_and_warmup(tmp_path):
    """--prior takes an earlier report's arm/seed records for the planned runs; another plan, other
    --set overrides of an arm, one run in two files or a non-report file are refused by name; the
    warm-up must be the same (weights by sha256, else item for item, log-probs within 1e-3 nats)."""
    sys.path.insert(0, str(BENCH.parent))
    import bench_learning as bl
    import learning_report as lr
    a = bl.parse_args(["--tiny", "--arms", "R,Ca", "--seeds", "R=2,Ca=1", "--runs", str(tmp_path / "runs")])
    cfg = bl.load_cfg(a)
    good = tmp_path / "good.json"
    good.write_text(json.dumps(_prior_report(bl, lr, a, cfg, seeds=("0", "1", "2"))))
    got = lr.load_priors(a, cfg, [good])
    assert sorted(got) == [("R", 0), ("R", 1)]        # R seed 2 not planned, H not an arm of this run
    assert got[("R", 1)]["record"]["run_dir"] == "runs/R-s1" and got[("R", 1)]["source"] == str(good)
    cases = {"n_eval": ("n_eval", {"n_eval": 99}), "drift": ("drift", {"drift": None}),
             "level": ("level", {"level": "medium@-accounts"})}
    for name, (word, change) in cases.items():
        p = tmp_path / f"{name}.json"
        p.write_text(json.dumps(_prior_report(bl, lr, a, cfg, **change)))
        with pytest.raises(ValueError, match=f"{word}="):
            lr.load_priors(a, cfg, [p])
    sets = _prior_report(bl, lr, a, cfg)
    sets["arms"]["R"]["sets"] = ["rollout.mode=real", "env.reward=calls"]
    (tmp_path / "sets.json").write_text(json.dumps(sets))
    with pytest.raises(ValueError, match="arm R was run with"):
        lr.load_priors(a, cfg, [tmp_path / "sets.json"])
    # a key recorded at its old path is the same setting (the Cag arm of learning_v2_t04_smollm2.json)
    assert lr.same_sets(["algo.world_reward.gate=act_signal"], bl.ARM_SETS["Cag"][-1:])
    assert not lr.same_sets(["algo.world_reward.gate=act_signal"], [])
    with pytest.raises(ValueError, match="also in"):
        lr.load_priors(a, cfg, [good, good])
    (tmp_path / "junk.json").write_text("[1, 2]")
    for bad in (tmp_path / "junk.json", tmp_path / "absent.json"):
        with pytest.raises(ValueError, match="not a learning_v2 report"):
            lr.load_priors(a, cfg, [bad])

    warm = got[("R", 0)]["warmup"]
    same = json.loads(json.dumps(warm["items"]))
    assert lr.same_warmup(warm, same, None) is None
    same["tf_answer"]["t1"] += 5e-5                      # the teacher-forced pass's own run-to-run noise
    assert lr.same_warmup(warm, same, None) is None
    same["tf_answer"]["t1"] += 0.01
    assert "tf_answer differs" in lr.same_warmup(warm, same, None)
    other = json.loads(json.dumps(warm["items"]))
    other["answer_seen"]["t2"] = 0.0
    assert "answer_seen: 1 items differ" in lr.same_warmup(warm, other, None)
    del other["answer_seen"]["t2"]
    assert "other items" in lr.same_warmup(warm, other, None)
    assert lr.same_warmup({**warm, "weights_sha256": "ab"}, other, "ab") is None     # weights decide
    assert "sha256" in lr.same_warmup({**warm, "weights_sha256": "ab"}, warm["items"], "cd")


def test_prior_cli_skips_kept_runs_and_refuses_a_bad_file(tmp_path):
    sys.path.insert(0, str(BENCH.parent))
    import bench_learning as bl
    import learning_report as lr
    args = ["--dry-run", "--tiny", "--arms", "R,Ca", "--seeds", "R=2,Ca=1", "--runs", str(tmp_path / "runs")]
    a = bl.parse_args(args[1:])
    p = tmp_path / "prior.json"
    p.write_text(json.dumps(_prior_report(bl, lr, a, bl.load_cfg(a))))
    r = _bench(*args, "--prior", str(p))
    assert r.returncode == 0, r.stderr
    assert "kept from --prior (not run): R-s0" in r.stdout
    train = [ln for ln in r.stdout.splitlines() if " fastrehearse train " in f" {ln} "]
    assert not any("/R-s0 " in ln for ln in train) and any("/R-s1 " in ln for ln in train)
    r = _bench(*args, "--prior", str(p), "--steps", "3")
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "steps_per_arm=2" in r.stderr


def test_v4_decision_rule_hand_cases():
    """The pre-registered v4 rule (docs/learning.md): exact permutation p over seed labels, Holm over
    P1/P2, verdicts by sign and the planned MDE, the recovery ratio against 0.5, and no verdict
    while an arm is short of its minimum seeds."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import learning_report as lr
    ca = [0.60, 0.62, 0.58, 0.64, 0.61, 0.59, 0.63, 0.57]          # mean 0.605
    r = [0.70, 0.72, 0.68, 0.71, 0.69, 0.73, 0.67, 0.70]           # mean 0.70
    cv = [0.30, 0.32, 0.28, 0.31]                                  # every Cv below every Ca
    sr = [0.59, 0.61, 0.60, 0.62]                                  # interleaved with Ca
    s = [0.9, 0.92]
    d = lr.v4_decision({"Ca": ca, "R": r, "Cv": cv, "Sr": sr, "S": s}, 0.40, {"P1": 0.2, "P2": 0.2})
    p1, p2 = d["tests"]["P1"], d["tests"]["P2"]
    # P1: every Cv seed is below every Ca seed, so only the observed labelling of the C(12, 8) = 495
    # reaches |diff| = 0.3025 (the most extreme reversed one, Cv = Ca's top 4, gives -0.181): 1 / 495
    assert p1["exact"] and p1["n_labelings"] == 495 and p1["p"] == pytest.approx(1 / 495)
    assert p1["holm_alpha"] == 0.025 and p1["significant"]
    assert p1["verdict"] == "the rehearsed world's content helps (beyond its format)"
    assert p2["holm_alpha"] == 0.05 and not p2["significant"] and p2["p"] > 0.5
    assert re.match(r"not shown \(Ca - Sr = [+-]0\.0 pp", p2["verdict"]) and "below this run's resolution" in p2["verdict"]
    rho = d["recovery"]    # (0.605 - 0.40) / (0.70 - 0.40) = 0.6833
    assert rho["ratio"] == pytest.approx(0.205 / 0.30) and rho["lo"] > 0.5 and rho["verdict"] == "Ca recovers most of R's gain"
    assert d["complete"] and "P1: the rehearsed world's content helps" in d["verdict"]
    # Holm: the smaller p fails alpha / 2, so neither is significant (step-down stops)
    weak = lr.v4_decision({"Ca": [0.5, 0.6, 0.55, 0.45, 0.5, 0.6, 0.55, 0.45], "R": r, "Cv": [0.4, 0.5, 0.6, 0.45],
                           "Sr": [0.5, 0.55, 0.45, 0.6], "S": s}, 0.40, {"P1": 0.05, "P2": 0.05})
    assert not any(t["significant"] for t in weak["tests"].values())
    assert "planned MDE 5.0 pp" in weak["tests"]["P1"]["verdict"]
    # a significant negative is said as such
    neg = lr.v4_decision({"Ca": cv * 2, "R": r, "Cv": ca[:4], "Sr": sr, "S": s}, 0.40, {"P1": 0.2, "P2": 0.2})
    assert neg["tests"]["P1"]["verdict"] == "significantly NEGATIVE: Ca below Cv"
    # R not above the warm-up: no statement about rho
    flat = lr.v4_decision({"Ca": ca, "R": [0.40, 0.41, 0.39, 0.40, 0.41, 0.39, 0.40, 0.40], "Cv": cv, "Sr": sr, "S": s},
                          0.40, {"P1": 0.2, "P2": 0.2})
    assert flat["recovery"]["lo"] is None and flat["recovery"]["verdict"].startswith("no statement about rho")
    # an arm short of its minimum: numbers, no verdict
    short = lr.v4_decision({"Ca": ca, "R": r[:5], "Cv": cv, "Sr": sr, "S": s}, 0.40, {"P1": 0.2, "P2": 0.2})
    assert not short["complete"] and short["short_arms"] == {"R": (5, 8)} and short["verdict"] == "incomplete: no verdict"
    assert short["tests"]["P1"]["p"] is not None


def test_v4_pilot_signal_doubles_the_group_and_projects_the_cost(tmp_path, monkeypatch):
    """Pilot steps 2-3 on stand-in runs (the metrics rows a real `fastrehearse train` writes): Ca at
    group 8 with zero-signal 0.75 > 0.5 doubles the group; at 16 (0.25) it stays; the faster
    backend's second-step time projects the minimum design (26 runs x 24 steps); Ca's mean reward
    outside [5, 95]% stops the pilot."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_learning as bl
    a = bl.parse_args(["--design", "v4", "--pilot", "--warmup", "16", "--runs", str(tmp_path)])
    cfg = bl.load_cfg(a)
    ran = []

    def fake_rows(name):   # (zero-signal, reward, seconds between the two rows)
        g16 = "g16" in name
        if name.startswith("Ca"):
            return (0.25 if g16 else 0.75), fake_rows.ca_reward, (300.0 if "vllm" in name else 600.0)
        return 0.5, 0.3, 700.0

    def fake_train(a_, job, failures):
        d = Path(job["run_dir"])
        ran.append((d.name, " ".join(job["train"])))
        zs, rew, dt = fake_rows(d.name)
        d.mkdir(parents=True, exist_ok=True)
        rows = [{"stage": "rl", "time": 1000.0 + i * dt, "zero_signal_groups": zs, "reward": rew,
                 "rollout_s": 1.0, "train_s": 2.0, "episode_tokens": 10} for i in range(2)]
        (d / "metrics.jsonl").write_text("\n".join(map(json.dumps, rows)) + "\n")

    monkeypatch.setattr(bl, "train_then_eval", fake_train)
    fake_rows.ca_reward = 0.4
    assert bl.pilot_signal(a, cfg, []) == 4          # 26 x 24 x 300 s = 52 h: above the budget
    names = [n for n, _ in ran]
    assert names == ["Ca-g8", "R-g8", "Ca-g16", "R-g16", "Ca-g16-vllm"]
    cmd = dict(ran)
    assert f"model.spec={tmp_path}/W16/export" in cmd["Ca-g16"] and "rollout.group_size=16" in cmd["Ca-g16"]
    assert "env.reward=consistent" in cmd["Ca-g16"] and "env.reward=real" in cmd["R-g16"]
    assert "rollout.backend=vllm" in cmd["Ca-g16-vllm"] and "rollout.backend" not in cmd["Ca-g16"]
    assert all("checkpoint.every=1" in c for c in cmd.values())   # a resumed run keeps its first step
    rec = json.loads((tmp_path / "pilot_signal.json").read_text())
    assert rec["group_size"] == 16 and rec["step_s"] == {"hf": 600.0, "vllm": 300.0}
    assert rec["projection_h"]["rl_steps_only"] == pytest.approx(26 * 24 * 300 / 3600) and not rec["fits_budget_16h"]
    # finished runs are not run again; a reward outside [5, 95]% stops
    ran.clear()
    assert bl.pilot_signal(a, cfg, []) == 4 and ran == []
    for d in tmp_path.glob("pilot/*"):
        shutil.rmtree(d)
    fake_rows.ca_reward = 0.02
    assert bl.pilot_signal(a, cfg, []) == 3 and json.loads((tmp_path / "pilot_signal.json").read_text())["stop"]
    # the pilot record: both steps' files with each rung's per-item pilot scores
    rung = tmp_path / "W8"
    (rung / "eval_pilot").mkdir(parents=True)
    (rung / "eval_pilot" / "items.jsonl").write_text('{"id": "t100", "score": 1.0}\n{"id": "t101", "score": 0.0}\n')
    (tmp_path / "pilot_ladder.json").write_text(json.dumps({"rungs": [{"k": 8, "success": 0.5, "run_dir": str(rung)}],
                                                            "chosen": 8}))
    a.out = tmp_path / "out"
    rec = json.loads(bl.record_pilot(a).read_text())
    assert rec["signal"]["stop"] and rec["ladder"]["chosen"] == 8
    assert rec["ladder"]["rungs"][0]["items"] == {"t100": 1.0, "t101": 0.0} and "cpu" in rec["hardware"]


def _fake_checkpoint(d: Path, cats: dict, primary: int, mixed: int, pred: list, hidden: list) -> None:
    """A checkpoint's eval and teacher-forced files as `fastrehearse eval` / teacher_forced write
    them: `primary` of the 100 primary items solved, `mixed` of the 64 mixed ones; rehearsal item i
    with predictable / hidden fidelity pred[i] / hidden[i] (None: the item has no such field)."""
    for sub, cat, n, k in (("eval", cats["primary"], 100, primary), ("eval_mixed", cats["mixed"], 64, mixed)):
        (d / sub).mkdir(parents=True)
        (d / sub / "items.jsonl").write_text("".join(
            json.dumps({"id": f"{sub}-{i:03d}", "category": cat, "error": None, "score": float(i < k)}) + "\n"
            for i in range(n)))
    (d / "teacher_forced.json").write_text(json.dumps({
        "logprob_items": [{"id": f"tf-{i}", "answer_logprob": -1.0 - i / 64, "value_logprob": -0.5} for i in range(64)],
        "rehearsal_items": [{"id": f"tf-{i}", "schema": 1.0, "echo": 1.0, "field_f1": 0.5,
                             "rule_predictable": pred[i % len(pred)], "rule_hidden": hidden[i % len(hidden)]}
                            for i in range(64)]}))


def test_v4_report_reads_every_run_and_applies_the_preregistered_rule(tmp_path):
    """report_v4 on hand-made run dirs: per-seed primary success read from each run's own items, the
    fidelity split averaged over the items that have the field, the decision equal to the rule on
    those per-seed numbers, the planned MDE from R and Ca's seeds 0-1 (floored at v3's 12.1 pp) when
    the pilot record has none, and an arm short of its seeds' evals reported incomplete."""
    sys.path.insert(0, str(BENCH.parent))
    import bench_learning as bl
    import learning_report as lr
    import learning_report_v4 as lr4
    a = bl.parse_args(["--design", "v4", "--warmup", "8", "--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "out")])
    cfg = bl.load_cfg(a)
    pl = bl.plan(a, cfg)
    cats = bl.categories(a, cfg)
    solved = {"R": [60, 64, 58, 62, 66, 61, 63, 59], "Ca": [55, 57, 53, 56, 58, 54, 52, 59],
              "Cv": [40, 42, 38, 41], "Sr": [50, 47, 52, 49], "S": [90, 91]}
    _fake_checkpoint(pl["warmup"]["run_dir"], cats, 37, 30, [0.5], [0.0])
    for (arm, seed), job in pl["runs"].items():
        _fake_checkpoint(job["run_dir"], cats, solved[arm][seed], 31, [1.0, None, 0.5], [0.0, 0.25])
    res = lr4.report_v4(a, cfg, pl, [], None, None)
    assert res["missing"] == []
    per_seed = {arm: [k / 100 for k in v] for arm, v in solved.items()}
    for arm, v in per_seed.items():
        assert [s["metrics"]["primary"] for s in res["arms"][arm]["seeds"].values()] == v
    ca0 = res["arms"]["Ca"]["seeds"]["0"]["metrics"]
    # items i % 3 == 1 have no predictable field: the mean is over the others (1.0 and 0.5 alternate)
    preds = [[1.0, None, 0.5][i % 3] for i in range(64)]
    assert ca0["reh_predictable"] == pytest.approx(sum(p for p in preds if p is not None) / sum(p is not None for p in preds))
    assert ca0["reh_hidden"] == pytest.approx(0.125) and ca0["mixed"] == pytest.approx(31 / 64)
    assert res["mixed_vs_warmup"]["Ca"] == pytest.approx(1 / 64)
    want = lr.v4_decision(per_seed, 0.37, {k: res["planned_mde"]["mde"][k] for k in ("P1", "P2")})
    assert res["decision"]["verdict"] == want["verdict"] and res["decision"]["complete"]
    assert res["decision"]["tests"]["P1"]["p"] == want["tests"]["P1"]["p"] < 0.025   # Ca beats Cv on every seed
    # planned SD: R and Ca's seeds 0-1 pool to ~2.2 pp, below v3's 12.1 pp, so 12.1 pp plans the run
    assert res["planned_mde"]["planning_sd"] == lr4.PLANNING_SD
    assert res["planned_mde"]["mde"]["P1"] == pytest.approx(0.231, abs=1e-3)
    assert any("planned MDE computed by the report" in x for x in res["deviations"])
    lr4.write_outputs(res, a.out)
    md = Path(f"{a.out}.md").read_text()
    assert want["verdict"] in md and Path(f"{a.out}.png").stat().st_size > 0
    # a seed's primary eval short of items: missing, and no verdict
    (pl["runs"][("Cv", 3)]["run_dir"] / "eval" / "items.jsonl").write_text("")
    res = lr4.report_v4(a, cfg, pl, [], None, {"planned_mde": res["planned_mde"]})
    assert res["decision"]["verdict"] == "incomplete: no verdict" and res["decision"]["short_arms"] == {"Cv": (3, 4)}
    assert any("Cv-s3/eval" in m and "0 scored items of 100" in m for m in res["missing"])
    assert res["deviations"] == []
