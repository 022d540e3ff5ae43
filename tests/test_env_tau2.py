"""tau2-bench environment: gold replays score 1.0 under tau2's own evaluator (telecom solo sample,
all mock solo tasks), wrong trajectories score 0, bad calls never raise, airline/retail are off
without a user simulator."""
from __future__ import annotations

import copy
import json
import re

import pytest

pytest.importorskip("tau2")

from fastrehearse.envs.base import Task, ToolCall, ToolResult, Trajectory  # noqa: E402
from fastrehearse.envs.tau2 import STOP_TOKEN, Tau2Suite, gold_messages  # noqa: E402

SUITE = Tau2Suite(user_url=None)


def play(suite: Tau2Suite, task: Task, messages: list[dict]) -> tuple[float, Trajectory]:
    """Execute the assistant calls in `messages` for real (tool messages regenerated), then score."""
    env = suite.make_env()
    env.reset(task)
    traj = Trajectory()
    for m in messages:
        if m["role"] == "tool":
            continue
        traj.messages.append(copy.deepcopy(m))
        for tc in m.get("tool_calls") or []:
            call = ToolCall(tc["function"]["name"], tc["function"]["arguments"])
            r = env.execute(call)
            traj.real_calls.append(call)
            traj.messages.append({"role": "tool", "name": call.name, "content": r.content})
    score = env.score(task, traj)
    env.close()
    return score, traj


@pytest.fixture(scope="module")
def telecom():
    # Every 19th task of the 114 plus one with an ACTION reward basis (gold needs a tau2
    # environment per task and each replay builds four: ~0.7 s a task on a busy 2-core box).
    tasks = Tau2Suite(with_gold=False).tasks("telecom")
    assert len(tasks) == 114
    sample = tasks[::19] + [tasks[37]]
    for t in sample:
        t.gold = gold_messages(t.payload["tau2_task"], "telecom", True)
    return sample


def test_telecom_gold_sample_scores_one(telecom):
    assert len(telecom) == 7
    bases = set()
    for t in telecom:
        score, traj = play(SUITE, t, t.gold)
        assert score == 1.0, t.id
        assert traj.messages[-2]["tool_calls"][0]["function"]["name"] == "done"
        bases.add(tuple(sorted(b.value for b in t.payload["tau2_task"].evaluation_criteria.reward_basis)))
    assert ("ACTION", "ENV_ASSERTION") in bases and ("ENV_ASSERTION",) in bases


def test_mock_gold_all_score_one():
    tasks = SUITE.tasks("mock")
    assert len(tasks) == 6           # tau2's mock tasks valid for solo (a ticket + actions/initial state)
    for t in tasks:
        assert play(SUITE, t, t.gold)[0] == 1.0, t.id


def test_generic_replay_helper_agrees(telecom):
    replay = pytest.importorskip("fastrehearse.envs.replay")
    for t in telecom[:3]:
        r = replay.replay_gold(SUITE, t)
        assert r.score == 1.0 and r.mismatches == [], t.id


def test_wrong_trajectories_score_zero(telecom):
    zeroed = 0
    for t in telecom[::3]:
        gold = t.gold
        # No stop: tau2 scores a run that never called `done` as premature termination.
        assert play(SUITE, t, gold[:-2])[0] == 0.0, t.id
        # A solo text reply instead of `done` is an agent error in tau2.
        assert play(SUITE, t, gold[:-2] + [{"role": "assistant", "content": "All fixed."}])[0] == 0.0
        # Only `done`: the ticket's required state changes never happened.
        assert play(SUITE, t, gold[-2:])[0] == 0.0, t.id
        zeroed += 1
    # Dropping the last state-changing action of a task with 3+ actions.
    t = next(t for t in telecom if len(t.payload["tau2_task"].evaluation_criteria.actions) >= 3)
    calls = [i for i, m in enumerate(t.gold) if m.get("tool_calls")][:-1]
    dropped = [m for j, m in enumerate(t.gold) if j not in (calls[-1], calls[-1] + 1)]
    assert play(SUITE, t, dropped)[0] == 0.0
    assert zeroed == 3


def test_rehearsed_tool_messages_do_not_change_the_score(telecom):
    """score() re-executes calls: fabricated tool responses in the trajectory are ignored."""
    t = telecom[0]
    _, traj = play(SUITE, t, t.gold)
    fake = copy.deepcopy(traj)
    for m in fake.messages:
        if m["role"] == "tool":
            m["content"] = '{"status": "made up by the world model"}'
    env = SUITE.make_env()
    env.reset(t)
    assert env.score(t, fake) == 1.0


def test_reset_tools_and_prompt(telecom):
    t = telecom[0]
    env = SUITE.make_env()
    res = env.reset(t)
    names = [s["function"]["name"] for s in res.tools]
    assert "done" in names and "toggle_airplane_mode" in names and "get_customer_by_phone" in names
    assert all(s["type"] == "function" and "parameters" in s["function"] for s in res.tools)
    json.dumps(res.tools)
    assert res.messages[0]["role"] == "system" and t.payload["tau2_task"].ticket in res.messages[0]["content"]
    assert res.messages[-1]["role"] == "user"
    assert env.next_user_message() is None            # solo: no user
    assert env.execute(ToolCall("done", {})).content == STOP_TOKEN and env.finished


def test_execute_never_raises(telecom):
    env = SUITE.make_env()
    env.reset(telecom[0])
    cases = [(ToolCall("nope", {}), "unknown_tool"), (ToolCall(None, {}), "unknown_tool"),
             (ToolCall("get_customer_by_phone", "{bad json"), "bad_arguments"),
             (ToolCall("get_customer_by_phone", [1, 2]), "bad_arguments"),
             (ToolCall("get_customer_by_phone", {"zzz": 1}), "bad_arguments"),
             (ToolCall("get_customer_by_phone", {}), "env_error"),                  # missing arg
             (ToolCall("get_customer_by_phone", {"phone_number": {"x": [1]}}), "env_error")]
    for call, kind in cases:
        r = env.execute(call)
        assert isinstance(r, ToolResult) and not r.ok and r.error_kind == kind, (call, r)
    ok = env.execute(ToolCall("get_customer_by_phone", '{"phone_number": "555-123-2002"}'))
    assert ok.ok and "John" in ok.content
    bad = Trajectory(messages=[{"role": "assistant", "tool_calls": [{"function": {"name": 3, "arguments": "x"}}]},
                               {"role": "assistant", "tool_calls": [{"function": {"name": "done"}}]}])
    assert env.score(telecom[0], bad) == 0.0


def test_user_simulator_domains_off_without_endpoint(monkeypatch):
    monkeypatch.delenv("FASTREHEARSE_TAU2_USER_URL", raising=False)
    suite = Tau2Suite()
    for split in ("airline", "retail:test"):
        with pytest.raises(ValueError, match="user simulator"):
            suite.tasks(split)
    with pytest.raises(ValueError, match="no solo mode"):
        Tau2Suite(solo=True).tasks("airline")
    with pytest.raises(ValueError, match="split"):
        suite.tasks("telecom:nope")
    with pytest.raises(ValueError, match="unknown tau2 domain"):
        suite.tasks("banking")
    with pytest.raises(ValueError, match="task"):
        suite.make_env().reset(Task(id="x", split="telecom", payload={}))
    assert [t.id for t in Tau2Suite(with_gold=False).tasks("telecom:test", limit=2)][0].startswith("telecom/")


def test_evaluator_crash_is_an_error_not_a_zero(telecom, monkeypatch):
    """tau2's evaluate_simulation raising is not a grade: score raises Tau2ScoreError naming the
    task and the cause (a 0.0 would record a failure of the checker as the agent's score)."""
    from fastrehearse.envs.tau2 import Tau2ScoreError, import_tau2

    task = telecom[0]
    env = SUITE.make_env()
    env.reset(task)
    traj = Trajectory(messages=[m for m in task.gold if m["role"] == "assistant"])

    def boom(**kw):
        raise KeyError("reward_basis")

    monkeypatch.setattr(import_tau2(), "evaluate_simulation", boom)
    with pytest.raises(Tau2ScoreError, match=re.escape(f"{task.id}: KeyError: 'reward_basis'")):
        env.score(task, traj)
