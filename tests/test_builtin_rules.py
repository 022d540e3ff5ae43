"""The builtin "rules" family (level 4): documented rules, field labels, and the `consistent` reward
that checks a rehearsed world against the episode's own earlier responses and the rules."""
import copy
import json

import pytest

from fastrehearse.envs.base import Trajectory
from fastrehearse.envs.builtin import BuiltinSuite, expectations, scoring
from fastrehearse.envs.builtin.tasks import TEMPLATES
from fastrehearse.envs.builtin.tools import execute
from fastrehearse.envs.builtin.world import make_world
from fastrehearse.envs.replay import exchanges_of
from fastrehearse.eval.suites import build


def _task(template: str, split: str = "train"):
    suite = BuiltinSuite(level="rules")
    return next(t for t in suite.tasks(split, 20) if t.payload["template"] == template)


def _rehearsed(task, contents: dict[int, dict], answer: str):
    """The gold episode with tool response i replaced by contents[i] (rehearsed) and a new answer."""
    msgs, k = copy.deepcopy(task.gold), 0
    for m in msgs:
        if m["role"] == "tool":
            if k in contents:
                m["content"], m["rehearsed"] = json.dumps(contents[k]), True
            k += 1
    msgs[-1]["content"] = answer
    return Trajectory(messages=msgs)


def test_rules_family_selectable_and_gold_scores_one_everywhere():
    suite = BuiltinSuite(level="rules")
    names = {t.__name__ for t in TEMPLATES[4]}
    seen = set()
    for split in ("train", "test"):
        for t in suite.tasks(split, 15):
            assert t.payload["rules"] and t.payload["level"] == 4 and "-L4-" in t.id
            assert 2 <= t.payload["n_calls"] <= 4
            seen.add(t.payload["template"])
            tr = Trajectory(messages=list(t.gold))
            assert [scoring.score(t.payload, tr, m) for m in scoring.REWARD_MODES] == [1.0, 1.0, 1.0]
            assert expectations.follows_rules(exchanges_of(t.gold))
    assert seen == names
    run = build("builtin", ["test:rules"], limit=5)
    assert len(run.items) == 5 and all(t.payload["level"] == 4 for _, t in run.items)


def test_documented_rules_hold_for_the_real_tools():
    w = make_world(4)
    aid = sorted(w["accounts"])[0]
    b0 = w["accounts"][aid]["balance"]
    assert json.loads(execute(w, "deposit", {"account_id": aid, "amount": 10.004}).content)["amount"] == 10.0
    assert json.loads(execute(w, "get_balance", {"account_id": aid}).content)["balance"] == round(b0 + 10.0, 2)
    assert json.loads(execute(w, "exchange", {"amount": 100, "from_currency": "EUR",
                                              "to_currency": "GBP"}).content)["converted"] == round(108 / 1.27, 2)
    assert json.loads(execute(w, "add_days", {"date": "2026-02-20", "days": 10}).content) == {
        "date": "2026-03-02", "weekday": "Monday"}
    assert not execute(w, "add_days", {"date": "2026-02-30", "days": 1}).ok
    assert json.loads(execute(w, "add_to_list", {"list_name": "Todo", "item": " tea"}).content)["count"] == 1
    assert json.loads(execute(w, "add_to_list", {"list_name": "todo ", "item": "rice"}).content)["count"] == 2
    assert json.loads(execute(w, "get_list", {"list_name": "TODO"}).content)["items"] == ["tea", "rice"]
    nid = json.loads(execute(w, "create_note", {"title": "T", "text": "x"}).content)["note_id"]
    assert json.loads(execute(w, "get_note", {"note_id": nid.lower()}).content) == {
        "note_id": nid, "title": "T", "text": "x", "created_on": "2026-12-01"}
    assert "1 EUR = 1.08 USD" in execute.__globals__["SCHEMAS"]["exchange"]["function"]["description"]


def test_consistent_scores_zero_when_the_rehearsed_world_breaks_a_rule():
    t = _task("deposit_and_confirm")
    aid = t.payload["required_calls"][0]["arguments"]["account_id"]
    amount = t.payload["required_calls"][1]["arguments"]["amount"]
    # A rehearsed world with an invented starting balance, reported faithfully: the new balance must be
    # that balance plus the deposit.
    good = {0: {"account_id": aid, "balance": 100.0, "currency": "USD"},
            1: {"deposit_id": "DP1", "account_id": aid, "amount": amount},
            2: {"account_id": aid, "balance": round(100.0 + amount, 2), "currency": "USD"}}
    ok = _rehearsed(t, good, f"The new balance is {round(100.0 + amount, 2):.2f} USD.")
    assert scoring.score(t.payload, ok, "consistent") == 1.0
    assert scoring.score(t.payload, ok, "real") == 0.0          # the real balance differs
    broken = {**good, 2: {"account_id": aid, "balance": 100.0 + amount + 7, "currency": "USD"}}
    bad = _rehearsed(t, broken, f"The new balance is {100.0 + amount + 7:.2f} USD.")
    assert scoring.score(t.payload, bad, "consistent") == 0.0    # broke: balance = earlier + deposit
    assert scoring.score(dict(t.payload, rules=False), bad, "consistent") == 1.0
    # faithful world, unfaithful report
    lie = _rehearsed(t, good, f"The new balance is {100.0 + amount + 7:.2f} USD.")
    assert scoring.score(t.payload, lie, "consistent") == 0.0


def _break_exchange(msgs):   # converted 300.00 is not the stated rate; everything after follows it
    tools = [m for m in msgs if m["role"] == "tool"]
    b0 = json.loads(tools[0]["content"])["balance"]
    tools[1]["content"] = json.dumps({"converted": 300.0, "currency": "USD"})
    msgs[4]["tool_calls"][0]["function"]["arguments"]["amount"] = 300.0
    tools[2]["content"] = json.dumps(dict(json.loads(tools[2]["content"]), amount=300.0))
    tools[3]["content"] = json.dumps(dict(json.loads(tools[3]["content"]), balance=round(b0 + 300.0, 2)))
    msgs[-1]["content"] = f"The new balance is {b0 + 300.0:.2f} USD."


def _break_list(msgs):      # get_list in another order than the items were added
    m = [m for m in msgs if m["role"] == "tool"][-1]
    r = json.loads(m["content"])
    m["content"] = json.dumps(dict(r, items=r["items"][::-1]))


def _break_note(msgs):      # get_note returns another text than create_note saved
    m = [m for m in msgs if m["role"] == "tool"][-1]
    m["content"] = json.dumps(dict(json.loads(m["content"]), text="something else"))


def _break_date(msgs):      # add_days says 2031-01-01: not date + days; the note and answer follow it
    tools = [m for m in msgs if m["role"] == "tool"]
    tools[0]["content"] = json.dumps({"date": "2031-01-01", "weekday": "Wednesday"})
    msgs[2]["tool_calls"][0]["function"]["arguments"]["text"] = "2031-01-01"
    msgs[-1]["content"] = "The invoice is due on 2031-01-01."


@pytest.mark.parametrize("template,breaker", [("foreign_deposit", _break_exchange), ("list_then_count", _break_list),
                                              ("note_roundtrip", _break_note), ("due_date_note", _break_date)])
def test_consistent_checks_each_rule(template, breaker):
    t = _task(template)
    msgs = copy.deepcopy(t.gold)
    for m in msgs:
        if m["role"] == "tool":
            m["rehearsed"] = True
    assert scoring.score(t.payload, Trajectory(messages=msgs), "consistent") == 1.0
    breaker(msgs)
    tr = Trajectory(messages=msgs)
    assert scoring.score(t.payload, tr, "consistent") == 0.0
    # the rule check alone decides: without it the same internally consistent episode pays
    assert scoring.score(dict(t.payload, rules=False), tr, "consistent") == 1.0


def test_consistent_pays_invented_ids_at_level_2_and_checks_them_against_the_episode():
    suite = BuiltinSuite(level=2)
    t = next(t for t in suite.tasks("train", 10) if t.payload["template"] == "balance_by_owner")
    req = t.payload["required_calls"]
    owner = req[0]["arguments"]["owner"]
    typ = "savings" if "savings" in t.payload["prompt"] else "checking"
    assert req[1]["sources"] == {"account_id": {"tool": "find_accounts", "key": "account_id",
                                                "args": {"owner": owner}, "with": {"type": typ}}}

    def episode(listed_id: str, called_id: str) -> Trajectory:
        return Trajectory(messages=[
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "find_accounts", "arguments": {"owner": owner}}}]},
            {"role": "tool", "content": json.dumps({"owner": owner, "accounts": [
                {"account_id": listed_id, "type": typ}]}), "rehearsed": True},
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "get_balance", "arguments": {"account_id": called_id}}}]},
            {"role": "tool", "content": json.dumps({"account_id": called_id, "balance": 12.5, "currency": "USD"}),
             "rehearsed": True},
            {"role": "assistant", "content": "It has 12.50 USD."}])

    assert scoring.score(t.payload, episode("AC4321", "AC4321"), "consistent") == 1.0
    assert scoring.score(t.payload, episode("AC4321", "AC1111"), "consistent") == 0.0   # not from the episode


def test_field_labels_and_fidelity_split():
    t = _task("deposit_and_confirm")
    ex = exchanges_of(t.gold)
    first = expectations.field_labels([], ex[0].name, ex[0].arguments, ex[0].content)
    assert first == {"account_id": "predictable", "balance": "hidden", "currency": "hidden"}
    last = expectations.field_labels(ex[:2], ex[2].name, ex[2].arguments, ex[2].content)
    assert last["balance"] == "predictable"
    real = json.loads(ex[2].content)
    fake = json.dumps(dict(real, currency="EUR"))
    assert expectations.fidelity_by_label(ex[:2], ex[2].name, ex[2].arguments, fake, ex[2].content) == {
        "predictable": 1.0, "hidden": 0.0}
    assert expectations.fidelity_by_label([], ex[0].name, ex[0].arguments, None, ex[0].content) == {
        "predictable": 0.0, "hidden": 0.0}


def test_engine_fidelity_split_by_label_on_a_rehearsed_episode():
    """The engine's measured fidelity carries predictable / hidden shares for builtin rehearsals."""
    from fastrehearse.envs.base import ToolCall
    from fastrehearse.envs.builtin import BuiltinEnv
    from fastrehearse.eval.harness import _fidelity
    from fastrehearse.rollout.engine.fidelity import FidelityScore, aggregate
    t = _task("deposit_and_confirm")
    env = BuiltinEnv()
    env.reset(t)
    msgs = t.gold[:4]                       # get_balance and deposit exchanged; the next call's turn
    call = ToolCall(name="get_balance", arguments=t.gold[4]["tool_calls"][0]["function"]["arguments"])
    real = t.gold[5]["content"]
    lab = env.fidelity_by_label(msgs + [t.gold[4]], call, real, real)
    assert lab == {"predictable": 1.0, "hidden": 1.0}
    wrong = json.dumps(dict(json.loads(real), balance=1.0))
    assert env.fidelity_by_label(msgs + [t.gold[4]], call, wrong, real) == {"predictable": 0.5, "hidden": 1.0}
    agg = aggregate([FidelityScore("get_balance", 0.0, 0.5, 0.5, 1.0), FidelityScore("get_balance", 1.0, 1.0)])
    assert agg["predictable"] == 0.5 and agg["n_predictable"] == 1 and agg["field_f1"] == 0.75
    assert _fidelity([{"exact": 1.0, "field_f1": 1.0, "predictable": 0.5, "hidden": None},
                      {"exact": 0.0, "field_f1": 0.0, "predictable": None, "hidden": None}]) == {
        "exact": 0.5, "field_f1": 0.5, "calls": 2.0, "predictable": 0.5}


def test_consistent_traces_ids_to_the_right_call_and_item():
    """A rehearsed world with invented ids: the transfer must debit the id listed for the request's
    first owner with the request's account type, and credit the second one's."""
    t = next(t for t in BuiltinSuite(level=3).tasks("train", 40) if t.payload["template"] == "transfer_between_owners")
    src = t.payload["required_calls"][2]["sources"]
    owners = [src["from_account_id"]["args"]["owner"], src["to_account_id"]["args"]["owner"]]
    types = [src["from_account_id"]["with"]["type"], src["to_account_id"]["with"]["type"]]
    other = {"checking": "savings", "savings": "checking"}
    amount = t.payload["required_calls"][2]["arguments"]["amount"]

    def episode(frm: str, to: str) -> Trajectory:
        lists = [{"owner": o, "accounts": [{"account_id": f"AC{11 + 11 * i}00", "type": ty},
                                           {"account_id": f"AC{11 + 11 * i}99", "type": other[ty]}]}
                 for i, (o, ty) in enumerate(zip(owners, types))]
        return Trajectory(messages=[
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "find_accounts", "arguments": {"owner": o}}} for o in owners]},
            *({"role": "tool", "content": json.dumps(x), "rehearsed": True} for x in lists),
            {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
                "name": "transfer", "arguments": {"from_account_id": frm, "to_account_id": to, "amount": amount}}}]},
            {"role": "tool", "content": json.dumps({"transfer_id": "TR1", "amount": amount, "from_balance": 5.0,
                                                    "to_balance": 9.0}), "rehearsed": True},
            {"role": "assistant", "content": "Done; the new balance is 5.00 USD."}])

    assert scoring.score(t.payload, episode("AC1100", "AC2200"), "consistent") == 1.0
    assert scoring.score(t.payload, episode("AC2200", "AC1100"), "consistent") == 0.0   # owners swapped
    assert scoring.score(t.payload, episode("AC1199", "AC2200"), "consistent") == 0.0   # the other account type
    assert scoring.score(t.payload, episode("AC9999", "AC2200"), "consistent") == 0.0   # never listed
