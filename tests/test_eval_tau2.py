"""tau2-bench through the eval harness on the rollout engine, graded by tau2's own evaluator:
telecom (solo mode), the conversational mock domain with a scripted user simulator, and a user
simulator that cannot be reached (an error, never a score; retried on rerun)."""
import json
import socket

import pytest

pytest.importorskip("tau2")

from fastrehearse.eval import cli  # noqa: E402
from fastrehearse.eval.harness import HarnessConfig, run_items  # noqa: E402
from fastrehearse.eval.results import ResultStore  # noqa: E402
from fastrehearse.eval.runner import EvalSettings, eval_engine  # noqa: E402
from fastrehearse.rollout.engine.policy import ScriptedPolicy  # noqa: E402
from fastrehearse.rollout.text.template import assistant_text, format_tool_call  # noqa: E402


def _res(out):
    return json.loads((out / "results.json").read_text())


@pytest.fixture(scope="module")
def engine():
    from fastrehearse.model import load_tokenizer
    return eval_engine(None, load_tokenizer("smollm2"), EvalSettings(max_turns=8, max_episode_tokens=1 << 20))


def _gold(task):
    return [m for m in task.gold if m["role"] == "assistant"]


def test_tau2_gold_scores_one_and_wrong_trajectories_score_zero(tmp_path, engine):
    out = tmp_path / "gold"
    assert cli.main(["--suite", "tau2", "--policy", "gold", "--limit", "3", "--out", str(out), "--quiet"]) == 0
    res = _res(out)
    assert res["categories"]["telecom"]["n"] == 3 and res["categories"]["telecom"]["accuracy"] == 1.0

    # deliberately wrong: the gold calls of *another* task (valid calls, wrong fixes) score 0
    from fastrehearse.envs import get_suite

    suite = get_suite("tau2")
    tasks = suite.tasks("telecom", 3)
    other = {t.id: _gold(tasks[(i + 1) % 3]) for i, t in enumerate(tasks)}
    shifted = ScriptedPolicy(lambda r: assistant_text(other[r.task.id][r.turn]) if r.turn < len(other[r.task.id]) else "")
    silent = ScriptedPolicy(lambda r: format_tool_call("done", {}))
    for name, pol in (("shifted", shifted), ("silent", silent)):
        done = run_items([("telecom", t) for t in tasks], lambda c: suite.make_env(), engine, pol,
                         ResultStore(tmp_path / name, {}), HarnessConfig(batch_size=3))
        assert [r.score for r in done] == [0.0] * 3, name


def test_tau2_tiny_model_two_tasks(tmp_path):
    out = tmp_path / "tiny"
    assert cli.main(["--suite", "tau2", "--policy", "tiny-llama", "--limit", "2", "--max-turns", "2",
                     "--max-new-tokens", "16", "--out", str(out), "--quiet"]) == 0
    res = _res(out)
    c = res["categories"]["telecom"]
    assert c["n"] == 2 and 0.0 <= c["accuracy"] <= 1.0 and c["errors"] == 0
    assert c["mean_gen_tokens"] > 0 and res["overall"] == c["accuracy"]


ASK = "Anything else I can do for you?"


def _talker(r):
    """The gold turns, but one question of its own before the gold closing line."""
    gold = _gold(r.task)
    k = next(i for i, m in enumerate(gold) if not m.get("tool_calls"))
    if r.turn == k:
        return ASK
    i = r.turn if r.turn < k else r.turn - 1
    return assistant_text(gold[i]) if i < len(gold) else ""


def test_tau2_conversational_reply_reaches_user_simulator(tmp_path, monkeypatch, engine):
    """Each agent text reply goes to `env.next_user_message(reply)` (also through a DriftEnv), the
    simulated user's answer is the next user turn (CONTEXT), the user's stop ends the episode and
    tau2 grades it. Solo mode has no simulator: a text reply ends the episode."""
    from test_env_tau2_usersim import ScriptedUser

    from fastrehearse.envs.tau2 import Tau2Suite
    from fastrehearse.eval.drift import DriftEnv, DriftSpec

    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    for wrap in (False, True):
        sim = ScriptedUser(["Hi, I need help with my reservation.", "No, that is all.", "###STOP###"])
        try:
            suite = Tau2Suite(user_url=sim.url, user_model="openai/scripted-user", solo=False)
            task = suite.tasks("mock", limit=1)[0]
            envs = []

            def make_env(c, suite=suite, envs=envs):
                env = suite.make_env()
                envs.append(env)
                return DriftEnv(env, DriftSpec.parse("errors")) if wrap else env

            [r] = run_items([("mock", task)], make_env, engine, ScriptedPolicy(_talker),
                            ResultStore(tmp_path / f"conv{wrap}", {}), HarnessConfig(batch_size=1))
            sent = [body["messages"][-1]["content"] for _, body in sim.requests]
            assert len(sent) == 3, sent                       # greeting answer, then one per reply
            assert sent[1] == ASK and sent[2] == "Done."
            roles = [(m["role"], m.get("content")) for m in r.extra["transcript"]]
            assert ("user", "No, that is all.") in roles
            assert envs[0].user_stopped and r.error is None and r.steps == 3
            assert r.score == 1.0                              # tau2's evaluator: DB + communication
        finally:
            sim.close()

    from fastrehearse.envs.tau2 import Tau2Suite
    solo = Tau2Suite()                                          # mock is solo by default: no user
    task = solo.tasks("mock", limit=1)[0]
    [r] = run_items([("mock", task)], lambda c: solo.make_env(), engine, ScriptedPolicy(lambda r: ASK),
                    ResultStore(tmp_path / "solo", {}), HarnessConfig(batch_size=1))
    assert r.steps == 1 and r.score == 0.0 and r.error is None  # tau2 solo: text reply = agent error


def _dead_url() -> str:
    """A loopback port with nothing listening (bound, then released)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"http://127.0.0.1:{port}/v1"


def test_unreachable_user_simulator_is_an_error_retried_on_rerun(tmp_path, monkeypatch, engine):
    from test_env_tau2_usersim import ScriptedUser

    from fastrehearse.envs.tau2 import Tau2Suite

    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    dead = Tau2Suite(user_url=_dead_url(), user_model="openai/scripted-user", solo=False)
    task = dead.tasks("mock", limit=1)[0]
    store = ResultStore(tmp_path, {})
    [r] = run_items([("mock", task)], lambda c: dead.make_env(), engine, ScriptedPolicy(_talker), store,
                    HarnessConfig(batch_size=1))
    assert r.score is None and r.error, r
    assert not store.done("mock", task.id)
    from fastrehearse.eval.results import per_category
    cat = per_category(ResultStore(tmp_path, {}).items())["mock"]
    assert cat["errors"] == 1 and cat["n"] == 0 and cat["accuracy"] is None   # not a 0% result

    sim = ScriptedUser(["Hi, I need help with my reservation.", "No, that is all.", "###STOP###"])
    try:   # the rerun (same store) retries the item against a reachable simulator: scored
        live = Tau2Suite(user_url=sim.url, user_model="openai/scripted-user", solo=False)
        [r] = run_items([("mock", task)], lambda c: live.make_env(), engine, ScriptedPolicy(_talker),
                        ResultStore(tmp_path, {}), HarnessConfig(batch_size=1))
        assert r.error is None and r.score == 1.0
    finally:
        sim.close()
    items = ResultStore(tmp_path, {}).items()
    assert len(items) == 1 and items[0].score == 1.0 and items[0].error is None


def test_evaluator_crash_is_an_error_retried_on_rerun(tmp_path, monkeypatch, engine):
    """tau2's evaluator crashing on an episode: the engine records it as the episode's score
    error, evaluation as an error (score None, not counted), and a rerun scores the item."""
    from fastrehearse.envs import get_suite
    from fastrehearse.envs.tau2 import import_tau2
    from fastrehearse.eval.results import per_category
    from fastrehearse.rollout.engine.policy import GoldPolicy

    suite = get_suite("tau2")
    task = suite.tasks("telecom", limit=1)[0]
    t2 = import_tau2()
    real = t2.evaluate_simulation

    def boom(**kw):
        raise ValueError("evaluator bug")

    monkeypatch.setattr(t2, "evaluate_simulation", boom)
    [r] = run_items([("telecom", task)], lambda c: suite.make_env(), engine, GoldPolicy(),
                    ResultStore(tmp_path, {}), HarnessConfig(batch_size=1))
    assert r.score is None and "Tau2ScoreError" in r.error and "evaluator bug" in r.error, r.error
    cat = per_category(ResultStore(tmp_path, {}).items())["telecom"]
    assert cat["errors"] == 1 and cat["n"] == 0 and cat["accuracy"] is None
    monkeypatch.setattr(t2, "evaluate_simulation", real)
    [r] = run_items([("telecom", task)], lambda c: suite.make_env(), engine, GoldPolicy(),
                    ResultStore(tmp_path, {}), HarnessConfig(batch_size=1))
    assert r.error is None and r.score == 1.0
