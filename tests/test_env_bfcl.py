"""BFCL v4 multi-turn environment: gold replays score 1.0 under BFCL's own checker, wrong
trajectories score 0, the call parser never lets model text reach eval(), episodes are isolated."""
from __future__ import annotations

import ast
import copy
import json
import math
import os
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("bfcl_eval")

from fastrehearse.envs import bfcl_compat  # noqa: E402
from fastrehearse.envs.base import Task, ToolCall, ToolResult, Trajectory  # noqa: E402
from fastrehearse.envs.bfcl import BfclEnv, BfclSuite, call_string, parse_call  # noqa: E402

SUITE = BfclSuite()


@pytest.fixture(scope="module")
def tasks():
    return {c: SUITE.tasks(c) for c in bfcl_compat.MULTI_TURN_CATEGORIES}


def run_turn_protocol(suite: BfclSuite, task: Task, drop: tuple[int, int] | None = None) -> tuple[float, Trajectory, BfclEnv]:
    """Play task.gold the way a rollout does: the first user turn comes from reset(), later turns
    only from env.next_user_message() when the assistant ends its turn; every tool call is executed
    for real. `drop=(turn, k)` skips the k-th gold call of that turn (a wrong trajectory)."""
    env = suite.make_env()
    res = env.reset(task)
    assert res.messages and res.messages[-1]["role"] == "user"
    traj = Trajectory()
    turn, k = 0, 0
    for m in task.gold:
        if m["role"] == "user":
            continue                       # user turns come from the environment, not the record
        if m["role"] == "tool":
            continue                       # tool responses come from the real environment
        if m.get("tool_calls"):
            if drop == (turn, k):
                k += 1
                continue
            k += 1
            traj.messages.append(copy.deepcopy(m))
            for tc in m["tool_calls"]:
                call = ToolCall(tc["function"]["name"], tc["function"]["arguments"])
                r = env.execute(call)
                assert r.ok, (task.id, call, r.content)
                traj.real_calls.append(call)
                traj.messages.append({"role": "tool", "name": call.name, "content": r.content})
        else:
            traj.messages.append(dict(m))
            nxt = env.next_user_message()
            if nxt is not None:
                traj.messages.append(nxt)
            turn, k = turn + 1, 0
    assert env.next_user_message() is None
    score = env.score(task, traj)
    env.close()
    return score, traj, env


def test_all_multi_turn_base_gold_scores_one(tasks):
    base = tasks["multi_turn_base"]
    assert len(base) == 200
    failing = [t.id for t in base if run_turn_protocol(SUITE, t)[0] != 1.0]
    assert failing == []


@pytest.mark.parametrize("cat", ["multi_turn_miss_func", "multi_turn_miss_param", "multi_turn_long_context"])
def test_other_categories_gold_scores_one(tasks, cat):
    assert len(tasks[cat]) == 200
    failing = [t.id for t in tasks[cat] if run_turn_protocol(SUITE, t)[0] != 1.0]
    assert failing == []


def test_generic_replay_helper_agrees(tasks):
    replay = pytest.importorskip("fastrehearse.envs.replay")
    for t in tasks["multi_turn_base"][:40] + tasks["multi_turn_miss_func"][:20]:
        r = replay.replay_gold(SUITE, t)
        assert r.score == 1.0, t.id
        assert r.mismatches == [], t.id     # gold tool messages are the real responses


def test_dropped_call_scores_zero(tasks):
    checked = 0
    for t in tasks["multi_turn_base"][::10] + tasks["multi_turn_miss_param"][::25]:
        gt = t.payload["ground_truth"]
        last = max(i for i, calls in enumerate(gt) if calls)
        score, _, _ = run_turn_protocol(SUITE, t, drop=(last, len(gt[last]) - 1))
        assert score == 0.0, t.id
        checked += 1
    assert checked == 28


def test_wrong_argument_and_missing_turn_score_zero(tasks):
    t = tasks["multi_turn_base"][0]
    _, traj, _ = run_turn_protocol(SUITE, t)
    env = SUITE.make_env()
    env.reset(t)
    assert env.score(t, traj) == 1.0
    bad = copy.deepcopy(traj)
    first = next(m for m in bad.messages if m.get("tool_calls"))
    assert first["tool_calls"][0]["function"] == {"name": "cd", "arguments": {"folder": "document"}}
    first["tool_calls"][0]["function"]["arguments"]["folder"] = "archive"
    assert env.score(t, bad) == 0.0
    # Stopping before the last user turn: BFCL fails a run whose turn count differs.
    last_user = max(i for i, m in enumerate(traj.messages) if m["role"] == "user")
    short = Trajectory(messages=traj.messages[:last_user])
    assert env.check(t, short)["error_type"] == "multi_turn:force_terminated"
    assert env.score(t, short) == 0.0


def test_turn_protocol_and_miss_func_tools(tasks):
    t = tasks["multi_turn_miss_func"][0]
    env = SUITE.make_env()
    res = env.reset(t)
    names = {s["function"]["name"] for s in res.tools}
    assert "sort" not in names and "mv" in names          # held out until turn 3
    assert res.tools[0]["type"] == "function" and res.tools[0]["function"]["parameters"]["type"] == "object"
    msgs = [env.next_user_message() for _ in range(4)]
    assert env.next_user_message() is None
    assert msgs[2]["role"] == "user" and "I have updated some more functions" in msgs[2]["content"]
    assert '"sort"' in msgs[2]["content"]                   # the new schema is shown in the message
    assert "sort" in {s["function"]["name"] for s in env.tools}
    assert t.payload["user_turns"] == msgs and [len(a) for a in t.payload["added_tools"]] == [0, 0, 1, 0]


def test_execute_matches_bfcl_behaviour_and_never_raises(tasks):
    t = tasks["multi_turn_base"][0]
    env = SUITE.make_env()
    env.reset(t)
    assert env.execute(ToolCall("cd", {"folder": "document"})).ok
    r = env.execute(ToolCall("cd", {"folder": "no_such_dir"}))
    assert isinstance(r, ToolResult) and "No such" in r.content
    cases = [
        (ToolCall("rm_rf", {}), "unknown_tool"),
        (ToolCall("cd", {"nope": 1}), "bad_arguments"),
        (ToolCall("cd", {}), "bad_arguments"),                           # required missing
        (ToolCall("cd", "{not json"), "bad_arguments"),
        (ToolCall("cd", ["document"]), "bad_arguments"),
        (ToolCall("cd", {"folder": math.nan}), "bad_arguments"),
        (ToolCall("cd", {"folder": object()}), "bad_arguments"),
        (ToolCall("_load_scenario", {}), "unknown_tool"),                  # private method
        (ToolCall("__class__", {}), "unknown_tool"),
        (ToolCall(None, None), "unknown_tool"),
    ]
    for call, kind in cases:
        r = env.execute(call)
        assert not r.ok and r.error_kind == kind, (call, r)
    assert env.execute(ToolCall("cd", '{"folder": ".."}')).ok            # JSON-string arguments
    env.close()


def test_model_text_never_reaches_eval(tmp_path, tasks):
    """A call whose argument text is Python code stays a string literal in execute and in score."""
    t = tasks["multi_turn_base"][0]
    sentinel = tmp_path / "pwned"
    payload = f"x') or __import__('os').system('touch {sentinel}') or ('"
    env = SUITE.make_env()
    env.reset(t)
    r = env.execute(ToolCall("mkdir", {"dir_name": payload}))
    assert r.ok
    name, kwargs = parse_call(ToolCall("mkdir", {"dir_name": payload}), env.docs, env.methods)
    node = ast.parse(call_string(name, kwargs), mode="eval").body   # what the checker will eval
    assert isinstance(node, ast.Call) and node.func.id == "mkdir" and not node.args
    assert {k.arg: ast.literal_eval(k.value) for k in node.keywords} == {"dir_name": payload}
    traj = Trajectory(messages=[{"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "mkdir", "arguments": {"dir_name": payload}}},
        {"type": "function", "function": {"name": "__import__('os').system", "arguments": {}}}]}])
    traj.messages += [{"role": "user", "content": "next"}] * (len(t.payload["ground_truth"]) - 1)
    assert env.score(t, traj) == 0.0
    assert not sentinel.exists()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.one_of(st.sampled_from(["cd", "ls", "mv", "echo", "grep", "post_tweet", "eval", ""]), st.text(max_size=12)),
       args=st.one_of(st.text(max_size=30), st.none(), st.integers(),
                      st.dictionaries(st.text(max_size=10), st.recursive(
                          st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=10)),
                          lambda c: st.one_of(st.lists(c, max_size=3), st.dictionaries(st.text(max_size=5), c, max_size=3)),
                          max_leaves=8), max_size=4)))
def test_fuzz_execute_and_score_never_raise(tasks, name, args):
    t = tasks["multi_turn_base"][0]
    env = SUITE.make_env()
    env.reset(t)
    r = env.execute(ToolCall(name, args))
    assert isinstance(r, ToolResult) and isinstance(r.content, str)
    traj = Trajectory(messages=[{"role": "assistant", "tool_calls": [{"function": {"name": name, "arguments": args}}]}])
    assert env.score(t, traj) in (0.0, 1.0)


def test_instances_isolated_and_freed(tasks):
    t = tasks["multi_turn_base"][0]
    a, b = SUITE.make_env(), SUITE.make_env()
    a.reset(t)
    b.reset(t)
    assert a.execute(ToolCall("mkdir", {"dir_name": "only_in_a"})).ok
    assert "only_in_a" in a.execute(ToolCall("ls", {})).content
    assert "only_in_a" not in b.execute(ToolCall("ls", {})).content
    score, _, _ = run_turn_protocol(SUITE, t)
    assert score == 1.0
    g = bfcl_compat.import_bfcl().multi_turn_utils.__dict__
    assert [k for k in g if k.startswith(bfcl_compat.CHECKER_MODEL_NAME)] == []
    a.close()
    assert a.instances == {} and a.methods == {}


def test_suite_arguments():
    assert [t.id for t in SUITE.tasks("base", limit=3)] == [f"multi_turn_base_{i}" for i in range(3)]
    with pytest.raises(ValueError, match="split"):
        SUITE.tasks("simple_python")
    with pytest.raises(ValueError, match="limit"):
        SUITE.tasks("base", limit=-1)
    with pytest.raises(ValueError, match="task"):
        SUITE.make_env().reset(Task(id="x", split="test", payload={}))
    gold = SUITE.tasks("base", limit=1)[0].gold
    assert json.loads(json.dumps(gold)) == gold              # gold messages are plain JSON


def test_split_grammar_and_one_line_errors():
    """`<categories>[:train|:test]`: all four categories (multi_turn), comma lists, the fixed 80/20
    hold-out (disjoint, every entry in exactly one part), round-robin interleaving under a limit;
    a bad category or part is a one-line ValueError naming it and the allowed values."""
    suite = BfclSuite(with_gold=False)
    train, test = suite.tasks("multi_turn:train"), suite.tasks("multi_turn:test")
    assert (len(train), len(test)) == (640, 160)
    assert {t.id for t in train}.isdisjoint(t.id for t in test)
    assert len({t.id for t in train} | {t.id for t in test}) == 800
    assert [t.split for t in suite.tasks("multi_turn", limit=4)] == list(bfcl_compat.MULTI_TURN_CATEGORIES)
    assert [t.id for t in suite.tasks("base,miss_param:test", limit=3)] == [
        "multi_turn_base_4", "multi_turn_miss_param_4", "multi_turn_base_9"]
    for bad, named in (("simple_python", "'simple_python'"), ("base:val", "'val'"),
                       ("base,nope", "'nope'"), ("", "''")):
        with pytest.raises(ValueError) as e:
            suite.tasks(bad)
        msg = str(e.value)
        assert named in msg and "\n" not in msg and ("multi_turn_base" in msg or "train" in msg), msg


def test_compat_shim():
    root = bfcl_compat.install_shim()
    assert os.environ["BFCL_PROJECT_ROOT"] == root and os.access(root, os.W_OK)
    stand_in = sys.modules["bfcl_eval.constants.model_config"]
    assert stand_in.MODEL_CONFIG_MAPPING["any/model"].underscore_to_dot is False
    assert callable(bfcl_compat.import_bfcl().ast_checker)
    tool = bfcl_compat.func_doc_to_tool({"name": "f", "description": "d", "parameters": {
        "type": "dict", "properties": {"x": {"type": "float"}, "y": {"type": "dict", "properties": {
            "z": {"type": "tuple", "items": {"type": "integer"}}}}}, "required": ["x"]}})
    p = tool["function"]["parameters"]
    assert p["type"] == "object" and p["properties"]["x"]["type"] == "number"
    assert p["properties"]["y"]["type"] == "object"
    assert p["properties"]["y"]["properties"]["z"]["type"] == "array"
    assert p["properties"]["y"]["properties"]["z"]["items"] == {"type": "integer"}
    with pytest.raises(ValueError, match="category"):
        bfcl_compat.load_entries("nope")


def test_resource_bounds_on_math_api(tasks):
    """Model-chosen exponents/precisions that would make BFCL's MathAPI run unbounded are refused."""
    t = next(t for t in tasks["multi_turn_base"] if "MathAPI" in t.payload["entry"]["involved_classes"])
    env = SUITE.make_env()
    env.reset(t)
    assert env.execute(ToolCall("power", {"base": 2, "exponent": 10})).content == '{"result": 1024}'
    for call in (ToolCall("power", {"base": 10, "exponent": 10 ** 9}),
                 ToolCall("square_root", {"number": 2, "precision": 10 ** 8}),
                 ToolCall("logarithm", {"value": 2, "base": 3, "precision": 10 ** 8})):
        r = env.execute(call)
        assert not r.ok and r.error_kind == "bad_arguments" and "<= 1000" in r.content
    deep = "[" * 100000 + "]" * 100000
    assert env.execute(ToolCall("mean", deep)).error_kind == "bad_arguments"
