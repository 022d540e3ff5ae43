"""Eval harness on the rollout engine: gold replay, wrong outputs, resumability, errors that are
never scores, the CLI end to end. Forced (scripted / gold) turns need no model (engine model=None)."""
import copy
import json
import time

import pytest

from fastrehearse.envs.builtin import BuiltinSuite
from fastrehearse.eval import cli
from fastrehearse.eval.harness import HarnessConfig, run_items
from fastrehearse.eval.results import ResultStore
from fastrehearse.eval.runner import EvalSettings, eval_engine
from fastrehearse.model import load_tokenizer
from fastrehearse.rollout.engine.policy import GoldPolicy, ScriptedPolicy
from fastrehearse.rollout.text.template import assistant_text


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("smollm2")


def _engine(tok, max_turns=12):
    return eval_engine(None, tok, EvalSettings(max_turns=max_turns, max_episode_tokens=1 << 20))


def _run(tok, policy, tasks, out, cfg=None, config=None, category="test"):
    suite = BuiltinSuite(level="all")
    store = ResultStore(out, config or {"policy": "x"})
    done = run_items([(category, t) for t in tasks], lambda c: suite.make_env(), _engine(tok), policy, store,
                     cfg or HarnessConfig(batch_size=4))
    return store, done


def _gold_turn(r, edit=None):
    gold = [m for m in r.task.gold if m["role"] == "assistant"]
    msg = copy.deepcopy(gold[r.turn]) if r.turn < len(gold) else {"role": "assistant", "content": ""}
    return assistant_text(edit(msg) if edit else msg)


def _corrupt(msg):
    """Every id-like string / number argument corrupted: calls hit the wrong (missing) records."""
    for tc in msg.get("tool_calls") or []:
        args = tc["function"]["arguments"]
        for k, v in list(args.items()):
            if isinstance(v, str):
                args[k] = v + "X"
            elif isinstance(v, (int, float)) and not isinstance(v, bool):
                args[k] = v + 7
    if not msg.get("tool_calls"):
        msg["content"] = "I could not find it."
    return msg


def test_gold_builtin_scores_one(tmp_path, tok):
    tasks = BuiltinSuite(level="all").tasks("test", 24)
    store, done = _run(tok, GoldPolicy(), tasks, tmp_path)
    assert len(done) == 24
    assert all(r.score == 1.0 and r.error is None for r in done), [(r.id, r.score, r.error) for r in done]
    # every gold call went through env.execute
    assert sum(r.real_calls for r in done) == sum(
        len(m.get("tool_calls") or []) for t in tasks for m in t.gold if m["role"] == "assistant")


@pytest.mark.parametrize("policy", [ScriptedPolicy(lambda r: _gold_turn(r, _corrupt)),
                                    ScriptedPolicy(lambda r: "42")], ids=["wrong-args", "no-calls"])
def test_wrong_outputs_score_zero(tmp_path, tok, policy):
    tasks = BuiltinSuite(level="mixed").tasks("test", 9)
    _, done = _run(tok, policy, tasks, tmp_path)
    assert [r.score for r in done] == [0.0] * 9 and all(r.error is None for r in done)


class Counting(GoldPolicy):
    def __init__(self):
        self.seen = []

    def begin_turns(self, requests):
        self.seen += [r.task.id for r in requests if r.turn == 0]
        return super().begin_turns(requests)


def test_resume_skips_finished_items(tmp_path, tok):
    tasks = BuiltinSuite().tasks("test", 6)
    p = Counting()
    _run(tok, p, tasks[:3], tmp_path)
    assert set(p.seen) == {t.id for t in tasks[:3]}
    # a line cut short by a crash is ignored: that item runs again
    with open(tmp_path / "items.jsonl", "a") as f:
        f.write('{"id": "' + tasks[3].id + '", "categ')
    p = Counting()
    store, done = _run(tok, p, tasks, tmp_path)
    assert set(p.seen) == {t.id for t in tasks[3:]} == {r.id for r in done}
    assert len(store.items()) == 6
    p = Counting()
    _, done = _run(tok, p, tasks, tmp_path)
    assert done == [] and p.seen == []


def test_resume_refuses_other_configuration(tmp_path):
    ResultStore(tmp_path, {"policy": "gold", "drift": None})
    with pytest.raises(ValueError, match="different configuration"):
        ResultStore(tmp_path, {"policy": "gold", "drift": "rename"})


def test_resume_may_switch_the_fidelity_pass_on_only(tmp_path):
    """Fidelity is a separate pass that never changes a score, so a run scored without it may be
    resumed with it (run.json then records it); switching it off again, or together with another
    change, is refused."""
    import json
    ResultStore(tmp_path, {"policy": "p", "measure_fidelity": False})
    with pytest.raises(ValueError, match="different configuration.*drift"):
        ResultStore(tmp_path, {"policy": "p", "measure_fidelity": True, "drift": "rename"})
    assert json.loads((tmp_path / "run.json").read_text())["measure_fidelity"] is False
    ResultStore(tmp_path, {"policy": "p", "measure_fidelity": True})
    assert json.loads((tmp_path / "run.json").read_text())["measure_fidelity"] is True
    with pytest.raises(ValueError, match="measure_fidelity"):
        ResultStore(tmp_path, {"policy": "p", "measure_fidelity": False})


class Boom:
    def begin_turns(self, requests):
        raise RuntimeError("decoder exploded")


def test_policy_crash_is_an_error_not_a_score_and_a_rerun_retries_it(tmp_path, tok):
    tasks = BuiltinSuite().tasks("test", 3)
    store, done = _run(tok, Boom(), tasks, tmp_path)
    assert len(done) == 3 and all(r.score is None and "decoder exploded" in r.error for r in done)
    assert not any(store.done("test", t.id) for t in tasks)
    # the rerun retries them (a working policy now): scored, and the store reads the newer line
    store, done = _run(tok, GoldPolicy(), tasks, tmp_path)
    assert [r.score for r in done] == [1.0] * 3
    store = ResultStore(tmp_path, {"policy": "x"})
    assert all(r.error is None and r.score == 1.0 for r in store.items())


def test_malformed_calls_are_counted_and_scored(tmp_path, tok):
    bad = ScriptedPolicy(lambda r: "<tool_call>\n{not json\n</tool_call>" if r.turn == 0 else "done")
    _, done = _run(tok, bad, BuiltinSuite().tasks("test", 2), tmp_path)
    assert [r.malformed for r in done] == [1, 1] and [r.real_calls for r in done] == [0, 0]
    assert [r.score for r in done] == [0.0, 0.0] and all(r.error is None for r in done)


def test_cli_gold_builtin(tmp_path):
    out = tmp_path / "gold"
    assert cli.main(["--suite", "builtin", "--policy", "gold", "--limit", "10", "--out", str(out),
                     "--quiet"]) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["suite"] == "builtin" and res["policy"] == "gold" and res["errors"] == 0
    assert res["categories"]["test"]["accuracy"] == 1.0 and res["categories"]["test"]["n"] == 10
    assert res["overall"] == 1.0
    assert (out / "results.md").read_text().startswith("### builtin")
    assert (out / "accuracy.png").stat().st_size > 1000
    # rerun with more items resumes the first 10
    assert cli.main(["--suite", "builtin", "--policy", "gold", "--limit", "12", "--out", str(out),
                     "--quiet"]) == 0
    assert len((out / "items.jsonl").read_text().splitlines()) == 12


def test_builtin_easy_answer_category_checks_the_final_answer(tmp_path, tok):
    """test:easy:task grades the spelled-out call only; test:easy:task:answer also needs the tool's
    result in the final answer (what an API-drift row needs to see a misread response)."""
    from fastrehearse.eval import suites

    def vague(msg):
        if not msg.get("tool_calls"):
            msg["content"] = "I called the tool for you."
        return msg

    cats = ["test:easy:task", "test:easy:task:answer"]
    sr = suites.build("builtin", cats, limit=6)
    assert [c for c, _ in sr.items] == [cats[0]] * 6 + [cats[1]] * 6
    for name, policy, want in (("gold", GoldPolicy(), {cats[0]: 1.0, cats[1]: 1.0}),
                               ("vague", ScriptedPolicy(lambda r: _gold_turn(r, vague)), {cats[0]: 1.0, cats[1]: 0.0})):
        done = run_items(sr.items, sr.make_env, _engine(tok), policy, ResultStore(tmp_path / name, {}),
                         HarnessConfig(batch_size=4))
        got = {c: [r.score for r in done if r.category == c] for c in cats}
        assert got == {c: [want[c]] * 6 for c in cats}, (name, got)
    with pytest.raises(ValueError, match="split\\[:level"):
        suites.build("builtin", ["test:easy:task:bogus"], limit=1)


@pytest.mark.parametrize("argv,message", [
    (["--limit", "0"], "--limit must be >= 1"),
    (["--limit", "-1"], "--limit must be >= 1"),
    (["--categories", "dev"], "--categories"),
    (["--rehearsal-budget", "2"], "--rehearsal-budget"),
    (["--drift", "explode"], "--drift"),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
])
def test_cli_usage_errors_are_one_line_exit_2_before_the_model_loads(tmp_path, capsys, monkeypatch, argv, message):
    import fastrehearse.model as fm

    def no_load(*a, **k):
        raise AssertionError("the model must not load for a usage error")
    monkeypatch.setattr(fm, "load_model", no_load)
    out = tmp_path / "o"
    assert cli.main(["--suite", "builtin", "--policy", "gold", "--out", str(out), "--quiet"] + argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fastrehearse eval: error:") and message in err and "\n" not in err
    assert not (out / "items.jsonl").exists()


def test_cli_unknown_bfcl_category_is_a_usage_error(tmp_path, capsys):
    assert cli.main(["--suite", "bfcl", "--categories", "simple_pyton", "--policy", "gold",
                     "--out", str(tmp_path), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "unknown BFCL categories" in err and "simple_pyton" in err and "Traceback" not in err


@pytest.mark.parametrize("form", ["memory", "select"])
def test_cli_tiny_model_builtin_with_rehearsal_and_drift(tmp_path, form):
    """A random tiny model end to end: scores near 0 are fine; no crash, valid results, tokens counted."""
    out = tmp_path / "tiny"
    assert cli.main(["--suite", "builtin", "--policy", "tiny-llama", "--limit", "2", "--max-turns", "2",
                     "--max-new-tokens", "12", "--rehearsal-budget", "2",
                     "--rehearsal-commit", form, "--drift", "all", "--out", str(out), "--quiet"]) == 0
    res = json.loads((out / "results.json").read_text())
    c = res["categories"]["test"]
    assert c["n"] == 2 and 0.0 <= c["accuracy"] <= 1.0 and res["errors"] == 0
    assert c["mean_gen_tokens"] > 0 and c["mean_rehearsal_tokens"] > 0
    assert res["rehearsal"]["budget"] == 2 and res["drift"] == "rename,errors,units,formats"
    assert res["rehearsal"]["commit"] == form


def test_deadline_stops_new_items_and_rerun_resumes(tmp_path, tok):
    tasks = BuiltinSuite().tasks("test", 3)
    _, done = _run(tok, GoldPolicy(), tasks, tmp_path, HarnessConfig(batch_size=1, deadline=time.perf_counter() - 1))
    assert done == []
    _, done = _run(tok, GoldPolicy(), tasks, tmp_path, HarnessConfig(batch_size=1))
    assert len(done) == 3 and all("transcript" in r.extra for r in done)


def test_cli_items_that_could_not_run_exit_1_are_reported_apart_and_retried(tmp_path, monkeypatch, capsys):
    """Environments that refuse to start: exit 1, no accuracy (not 0%), the errors in their own
    column and line; the rerun retries them and scores them."""
    from fastrehearse.envs.builtin.suite import BuiltinEnv

    real_reset = BuiltinEnv.reset

    def refuse(self, task):
        if task.id.endswith(("1", "3")):
            raise ConnectionRefusedError("[Errno 111] Connection refused")
        return real_reset(self, task)

    out = tmp_path / "o"
    argv = ["--suite", "builtin", "--policy", "gold", "--limit", "4", "--out", str(out), "--quiet"]
    monkeypatch.setattr(BuiltinEnv, "reset", refuse)
    assert cli.main(argv) == 1
    assert "2 item(s) could not run" in capsys.readouterr().err
    res = json.loads((out / "results.json").read_text())
    c = res["categories"]["test"]
    assert (c["n"], c["errors"], c["accuracy"], res["overall"], res["errors"]) == (2, 2, 1.0, 1.0, 2)
    md = (out / "results.md").read_text()
    assert "errors (not scored)" in md and "2 item(s) could not run" in md and "Connection refused" in md

    monkeypatch.setattr(BuiltinEnv, "reset", real_reset)
    assert cli.main(argv) == 0
    res = json.loads((out / "results.json").read_text())
    assert (res["n"], res["errors"], res["overall"], res["items_run_last_invocation"]) == (4, 0, 1.0, 2)
