"""BFCL v4 single-turn AST scoring through BFCL's own ast_checker: the gold policy passes every
sound entry of every category, deliberately wrong outputs fail, decoding never raises."""
from __future__ import annotations

import copy
import functools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("bfcl_eval")

from _bfcl import answer_problems  # noqa: E402
from fastrehearse.envs.base import ToolCall  # noqa: E402
from fastrehearse.eval import bfcl_single as bs  # noqa: E402

# BFCL v4 entries whose possible_answer contradicts their own function doc (see answer_problems):
# no output can pass BFCL's checker on them.
KNOWN_UNSOUND = {"live_simple_106-63-0", "live_simple_112-68-0", "live_multiple_862-181-3",
                 "live_multiple_964-207-0"}


@pytest.fixture(scope="module")
def entries():
    return {c: bs.load_category(c) for c in bs.CATEGORIES}


def as_text(calls: list[dict]) -> str:
    """Gold calls as the policy would write them (the rollout's tool-call blocks)."""
    from fastrehearse.rollout.text.template import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
    return "".join(f"{TOOL_CALL_OPEN}{json.dumps(c)}{TOOL_CALL_CLOSE}" for c in calls)


def test_category_sizes(entries):
    assert {c: len(e) for c, e in entries.items()} == {
        "simple_python": 400, "multiple": 200, "parallel": 200, "parallel_multiple": 200,
        "live_simple": 258, "live_multiple": 1053, "irrelevance": 240, "live_irrelevance": 884}


def test_gold_passes_every_sound_entry(entries):
    """Full categories (BFCL's checker is fast): accuracy 1.0 on every entry it can accept."""
    unsound = set()
    for cat, es in entries.items():
        for e in es:
            if answer_problems(e):
                unsound.add(e["id"])
                assert not bs.score_bfcl_single(e, bs.gold_message(e)), e["id"]
                continue
            msg = json.loads(json.dumps(bs.gold_message(e)))       # arguments travel as JSON
            assert bs.score_bfcl_single(e, msg), (e["id"], bs.check_bfcl_single(e, msg))
    assert unsound == KNOWN_UNSOUND


@pytest.mark.parametrize("cat", bs.CATEGORIES)
def test_gold_as_model_text_and_call_lists(entries, cat):
    for e in entries[cat][::25]:
        if e["id"] in KNOWN_UNSOUND:
            continue
        gold = bs.gold_calls(e)
        assert bs.score_bfcl_single(e, as_text(gold) or "I cannot help with that."), e["id"]
        assert bs.score_bfcl_single(e, [ToolCall(c["name"], c["arguments"]) for c in gold]), e["id"]
        openai = [{"function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}} for c in gold]
        assert bs.score_bfcl_single(e, openai), e["id"]


def _mutate(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1000
    if isinstance(value, str):
        return value + " zzz-wrong"
    if isinstance(value, list):
        return value + ["zzz-wrong"]
    if isinstance(value, dict):
        return {**value, "zzz_wrong": 1}
    return "zzz-wrong"


@pytest.mark.parametrize("cat", bs.AST_CATEGORIES)
def test_wrong_outputs_score_zero(entries, cat):
    checked = 0
    for e in entries[cat][::20]:
        if e["id"] in KNOWN_UNSOUND:
            continue
        gold = bs.gold_calls(e)
        assert not bs.score_bfcl_single(e, []), e["id"]                              # no call
        assert not bs.score_bfcl_single(e, "The answer is 42."), e["id"]            # text only
        assert not bs.score_bfcl_single(e, "<tool_call>{bad json</tool_call>"), e["id"]
        renamed = copy.deepcopy(gold)
        renamed[0]["name"] += "_wrong"
        assert not bs.score_bfcl_single(e, renamed), e["id"]
        if gold[0]["arguments"]:
            wrong = copy.deepcopy(gold)
            k = next(iter(wrong[0]["arguments"]))
            wrong[0]["arguments"][k] = _mutate(wrong[0]["arguments"][k])
            assert not bs.score_bfcl_single(e, wrong), (e["id"], k)
            extra = copy.deepcopy(gold)
            extra[0]["arguments"]["zzz_unexpected"] = 1
            assert not bs.score_bfcl_single(e, extra), e["id"]
        if len(gold) > 1:
            assert not bs.score_bfcl_single(e, gold[:-1]), e["id"]                  # dropped call
        assert not bs.score_bfcl_single(e, gold + gold[:1]), e["id"]                # extra call
        checked += 1
    assert checked >= 10


@pytest.mark.parametrize("cat", bs.IRRELEVANCE_CATEGORIES)
def test_irrelevance(entries, cat):
    for e in entries[cat][::20]:
        assert bs.gold_calls(e) == []
        assert bs.score_bfcl_single(e, bs.gold_message(e))
        assert bs.score_bfcl_single(e, None) and bs.score_bfcl_single(e, [])
        # BFCL counts an undecodable output as "no function call" here.
        assert bs.score_bfcl_single(e, "<tool_call>{bad json</tool_call>")
        call = {"name": e["function"][0]["name"] if e["function"] else "lookup", "arguments": {}}
        assert not bs.score_bfcl_single(e, [call])
        assert not bs.score_bfcl_single(e, as_text([call]))
        assert bs.check_bfcl_single(e, [call])["error_type"] == "irrelevance_error:decoder_success"


def test_tools_and_prompt(entries):
    e = entries["multiple"][0]
    tools = bs.tools_for(e)
    assert [t["function"]["name"] for t in tools] == [f["name"] for f in e["function"]]
    assert tools[0]["type"] == "function" and "." in tools[0]["function"]["name"]   # dots kept
    p = tools[0]["function"]["parameters"]
    assert p["type"] == "object" and all(v["type"] in {"string", "integer", "number", "boolean", "array", "object"}
                                         for v in p["properties"].values())
    json.dumps(tools)
    msgs = bs.prompt_messages(e)
    assert msgs[-1]["role"] == "user" and msgs[-1]["content"]
    assert bs.category_of(entries["live_simple"][5]) == "live_simple"


def test_bad_arguments():
    with pytest.raises(ValueError, match="name"):
        bs.load_category("multi_turn_base")
    with pytest.raises(ValueError, match="limit"):
        bs.load_category("simple_python", limit=-1)
    assert len(bs.load_category("simple_python", limit=3)) == 3
    with pytest.raises(ValueError, match="entry"):
        bs.check_bfcl_single({"id": "multi_turn_base_0", "function": []}, [])


@functools.lru_cache(maxsize=1)
def _first_simple() -> dict:
    return bs.load_category("simple_python", limit=1)[0]


_json = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=8)),
                     lambda c: st.one_of(st.lists(c, max_size=3), st.dictionaries(st.text(max_size=6), c, max_size=3)),
                     max_leaves=10)


@settings(max_examples=200, deadline=None)
@given(out=st.one_of(st.text(max_size=60), _json,
                     st.lists(st.dictionaries(st.sampled_from(["name", "arguments", "function", "x"]), _json, max_size=3),
                              max_size=3),
                     st.builds(lambda n, a: f"<tool_call>{json.dumps({'name': n, 'arguments': a})}</tool_call>",
                               st.sampled_from(["calculate_triangle_area", "x", ""]), _json)))
def test_decode_and_score_never_raise(out):
    e = _first_simple()
    d = bs.decode(out)
    assert isinstance(d, bs.Decoded)
    assert bs.score_bfcl_single(e, out) in (True, False)
