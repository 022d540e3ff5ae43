"""BFCL v4 through the eval harness: gold replay scores 1.0 with BFCL's own checkers, wrong outputs 0,
a tiny random model runs end to end, and the overall score follows BFCL's aggregation code."""
import json

import pytest

pytest.importorskip("bfcl_eval")

from _bfcl import answer_problems  # noqa: E402
from fastrehearse.envs import get_suite  # noqa: E402
from fastrehearse.eval import aggregate, cli  # noqa: E402
from fastrehearse.eval.harness import HarnessConfig, run_items  # noqa: E402
from fastrehearse.eval.results import ResultStore  # noqa: E402
from fastrehearse.eval.runner import EvalSettings, eval_engine  # noqa: E402
from fastrehearse.rollout.engine.policy import GoldPolicy, ScriptedPolicy  # noqa: E402
from fastrehearse.rollout.text.template import assistant_text  # noqa: E402
from fastrehearse.eval.bfcl_suite import BfclSingleTurnSuite  # noqa: E402
from fastrehearse.eval.suites import BFCL_MULTI, BFCL_SINGLE  # noqa: E402


def _only_slow(request):
    # Full categories take minutes: run them with `make test-slow` (pytest -m slow) only.
    if "slow" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("full-category gold run: select with -m slow")


def _res(out):
    return json.loads((out / "results.json").read_text())


@pytest.fixture(scope="module")
def tok():
    from fastrehearse.model import load_tokenizer
    return load_tokenizer("smollm2")


def _engine(tok, max_turns=20):
    """Forced turns only: no model runs (max_episode_tokens unbounded, like --policy gold)."""
    return eval_engine(None, tok, EvalSettings(max_turns=max_turns))


def _gold(r):
    return [m for m in r.task.gold if m["role"] == "assistant"]


def test_multi_turn_gold_sample_scores_one(tmp_path):
    out = tmp_path / "gold"
    assert cli.main(["--suite", "bfcl", "--categories", *BFCL_MULTI, "--policy", "gold", "--limit", "3",
                     "--out", str(out), "--quiet"]) == 0
    res = _res(out)
    assert set(res["categories"]) == set(BFCL_MULTI)
    for name, c in res["categories"].items():
        assert (c["n"], c["accuracy"]) == (3, 1.0), name
    assert res["overall"] == 1.0 and res["bfcl_groups"]["multi_turn"] == 1.0
    assert res["bfcl_overall_strict"] == pytest.approx(0.3)   # multi-turn weight 30 of 100


def _drop_last_call(r):
    """Gold minus its last tool call: a plausible, almost-right trajectory."""
    gold = _gold(r)
    last = max(i for i, m in enumerate(gold) if m.get("tool_calls"))
    if r.turn >= len(gold):
        return ""
    return "Done." if r.turn == last else assistant_text(gold[r.turn])


def _swap_args(r):
    """Gold with string arguments replaced: every call is wrong."""
    gold = _gold(r)
    if r.turn >= len(gold):
        return ""
    msg = json.loads(json.dumps(gold[r.turn]))
    for tc in msg.get("tool_calls") or []:
        tc["function"]["arguments"] = {k: ("zz_wrong" if isinstance(v, str) else v)
                                       for k, v in tc["function"]["arguments"].items()}
    return assistant_text(msg)


@pytest.mark.parametrize("script", [_drop_last_call, _swap_args])
def test_multi_turn_wrong_outputs_score_zero(tmp_path, tok, script):
    suite = get_suite("bfcl")
    tasks = suite.tasks("multi_turn_base", 4)
    if script is _swap_args:   # entries where every call has a string argument to break
        tasks = [t for t in tasks if all(any(isinstance(v, str) for v in tc["function"]["arguments"].values())
                                         for m in t.gold for tc in m.get("tool_calls") or [])] or tasks[:1]
    done = run_items([("multi_turn_base", t) for t in tasks], lambda c: suite.make_env(), _engine(tok),
                     ScriptedPolicy(script), ResultStore(tmp_path, {}), HarnessConfig(batch_size=4))
    assert [r.score for r in done] == [0.0] * len(tasks) and all(r.error is None for r in done)


def test_multi_turn_episode_holds_every_user_turn(tmp_path, tok):
    """Gold through the engine: every scripted user turn of the entry is in the trajectory, in order."""
    suite = get_suite("bfcl")
    [task] = suite.tasks("multi_turn_miss_func", 1)
    [r] = run_items([("multi_turn_miss_func", task)], lambda c: suite.make_env(), _engine(tok), GoldPolicy(),
                    ResultStore(tmp_path, {}), HarnessConfig(batch_size=1))
    users = [m["content"] for m in r.extra["transcript"] if m["role"] == "user"]
    assert r.score == 1.0 and len(users) == len(task.payload["user_turns"]) >= 2
    assert [u[:100] for u in users] == [m["content"][:100] for m in task.payload["user_turns"]]


@pytest.mark.slow
@pytest.mark.parametrize("category", BFCL_MULTI)
def test_multi_turn_gold_full_category(tmp_path, tok, category, request):
    _only_slow(request)
    suite = get_suite("bfcl")
    tasks = suite.tasks(category)
    done = run_items([(category, t) for t in tasks], lambda c: suite.make_env(), _engine(tok, 10**6),
                     GoldPolicy(), ResultStore(tmp_path, {}), HarnessConfig(batch_size=16))
    assert len(done) == 200 and [r.id for r in done if r.score != 1.0] == []


def test_tiny_model_bfcl_five_items(tmp_path):
    """5 items: one each of simple_python, irrelevance, parallel, live_simple and multi_turn_base."""
    out = tmp_path / "tiny"
    cats = ["simple_python", "irrelevance", "parallel", "live_simple", "multi_turn_base"]
    assert cli.main(["--suite", "bfcl", "--categories", *cats, "--policy", "tiny-llama",
                     "--limit", "1", "--max-turns", "1", "--max-new-tokens", "8", "--batch-size", "5",
                     "--out", str(out), "--quiet"]) == 0
    res = _res(out)
    assert list(res["categories"]) == cats
    assert sum(c["n"] for c in res["categories"].values()) == 5
    assert all(c["errors"] == 0 and 0.0 <= c["accuracy"] <= 1.0 for c in res["categories"].values())
    assert 0.0 <= res["overall"] <= 1.0 and res["bfcl_overall_strict"] <= res["overall"] + 1e-12


def _single_sample(category, n):
    tasks = BfclSingleTurnSuite().tasks(category, n)
    return [t for t in tasks if not answer_problems(t.payload["entry"])]


def _run_single(tmp_path, tok, policy, category, tasks):
    suite = BfclSingleTurnSuite()
    return run_items([(category, t) for t in tasks], lambda c: suite.make_env(), _engine(tok, 1), policy,
                     ResultStore(tmp_path / category, {}), HarnessConfig(batch_size=8))


def test_single_turn_gold_sample_scores_one(tmp_path):
    out = tmp_path / "gold"
    assert cli.main(["--suite", "bfcl", "--categories", *BFCL_SINGLE, "--policy", "gold", "--limit", "6",
                     "--out", str(out), "--quiet"]) == 0
    res = _res(out)
    assert list(res["categories"]) == list(BFCL_SINGLE)
    for name, c in res["categories"].items():
        assert (c["n"], c["accuracy"], c["mean_real_calls"]) == (6, 1.0, 0.0), name


def _wrong_values(r):
    """Gold calls with every argument value replaced by one of another type, or a call made where
    none belongs (irrelevance categories)."""
    if "irrelevance" in r.task.split:
        return assistant_text({"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": r.tools[0]["function"]["name"], "arguments": {}}}]})
    msg = json.loads(json.dumps(_gold(r)[0]))
    for tc in msg["tool_calls"]:
        args = tc["function"]["arguments"]
        tc["function"]["arguments"] = {k: [["wrong"]] for k in args} or {"zz_unknown": 1}
    return assistant_text(msg)


@pytest.mark.parametrize("category", BFCL_SINGLE)
def test_single_turn_wrong_outputs_score_zero(tmp_path, tok, category):
    tasks = _single_sample(category, 4)
    wrong = _run_single(tmp_path / "w", tok, ScriptedPolicy(_wrong_values), category, tasks)
    assert [r.score for r in wrong] == [0.0] * len(tasks)
    # a call block BFCL cannot decode: fails AST entries, passes irrelevance ("no call"), as in BFCL
    want = 1.0 if "irrelevance" in category else 0.0
    bad = _run_single(tmp_path / "m", tok, ScriptedPolicy(lambda r: "<tool_call>{not json</tool_call>"), category, tasks)
    assert [r.score for r in bad] == [want] * len(tasks)


@pytest.mark.slow
@pytest.mark.parametrize("category", BFCL_SINGLE)
def test_single_turn_gold_full_category(tmp_path, tok, category, request):
    _only_slow(request)
    tasks = _single_sample(category, None)
    done = _run_single(tmp_path, tok, GoldPolicy(), category, tasks)
    assert len(done) == len(tasks) and [r.id for r in done if r.score != 1.0] == []


def test_overall_uses_bfcl_formula():
    cats = {"simple_python": {"accuracy": 1.0, "n": 5}, "irrelevance": {"accuracy": 0.5, "n": 4},
            "live_simple": {"accuracy": 0.2, "n": 3}, "live_multiple": {"accuracy": 0.6, "n": 3},
            "multi_turn_base": {"accuracy": 0.5, "n": 2}}
    agg = aggregate.bfcl_overall(cats)
    # live is weighted by full category size (258 live_simple, 1053 live_multiple), as BFCL does
    live = (0.2 * 258 + 0.6 * 1053) / (258 + 1053)
    assert agg["groups"]["live"] == pytest.approx(live)
    assert agg["overall"] == pytest.approx((10 * 1.0 + 10 * live + 10 * 0.5 + 30 * 0.5) / 60)
    # strict: categories not run count 0; simple = mean(python, java, js); agentic 40% is 0
    strict = (10 * ((1.0 / 3) / 4) + 10 * (0.2 * 258 + 0.6 * 1053) / (258 + 1053 + 16 + 24)
              + 10 * 0.25 + 30 * 0.125) / 100
    assert agg["bfcl_overall_strict"] == pytest.approx(strict, rel=1e-6)
