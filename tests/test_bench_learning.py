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
HELD = "calendar"


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
    r = _bench("--dry-run", "--runs", str(tmp_path / "runs"), "--steps", "5", "--seeds", "3")
    assert r.returncode == 0, r.stderr
    lines = [ln.strip() for ln in r.stdout.splitlines()]
    train = [ln for ln in lines if " fastrehearse train " in f" {ln} "]
    evals = [ln for ln in lines if " fastrehearse eval " in f" {ln} "]
    assert len(train) == 1 + 5 * 3 and len(evals) == 2 * len(train)
    assert not any((tmp_path / "runs").iterdir()) if (tmp_path / "runs").exists() else True
    warm = f"{tmp_path / 'runs'}/warmup/export"
    for arm, sets in (("sft-only", ["steps=0", "sft.steps=5"]), ("real", ["steps=5", "rollout.mode=real"]),
                      ("rehearse", ["steps=5", "rollout.mode=rehearse"]),
                      ("rehearse-calls", ["steps=5", "rollout.mode=rehearse", "env.options.easy_answer=false"]),
                      ("hybrid", ["steps=5", "rollout.hybrid_p=0.3", "algo.loss.w_observed=1.0"])):
        mine = [ln for ln in train if f"/{arm}-s" in ln]
        assert len(mine) == 3 and {f"seed={s}" for s in range(3)} == {
            w for ln in mine for w in ln.split() if w.startswith("seed=")}
        for ln in mine:   # every arm starts from the one warm-up export, with the same step count
            assert f"model.spec={warm}" in ln and all(f"--set {x}" in ln for x in sets), ln
    assert "estimate:" in r.stdout
    held = [ln for ln in evals if "test:easy@calendar:task:answer" in ln]
    assert len(held) == len(train) and all("--limit 64" in ln for ln in evals)
    assert all("--drift" in ln for ln in evals if ln not in held)


def test_versus_sft_only_verdicts_hand_computed():
    sys.path.insert(0, str(BENCH.parent))
    import bench_learning as bl
    arm = lambda *xs: {"summary": {k: bl.stats(list(xs)) for k in bl.VERSUS}}  # noqa: E731
    vs = bl.versus_sft({"sft-only": arm(0.5, 0.7), "real": arm(0.9, 0.9), "hybrid": arm(0.55, 0.75),
                        "rehearse": arm(0.1, 0.2), "rehearse-calls": arm(0.9)})
    sd = 0.2 / 2 ** 0.5                                   # seed std of (0.5, 0.7)
    assert vs["real"]["answer_success"] == pytest.approx({"delta": 0.3, "spread": sd, "verdict": "beats"})
    assert vs["hybrid"]["heldout_success"]["verdict"] == "within spread"
    assert vs["rehearse"]["task_success"]["verdict"] == "worse"
    assert vs["rehearse-calls"]["drift_success"]["verdict"] == "n/a (< 2 seeds)"   # one seed: no spread
    assert "sft-only" not in vs and bl.versus_sft({"real": arm(1.0)}) == {}


def test_light_eval_drops_fidelity_and_drift_for_the_named_checkpoints(tmp_path):
    r = _bench("--dry-run", "--runs", str(tmp_path / "runs"), "--steps", "3", "--arms", "real,hybrid",
               "--light-eval", "warmup,s1")
    assert r.returncode == 0, r.stderr
    evals = [ln.strip() for ln in r.stdout.splitlines() if " fastrehearse eval " in f" {ln} "]
    light = [ln for ln in evals if "/warmup/" in ln or "-s1/" in ln]
    full = [ln for ln in evals if ln not in light]
    assert len(light) == 3 and not any("--measure-fidelity" in ln or "--drift" in ln for ln in light)
    assert len(full) == 4 and sum("--measure-fidelity" in ln for ln in full) == 2
    assert sum("--drift" in ln for ln in full) == 2
    assert all("test:easy@calendar:task:answer" in ln for ln in light)   # clean metrics all kept


def test_eval_complete_needs_the_fidelity_pass_when_wanted(tmp_path):
    """A light eval made full later is incomplete until its fidelity pass ended (the bench then
    resumes the directory and the CLI runs only that pass); results.json files written before the
    `fidelity_measured` key count as measured when run.json asked for it and results.json is newer."""
    sys.path.insert(0, str(BENCH.parent))
    import bench_learning as bl
    cats = {"categories": {"a": {"n": 2, "errors": 0}, "b": {"n": 2, "errors": 0}}}

    def write(results: dict, run: dict):
        (tmp_path / "run.json").write_text(json.dumps(run))
        (tmp_path / "results.json").write_text(json.dumps(results))

    write({**cats, "fidelity_measured": False}, {"measure_fidelity": False})
    assert bl._eval_complete(tmp_path, 2, False) and not bl._eval_complete(tmp_path, 2, True)
    assert not bl._eval_complete(tmp_path, 3, False)                        # fewer items than asked
    write({**cats, "fidelity_measured": True}, {"measure_fidelity": True})
    assert bl._eval_complete(tmp_path, 2, True)
    write({"categories": {"a": {"n": 2, "errors": 1}}, "fidelity_measured": True}, {})
    assert not bl._eval_complete(tmp_path, 2, True)                         # an item could not run
    write(cats, {"measure_fidelity": True})                                 # older results.json
    assert bl._eval_complete(tmp_path, 2, True)
    write(cats, {"measure_fidelity": False, "drift": "rename"})             # drift runs measure it too
    assert bl._eval_complete(tmp_path, 2, True)
    write(cats, {"measure_fidelity": False})
    assert not bl._eval_complete(tmp_path, 2, True)
    os.utime(tmp_path / "results.json", (1, 1))                             # switched on, pass killed
    (tmp_path / "run.json").write_text(json.dumps({"measure_fidelity": True}))
    assert not bl._eval_complete(tmp_path, 2, True)


def test_arm_with_the_warmup_weights_shares_its_eval(tmp_path):
    """An arm whose export is byte for byte the warm-up's (no gradient reached it) is recognised by
    sha256 and reads the warm-up's eval; a different export, or one retrained later, is not."""
    sys.path.insert(0, str(BENCH.parent))
    import bench_learning as bl
    warm, arm = tmp_path / "warmup", tmp_path / "rehearse-s0"
    for d, data in ((warm, b"\x00weights"), (arm, b"\x00weights")):
        (d / "export").mkdir(parents=True)
        (d / "export" / "model.safetensors").write_bytes(data)
    sha = bl.same_as_warmup(arm, warm)
    assert sha is not None and (arm / bl.SAME_AS_WARMUP).exists()
    assert bl.same_as_warmup(arm, warm) == sha                    # the record is reused
    (arm / "export" / "model.safetensors").write_bytes(b"\x00weightz")   # retrained: same size
    os.utime(arm / "export" / "model.safetensors", ns=(1, 1))
    assert bl.same_as_warmup(arm, warm) is None and not (arm / bl.SAME_AS_WARMUP).exists()


@pytest.mark.parametrize("args", [["--arms", "real,bogus"], ["--seeds", "0"], ["--n-eval", "0"],
                                  ["--light-eval", "s2"], ["--light-eval", "warm"]])
def test_bad_arguments_refused(args):
    r = _bench("--dry-run", *args)
    assert r.returncode == 2 and "error" in r.stderr


@pytest.mark.slow
def test_tiny_pipeline_end_to_end(tmp_path):
    runs = tmp_path / "runs"
    # every arm but plain rehearse (it differs from rehearse-calls by one --set; the dry run checks it)
    arms = "sft-only,real,hybrid,rehearse-calls"
    r = _bench("--tiny", "--runs", str(runs), "--n-eval", "2", "--arms", arms, timeout=1200)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads((runs / "learning_tiny.json").read_text())
    assert (runs / "learning_tiny.md").exists() and (runs / "learning_tiny.png").stat().st_size > 0
    assert res["tiny"] and res["failures"] == [] and res["missing"] == []
    assert set(res["arms"]) == set(arms.split(","))
    for arm, r_ in res["arms"].items():
        assert set(r_["seeds"]) == {"0", "1"}
        for seed, s in r_["seeds"].items():
            d = Path(s["run_dir"])
            assert d == runs / f"{arm}-s{seed}"
            # every number comes from this run's own eval dirs
            clean = json.loads((d / "eval" / "results.json").read_text())["categories"]
            drift = json.loads((d / "eval_drift" / "results.json").read_text())["categories"]
            cats = res["plan"]["categories"]
            assert s["metrics"]["task_success"] == clean[cats["task_success"]]["accuracy"]
            assert s["metrics"]["answer_success"] == clean[cats["answer_success"]]["accuracy"]
            assert s["metrics"]["heldout_success"] == clean[cats["heldout_success"]]["accuracy"]
            assert s["metrics"]["drift_success"] == drift[cats["drift_success"]]["accuracy"]
            assert all(c["n"] == 2 and c["errors"] == 0 for c in [*clean.values(), *drift.values()])
            assert (d / "eval" / "run.json").exists() or (d / "eval" / "items.jsonl").exists()
            cfg = (d / "config.yaml").read_text()
            assert f"seed: {seed}" in cfg and str(runs / "warmup" / "export") in cfg
            rows = [x for x in map(json.loads, (d / "metrics.jsonl").read_text().splitlines()) if "step" in x]
            assert s["curves"]["step"] == [x["step"] for x in rows]
            assert {x["stage"] for x in rows} == ({"sft"} if arm == "sft-only" else {"rl"})
            assert s["weight_change"] is not None and s["weight_change"] > 0
        for k in ("task_success", "answer_success", "drift_success", "heldout_success"):
            assert r_["summary"][k]["n_seeds"] == 2
    # a second invocation finds everything done: nothing is retrained or re-evaluated
    before = {p: p.stat().st_mtime_ns for p in runs.rglob("results.json")}
    r2 = _bench("--tiny", "--runs", str(runs), "--n-eval", "2", "--arms", arms, timeout=600)
    assert r2.returncode == 0, r2.stdout[-2000:]
    assert {p: p.stat().st_mtime_ns for p in runs.rglob("results.json")} == before
