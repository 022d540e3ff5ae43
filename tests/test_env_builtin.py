"""The builtin suite: gold trajectories score 1, wrong ones 0, disjoint deterministic splits, and bad
calls never raise."""
import copy
import json
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastrehearse.envs import Task, ToolCall, Trajectory, get_suite, replay, replay_gold
from fastrehearse.envs.builtin import SCHEMAS, BuiltinSuite
from fastrehearse.envs.builtin.scoring import check_answer, numbers_in
from fastrehearse.envs.builtin.world import make_world

SUITE = BuiltinSuite(level="all")
SAMPLE = SUITE.tasks("train", 160) + SUITE.tasks("test", 160)   # 80 tasks per level, both splits


def _calls(task):
    """(message index, call index, call) of every gold tool call."""
    return [(i, j, tc) for i, m in enumerate(task.gold) for j, tc in enumerate(m.get("tool_calls") or [])]


def _is_required(task, tc):
    fn = tc["function"]
    return {"name": fn["name"], "arguments": fn["arguments"]} in task.payload["required_calls"]


def _drop_call(gold, i, j):
    """Gold without call j of message i (and its tool response)."""
    out, tool_pos = [], None
    for k, m in enumerate(gold):
        if k == i:
            m = copy.deepcopy(m)
            del m["tool_calls"][j]
            tool_pos = (k + 1 + j)            # tool responses follow the calls in order
            if not m["tool_calls"]:
                continue
        if k == tool_pos:
            continue
        out.append(m)
    return out


def test_gold_replays_score_one_on_every_sampled_task():
    assert {t.payload["level"] for t in SAMPLE} == {0, 1, 2, 3}
    for task in SAMPLE:
        r = replay_gold(SUITE, task)
        assert r.score == 1.0, (task.id, task.payload["template"])
        assert r.mismatches == [], task.id            # the env reproduces the gold tool responses
        assert all(res.ok for res in r.results), task.id


def test_call_counts_by_level():
    counts = {}
    for task in SAMPLE:
        counts.setdefault(task.payload["level"], set()).add(task.payload["n_calls"])
        assert task.payload["n_calls"] == len(_calls(task))
    assert counts[0] == {1} and counts[1] == {1} and counts[2] == {2}
    assert min(counts[3]) >= 3 and max(counts[3]) <= 5
    # level 3 changes the database in (almost) every task
    changed = [t for t in SAMPLE if t.payload["level"] == 3
               and any(tc["function"]["name"] in ("transfer", "place_order", "cancel_order", "create_event")
                       for _, _, tc in _calls(t))]
    assert len(changed) >= 0.8 * sum(t.payload["level"] == 3 for t in SAMPLE)


def _wrong_answer(spec):
    if spec["kind"] == "number":
        v = spec["value"]
        return f"The answer is {v + max(1.0, 10 * spec['abs_tol'], 0.1 * abs(v)):.2f}."
    if spec["kind"] == "token":
        return "The answer is XY0000." if ":" not in spec["value"] else "It now starts at 23:30."
    other = next(o for o in spec["options"] if o != spec["value"])
    return f"It is {other}."


def test_wrong_final_answer_scores_zero():
    n = 0
    for task in SAMPLE:
        if "answer" not in task.payload["checks"]:
            continue
        bad = task.gold[:-1] + [{"role": "assistant", "content": _wrong_answer(task.payload["answer"])}]
        assert replay(SUITE, task, bad).score == 0.0, task.id
        # naming every option of a status/location question is not an answer
        if task.payload["answer"]["kind"] == "choice":
            text = "It is " + " or ".join(task.payload["answer"]["options"])
            assert replay(SUITE, task, task.gold[:-1] + [{"role": "assistant", "content": text}]).score == 0.0
        # ending on a tool call (no final answer) fails too
        assert replay(SUITE, task, task.gold[:-1]).score == 0.0, task.id
        n += 1
    assert n >= 200


def test_skipped_call_scores_zero():
    for task in SAMPLE:
        for i, j, tc in _calls(task):
            if _is_required(task, tc):
                assert replay(SUITE, task, _drop_call(task.gold, i, j)).score == 0.0, (task.id, tc)


def _other_value(world, value):
    """A different but *valid* value of the same kind, so the wrong call usually succeeds."""
    if isinstance(value, (int, float)):
        return value + 1
    for table in ("accounts", "customers", "products", "orders", "events"):
        if value in world[table]:
            return next(k for k in sorted(world[table]) if k != value)
    names = sorted({a["owner"] for a in world["accounts"].values()} | {c["name"] for c in world["customers"].values()})
    if value in names:
        return next(n for n in names if n != value)
    dates = sorted({e["date"] for e in world["events"].values()})
    if value in dates:
        return next(d for d in dates if d != value)
    return value + "x"


def test_wrong_argument_scores_zero():
    for task in SAMPLE:
        world = make_world(task.payload["world_seed"])
        for i, j, tc in _calls(task):
            if not _is_required(task, tc):
                continue
            for arg, value in tc["function"]["arguments"].items():
                bad = copy.deepcopy(task.gold)
                bad[i]["tool_calls"][j]["function"]["arguments"][arg] = _other_value(world, value)
                assert replay(SUITE, task, bad).score == 0.0, (task.id, tc, arg)


def test_extra_state_change_scores_zero():
    task = next(t for t in SAMPLE if t.payload["template"] == "balance_by_owner")
    world = make_world(task.payload["world_seed"])
    a, b = sorted(world["accounts"])[:2]
    extra = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
        "name": "transfer", "arguments": {"from_account_id": a, "to_account_id": b, "amount": 1.0}}}]}
    assert replay(SUITE, task, [extra] + task.gold).score == 0.0


def test_score_grades_calls_not_imagined_responses():
    """Rehearse mode: the tool messages are the model's own guesses; the score replays the calls."""
    for task in SAMPLE[:40]:
        traj = Trajectory(messages=[{**m, "content": '{"made":"up"}'} if m["role"] == "tool" else m
                                    for m in task.gold])
        assert SUITE.make_env().score(task, traj) == 1.0
        # calls recorded only as real_calls (no tool_calls in messages) are graded too
        calls = [ToolCall(tc["function"]["name"], tc["function"]["arguments"]) for _, _, tc in _calls(task)]
        traj = Trajectory(messages=[task.gold[-1]], real_calls=calls)
        assert SUITE.make_env().score(task, traj) == 1.0


def test_splits_disjoint_and_deterministic():
    train, test = SUITE.tasks("train", 400), SUITE.tasks("test", 200)
    assert all(t.split == "train" for t in train) and all(t.split == "test" for t in test)
    assert all(t.payload["world_seed"] % 2 == 0 for t in train)
    assert all(t.payload["world_seed"] % 2 == 1 for t in test)
    combos = lambda ts: {json.dumps(t.payload["combo"]) for t in ts}
    assert not combos(train) & combos(test)
    assert not {t.payload["prompt"] for t in train} & {t.payload["prompt"] for t in test}
    assert len({t.id for t in train + test}) == 600
    again = BuiltinSuite(level="all")
    for a, b in zip(train[:50] + test[:50], again.tasks("train", 50) + again.tasks("test", 50)):
        assert (a.id, a.payload, a.gold) == (b.id, b.payload, b.gold)
    other = BuiltinSuite(level="all", seed=1).tasks("train", 50)
    assert sum(a.payload["prompt"] == b.payload["prompt"] for a, b in zip(train, other)) < 5


def test_easy_level():
    suite = BuiltinSuite(level="easy")
    tasks = suite.tasks("train", 30)
    for task in tasks:
        assert task.payload["level"] == 0 and len(task.payload["tools"]) == 1
        tool = task.payload["tools"][0]
        arg, val = next(iter(task.gold[0]["tool_calls"][0]["function"]["arguments"].items()))
        assert tool in task.payload["prompt"] and str(val) in task.payload["prompt"]
        env = suite.make_env()
        reset = env.reset(task)
        assert [s["function"]["name"] for s in reset.tools] == [tool]
        assert reset.messages[-1] == {"role": "user", "content": task.payload["prompt"]}
        # success = the spelled-out call was made; the answer is optional at this level
        assert replay(suite, task, task.gold[:1]).score == 1.0
        wrong = copy.deepcopy(task.gold[:1])
        wrong[0]["tool_calls"][0]["function"]["arguments"][arg] = val + "x"
        assert replay(suite, task, wrong).score == 0.0
        wrong[0]["tool_calls"][0]["function"]["name"] = "check_balance"
        assert replay(suite, task, wrong).score == 0.0
        assert replay(suite, task, [{"role": "assistant", "content": "done"}]).score == 0.0
    strict = BuiltinSuite(level="easy", easy_answer=True)
    for task in strict.tasks("train", 10):
        assert replay_gold(strict, task).score == 1.0
        assert replay(strict, task, task.gold[:2]).score == 0.0


def test_bad_calls_return_errors():
    task = next(t for t in SAMPLE if t.payload["template"] == "transfer_between_owners")
    env = SUITE.make_env()
    assert env.execute(ToolCall("get_balance", {"account_id": "AC1"})).error_kind == "env_error"  # no reset
    env.reset(task)
    acc = sorted(env.world["accounts"])
    cases = [
        (ToolCall("rm_rf", {}), "unknown_tool"),
        (ToolCall("check_stock", {"sku": "SK1"}), "unknown_tool"),          # not exposed for this task
        (ToolCall("get_balance", {}), "bad_arguments"),
        (ToolCall("get_balance", {"account_id": 5}), "bad_arguments"),
        (ToolCall("get_balance", {"account_id": "AC1", "x": 1}), "bad_arguments"),
        (ToolCall("transfer", {"from_account_id": acc[0], "to_account_id": acc[1], "amount": "5"}), "bad_arguments"),
        (ToolCall("transfer", {"from_account_id": acc[0], "to_account_id": acc[1], "amount": 10**400}),
         "bad_arguments"),
        (ToolCall("transfer", {"from_account_id": acc[0], "to_account_id": acc[1], "amount": float("nan")}),
         "bad_arguments"),
        (ToolCall("get_balance", "AC0000"), "bad_arguments"),
        (ToolCall("get_balance", {"account_id": "AC0000"}), "domain_error"),
        (ToolCall("transfer", {"from_account_id": acc[0], "to_account_id": acc[1], "amount": 1e9}), "domain_error"),
        (ToolCall("transfer", {"from_account_id": acc[0], "to_account_id": acc[0], "amount": 1}), "domain_error"),
    ]
    before = json.dumps(env.world, sort_keys=True)
    for call, kind in cases:
        res = env.execute(call)
        assert (res.ok, res.error_kind) == (False, kind), call
        assert "error" in json.loads(res.content)
    assert json.dumps(env.world, sort_keys=True) == before        # failed calls change nothing


def test_numbers_and_answers():
    assert numbers_in("On 2026-03-04 at 14:00, AC1234 had 1,234.50 USD and -5 points, 3.") == [1234.5, -5, 3]
    assert check_answer({"kind": "token", "value": "OR9001"}, "order or9001 placed")
    assert not check_answer({"kind": "token", "value": "OR9001"}, "order OR90012")
    assert not check_answer({"kind": "token", "value": "10:00"}, "at 10:00:30")
    assert check_answer({"kind": "number", "value": 19.3121, "abs_tol": 0.01, "rel_tol": 0.005}, "about 19.3 km")
    assert not check_answer({"kind": "number", "value": 7, "abs_tol": 0, "rel_tol": 0}, "7.5 units")


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.sampled_from([10**400, -10**20, 1e300]) | st.floats() | st.text(max_size=8),
                    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3),
                    max_leaves=8)
ARGS = st.one_of(
    st.dictionaries(st.sampled_from(sorted({a for s in SCHEMAS.values()
                                            for a in s["function"]["parameters"]["properties"]}) + ["zz"]),
                    JSON, max_size=4),
    st.dictionaries(st.text(max_size=6), JSON, max_size=3), JSON)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.one_of(st.sampled_from(sorted(SCHEMAS)), st.text(max_size=12), st.integers(), st.none()),
       args=ARGS, k=st.integers(0, len(SAMPLE) - 1))
def test_fuzz_execute_never_raises(name, args, k):
    task = SAMPLE[k]
    env = SUITE.make_env()
    env.reset(task)
    res = env.execute(ToolCall(name, args))
    payload = json.loads(res.content)
    if not res.ok:
        assert res.error_kind in ("unknown_tool", "bad_arguments", "domain_error") and "error" in payload
    assert res.error_kind != "env_error", res.content              # no handler bug reached
    json.dumps(env.world, sort_keys=True, allow_nan=False)         # state stays serializable


@settings(max_examples=60, deadline=None)
@given(msgs=st.lists(st.one_of(JSON, st.fixed_dictionaries({
    "role": st.sampled_from(["assistant", "tool", "user"]), "content": JSON,
    "tool_calls": st.lists(st.one_of(JSON, st.fixed_dictionaries({"function": st.fixed_dictionaries({
        "name": st.sampled_from(sorted(SCHEMAS)), "arguments": ARGS})})), max_size=3)})), max_size=5))
def test_fuzz_score_never_raises(msgs):
    msgs = [m for m in msgs if isinstance(m, dict)]
    score = SUITE.make_env().score(SAMPLE[3], Trajectory(messages=msgs))
    assert score in (0.0, 1.0)


def test_registry_and_options():
    assert isinstance(get_suite("builtin", level="easy"), BuiltinSuite)
    with pytest.raises(ValueError, match="unknown suite 'nope'"):
        get_suite("nope")
    with pytest.raises(ValueError, match="levle"):
        get_suite("builtin", levle=1)
    with pytest.raises(ValueError, match="level="):
        BuiltinSuite(level="impossible")
    with pytest.raises(ValueError, match="tools="):
        BuiltinSuite(tools="some")
    with pytest.raises(ValueError, match="split="):
        SUITE.tasks("dev")
    assert BuiltinSuite(level="1,3").levels == (1, 3) and BuiltinSuite(level=2).levels == (2,)
    assert BuiltinSuite(tools="all").task("train", 1).payload["tools"] == list(SCHEMAS)
    small = BuiltinSuite(tools="task")
    for i in range(12):
        t = small.task("train", i)
        assert set(t.payload["tools"]) == {tc["function"]["name"] for m in t.gold for tc in m.get("tool_calls") or []}
        assert replay_gold(small, t).score == 1.0
    assert BuiltinSuite(level="easy", tools="domain").task("train", 0).payload["tools"] != \
        BuiltinSuite(level="easy").task("train", 0).payload["tools"]
    with pytest.raises(ValueError, match="no gold"):
        replay_gold(SUITE, Task(id="x", split="train", payload={}, gold=None))


def test_missing_suite_module_is_a_clear_error(monkeypatch):
    import fastrehearse.envs as envs
    monkeypatch.setitem(envs.SUITES, "ghost", ("fastrehearse.envs.no_such_module", "GhostSuite"))
    with pytest.raises(ImportError, match="suite 'ghost' is not available"):
        get_suite("ghost")


def test_importing_envs_does_not_import_benchmarks():
    code = ("import sys, fastrehearse.envs; print('bfcl_eval' in sys.modules, 'tau2' in sys.modules, "
            "'mcp' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False", "False"]


@settings(max_examples=60, deadline=None)
@given(data=st.data(), k=st.integers(0, len(SAMPLE) - 1))
def test_fuzz_call_sequences_keep_world_invariants(data, k):
    """Well-typed calls over real entity values: never an env error, and the world stays consistent
    (money is conserved, stock never negative, events never overlap)."""
    suite = BuiltinSuite(level="all", tools="all")
    task = suite.task(SAMPLE[k].split, int(SAMPLE[k].id.rsplit("-", 1)[1]))
    env = suite.make_env()
    env.reset(task)
    w = env.world
    pool = (sorted(w["accounts"]) + sorted(w["customers"]) + sorted(w["products"]) + sorted(w["orders"])
            + sorted(w["events"]) + sorted({a["owner"] for a in w["accounts"].values()})
            + sorted({p["name"] for p in w["products"].values()}) + sorted({e["date"] for e in w["events"].values()})
            + ["09:00", "10:00", "17:30", "25:00", "", "Team sync", "USD", "km"])
    value = {"string": st.sampled_from(pool) | st.text(max_size=6),
             "number": st.floats(-100, 6000, allow_nan=False) | st.integers(-5, 6000),
             "integer": st.integers(-2, 60)}
    money = sum(a["balance"] for a in w["accounts"].values())
    for _ in range(data.draw(st.integers(1, 12))):
        name = data.draw(st.sampled_from(sorted(SCHEMAS)))
        props = SCHEMAS[name]["function"]["parameters"]["properties"]
        args = {a: data.draw(st.sampled_from(p["enum"]) if "enum" in p else value[p["type"]])
                for a, p in props.items()}
        res = env.execute(ToolCall(name, args))
        assert res.error_kind in (None, "domain_error"), (name, args, res.content)
        json.loads(res.content)
    assert abs(sum(a["balance"] for a in w["accounts"].values()) - money) < 1e-6
    assert all(p["stock"] >= 0 for p in w["products"].values())
    by_date = {}
    for e in w["events"].values():
        by_date.setdefault(e["date"], []).append((e["start"], e["end"]))
    for spans in by_date.values():
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
