"""ScrambleEnv (the Cv control): the real tool runs, the schema and echoes are kept, every other
value is random but a stable, usable alias within the episode."""
import json
import re

from fastrehearse.envs.base import ToolCall, Trajectory
from fastrehearse.envs.builtin import BuiltinEnv, BuiltinSuite, expectations, scoring
from fastrehearse.envs.builtin.tools import RESPONSES
from fastrehearse.envs.replay import exchanges_of
from fastrehearse.envs.scramble import ScrambleEnv, _key


def _task(level, template):
    return next(t for t in BuiltinSuite(level=level).tasks("train", 20) if t.payload["template"] == template)


def _paths(v, p="$"):
    if isinstance(v, dict):
        return {(p, "dict")} | {x for k, w in v.items() for x in _paths(w, f"{p}.{k}")}
    if isinstance(v, list):
        return {(p, f"list{len(v)}")} | {x for i, w in enumerate(v) for x in _paths(w, f"{p}[{i}]")}
    return {(p, type(v).__name__)}


def _play(env, task):
    """Run the task's gold calls through `env`, passing back the stand-ins the env showed for the
    real values the gold used; returns (messages, shown responses, real responses)."""
    env.reset(task)
    msgs, shown, real = [], [], [m["content"] for m in task.gold if m["role"] == "tool"]
    for m in task.gold:
        if m["role"] != "assistant" or not m.get("tool_calls"):
            continue
        msgs.append(m)
        for tc in m["tool_calls"]:
            args = {k: env.fake_of.get(_key(v), v) for k, v in tc["function"]["arguments"].items()}
            tc = {"type": "function", "function": {"name": tc["function"]["name"], "arguments": args}}
            msgs[-1] = dict(msgs[-1], tool_calls=[tc])
            res = env.execute(ToolCall(name=tc["function"]["name"], arguments=args))
            assert res.ok, res.content
            shown.append(res.content)
            msgs.append({"role": "tool", "content": res.content})
    return msgs, shown, real


def test_schema_and_echoes_kept_values_scrambled_and_ids_usable():
    t = _task(2, "balance_by_owner")
    env = ScrambleEnv(BuiltinEnv(), seed=0)
    msgs, shown, real = _play(env, t)
    for s, r in zip(shown, real):
        assert _paths(json.loads(s)) == _paths(json.loads(r))          # same keys, nesting, lengths, types
    fa, fr = json.loads(shown[0]), json.loads(real[0])
    assert fa["owner"] == fr["owner"]                                  # echo of the argument kept
    for a, b in zip(fa["accounts"], fr["accounts"]):
        assert a["account_id"] != b["account_id"] and re.fullmatch(r"AC\d{4}", a["account_id"])
    ga, gr = json.loads(shown[1]), json.loads(real[1])
    # the scrambled id the agent passed back named the real account (the call succeeded) and is echoed
    assert ga["account_id"] == msgs[2]["tool_calls"][0]["function"]["arguments"]["account_id"] != gr["account_id"]
    assert ga["balance"] != gr["balance"] and isinstance(ga["balance"], float) and ga["currency"] != "USD"
    assert env.scramble_stats()["responses"] == 2
    # the same task scrambles the same way in a fresh env; another seed differently
    assert _play(ScrambleEnv(BuiltinEnv(), seed=0), t)[1] == shown
    assert _play(ScrambleEnv(BuiltinEnv(), seed=1), t)[1] != shown
    # graded with the stand-ins mapped back: the real balance answers the real task
    answer = {"role": "assistant", "content": f"It has {gr['balance']:.2f} USD."}
    assert env.score(t, Trajectory(messages=msgs + [answer])) == 1.0
    assert t.payload["answer"]["value"] == gr["balance"]


def test_derived_fields_scrambled_errors_pass_through():
    t = _task("rules", "deposit_and_confirm")
    env = ScrambleEnv(BuiltinEnv(), seed=0)
    msgs, shown, real = _play(env, t)
    b0, b1 = json.loads(shown[0])["balance"], json.loads(shown[2])["balance"]
    amount = json.loads(shown[1])["amount"]
    assert amount == json.loads(real[1])["amount"]                     # echo of the deposit amount
    assert abs(b1 - (b0 + amount)) > 0.01                              # derived balance: random
    assert not expectations.follows_rules(exchanges_of(msgs))
    assert set(json.loads(shown[1])) == set(RESPONSES["deposit"]["keys"])
    bad = env.execute(ToolCall(name="get_balance", arguments={"account_id": "AC0000"}))
    assert not bad.ok and "not found" in bad.content


def test_suite_option_wraps_envs_and_consistent_skips_the_rules():
    suite = BuiltinSuite(level="rules", scramble=True)
    t = next(t for t in suite.tasks("train", 10) if t.payload["template"] == "deposit_and_confirm")
    env = suite.make_env()
    assert isinstance(env, ScrambleEnv)
    msgs, shown, _ = _play(env, t)
    final = json.loads(shown[-1])["balance"]
    traj = Trajectory(messages=msgs + [{"role": "assistant", "content": f"The new balance is {final:.2f} USD."}])
    assert suite.task_reward(t, traj, "consistent") == 1.0            # calls, writes, answer in-episode
    assert scoring.score(t.payload, traj, "consistent") == 0.0         # the rules check would fail it
    for bad in ("yes", 1):
        try:
            BuiltinSuite(scramble=bad)
        except ValueError as e:
            assert "scramble" in str(e)
        else:
            raise AssertionError("scramble must be a bool")
