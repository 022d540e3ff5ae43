"""The `consistent` training reward on BFCL multi-turn (envs/bfcl.py `consistent_score`): calls only,
nothing executed. Gold trajectories score 1 in every category; a missing call, a wrong argument the
user wrote, a call in a turn that must have none, or a missing turn score 0; an argument the ground
truth took from a tool response is matched by function name only."""
from __future__ import annotations

import copy

import pytest

pytest.importorskip("bfcl_eval")

from fastrehearse.envs import bfcl_compat  # noqa: E402
from fastrehearse.envs.base import Trajectory  # noqa: E402
from fastrehearse.envs.bfcl import (BfclSuite, _visible, consistent_score, make_instances,  # noqa: E402
                                    parse_gold_call, public_methods)

SUITE = BfclSuite()


@pytest.fixture(scope="module")
def tasks():
    return {c: SUITE.tasks(c, limit=40) for c in bfcl_compat.MULTI_TURN_CATEGORIES}


def _calls(task):
    """(message index, name, visible?) of every gold call, with the text the user had written."""
    methods = public_methods(make_instances(task.payload["entry"]))
    out, text, t = [], "", 0
    text = " ".join(m["content"] for m in task.payload["entry"]["question"][0]).casefold()
    for i, m in enumerate(task.gold):
        if m["role"] == "user":
            t += 1
            text += " " + " ".join(x["content"] for x in task.payload["entry"]["question"][t]).casefold()
        for tc in m.get("tool_calls") or []:
            fn = tc["function"]
            out.append((i, fn["name"], _visible(fn["arguments"], text)))
    return out


def test_gold_scores_one_and_is_the_suites_consistent_mode(tasks):
    for cat, ts in tasks.items():
        for task in ts:
            traj = Trajectory(messages=task.gold)
            assert consistent_score(task, traj) == 1.0, (cat, task.id)
    task = tasks["multi_turn_base"][0]
    assert SUITE.task_reward(task, Trajectory(messages=task.gold), "consistent") == 1.0
    with pytest.raises(ValueError, match="no reward mode 'calls'"):
        SUITE.task_reward(task, Trajectory(messages=task.gold), "calls")


def test_dropped_call_and_missing_turn_score_zero(tasks):
    task = tasks["multi_turn_base"][0]
    i = _calls(task)[0][0]
    assert consistent_score(task, Trajectory(messages=task.gold[:i] + task.gold[i + 2:])) == 0.0
    last_user = max(k for k, m in enumerate(task.gold) if m["role"] == "user")
    assert consistent_score(task, Trajectory(messages=task.gold[:last_user])) == 0.0


def test_visible_argument_must_match_hidden_one_by_name(tasks):
    checked = {"visible": 0, "hidden": 0}
    for task in tasks["multi_turn_base"]:
        for i, name, visible in _calls(task):
            fn = task.gold[i]["tool_calls"][0]["function"]
            strings = [k for k, v in fn["arguments"].items() if isinstance(v, str) and v]
            if not strings or checked["visible" if visible else "hidden"] >= 3:
                continue
            gold = copy.deepcopy(task.gold)
            gold[i]["tool_calls"][0]["function"]["arguments"][strings[0]] += "_zz"
            want = 0.0 if visible else 1.0
            assert consistent_score(task, Trajectory(messages=gold)) == want, (task.id, name, visible)
            checked["visible" if visible else "hidden"] += 1
    assert checked == {"visible": 3, "hidden": 3}


def test_a_call_in_a_turn_that_must_have_none_scores_zero(tasks):
    task = next(t for t in tasks["multi_turn_miss_param"] if any(not c for c in t.payload["ground_truth"]))
    blocked = next(k for k, c in enumerate(task.payload["ground_truth"]) if not c)
    any_call = next(m for m in task.gold if m.get("tool_calls"))
    users = [k for k, m in enumerate(task.gold) if m["role"] == "user"]
    at = users[blocked - 1] + 1 if blocked else 0          # the blocked turn's first message
    gold = task.gold[:at] + [copy.deepcopy(any_call), {"role": "tool", "content": "ok"}] + task.gold[at:]
    assert consistent_score(task, Trajectory(messages=gold)) == 0.0
