"""tau2-bench telecom (solo mode) through the eval harness, graded by tau2's own evaluator."""
import json

import pytest

pytest.importorskip("tau2")

from fastrehearse.eval import cli  # noqa: E402


def _res(out):
    return json.loads((out / "results.json").read_text())


def test_tau2_gold_scores_one_and_no_calls_scores_zero(tmp_path):
    out = tmp_path / "gold"
    assert cli.main(["--suite", "tau2", "--policy", "gold", "--limit", "3", "--out", str(out), "--quiet"]) == 0
    res = _res(out)
    assert res["categories"]["telecom"]["n"] == 3 and res["categories"]["telecom"]["accuracy"] == 1.0

    # deliberately wrong: the gold calls of *another* task (valid calls, wrong fixes) score 0
    from fastrehearse.envs import get_suite
    from fastrehearse.eval.harness import HarnessConfig, run_items
    from fastrehearse.eval.policies import GoldPolicy
    from fastrehearse.eval.results import ResultStore

    suite = get_suite("tau2")
    tasks = suite.tasks("telecom", 3)

    class Shifted(GoldPolicy):
        def act(self, states):
            for st in states:
                if "swapped" not in st.scratch:
                    i = [t.id for t in tasks].index(st.task.id)
                    st.scratch["swapped"] = tasks[(i + 1) % len(tasks)].gold
                st.task = type(st.task)(st.task.id, st.task.split, st.task.payload, st.scratch["swapped"])
            return super().act(states)

    class Silent:
        name = "silent"

        def act(self, states):
            return [{"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "done", "arguments": {}}}]} for _ in states]

    for pol in (Shifted(), Silent()):
        done = run_items([("telecom", t) for t in tasks], lambda c: suite.make_env(), pol,
                         ResultStore(tmp_path / type(pol).__name__, {}), HarnessConfig(batch_size=3))
        assert [r.score for r in done] == [0.0] * 3, pol.name


def test_tau2_tiny_model_two_tasks(tmp_path):
    out = tmp_path / "tiny"
    assert cli.main(["--suite", "tau2", "--policy", "tiny-llama", "--limit", "2", "--max-steps", "2",
                     "--max-new-tokens", "16", "--out", str(out), "--quiet"]) == 0
    res = _res(out)
    c = res["categories"]["telecom"]
    assert c["n"] == 2 and 0.0 <= c["accuracy"] <= 1.0 and c["errors"] == 0
    assert c["mean_gen_tokens"] > 0 and res["overall"] == c["accuracy"]



def test_tau2_conversational_reply_reaches_user_simulator(tmp_path, monkeypatch):
    """Conversational mode through the harness: each agent text reply goes to
    `env.next_user_message(reply)` (also through a DriftEnv), the simulated user's answer is the next
    user turn, the user's stop ends the episode and tau2 grades it. Solo mode has no simulator: a
    text reply ends the episode."""
    from test_env_tau2_usersim import ScriptedUser

    from fastrehearse.envs.tau2 import Tau2Suite
    from fastrehearse.eval.drift import DriftEnv, DriftSpec
    from fastrehearse.eval.harness import HarnessConfig, run_items
    from fastrehearse.eval.policies import GoldPolicy
    from fastrehearse.eval.results import ResultStore

    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    ASK = "Anything else I can do for you?"

    class Talker(GoldPolicy):
        """The gold calls, but one question of its own before the gold closing line."""
        def act(self, states):
            out = []
            for st in states:
                i = st.scratch.get("gold_i", 0)
                msg = super().act([st])[0]
                if not msg.get("tool_calls") and not st.scratch.get("asked"):
                    st.scratch["asked"], st.scratch["gold_i"] = True, i   # closing line next turn
                    msg = {"role": "assistant", "content": ASK}
                out.append(msg)
            return out

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

            [r] = run_items([("mock", task)], make_env, Talker(), ResultStore(tmp_path / f"conv{wrap}", {}),
                            HarnessConfig(batch_size=1, max_steps=8))
            sent = [body["messages"][-1]["content"] for _, body in sim.requests]
            assert len(sent) == 3, sent                       # greeting answer, then one per reply
            assert sent[1] == ASK and sent[2] == "Done."
            roles = [(m["role"], m.get("content")) for m in r.extra["transcript"]]
            assert ("user", "No, that is all.") in roles
            assert envs[0].user_stopped and r.error is None and r.steps == 3
            assert r.score == 1.0                              # tau2's evaluator: DB + communication
        finally:
            sim.close()

    class Chatty:
        name = "chatty"

        def act(self, states):
            return [{"role": "assistant", "content": ASK} for _ in states]

    solo = Tau2Suite()                                          # mock is solo by default: no user
    task = solo.tasks("mock", limit=1)[0]
    [r] = run_items([("mock", task)], lambda c: solo.make_env(), Chatty(), ResultStore(tmp_path / "solo", {}),
                    HarnessConfig(batch_size=1, max_steps=8))
    assert r.steps == 1 and r.score == 0.0 and r.error is None  # tau2 solo: text reply = agent error
