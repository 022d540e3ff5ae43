"""Tool-call parser (fastrehearse.rollout.text.toolcall): kinds of malformed calls, schema checks, fuzzing."""
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastrehearse.rollout.text.template import format_tool_call
from fastrehearse.rollout.text.toolcall import ERROR_KINDS, parse_tool_calls, validate
from _rollout_fixtures import CALC_TOOLS

NESTED = [{"type": "function", "function": {"name": "book", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["when", "who"],
    "properties": {"when": {"type": "string", "enum": ["am", "pm"]},
                   "who": {"type": "array", "items": {"type": "object", "required": ["id"],
                                                      "properties": {"id": {"type": "integer"}}}},
                   "price": {"type": ["number", "null"]},
                   "meta": {"type": "dict"}}}}}]


def test_valid_single_and_parallel_calls():
    text = ("I will add.\n" + format_tool_call("add", {"a": 1, "b": 2}) + "\n"
            + format_tool_call("lookup", {"key": "k"}))
    r = parse_tool_calls(text, CALC_TOOLS)
    assert [c.ok for c in r.calls] == [True, True]
    assert r.calls[0].call.name == "add" and r.calls[0].call.arguments == {"a": 1, "b": 2}
    assert r.calls[1].call.arguments == {"key": "k"}
    assert r.content == "I will add."


def test_no_calls():
    r = parse_tool_calls("The answer is 5.", CALC_TOOLS)
    assert not r.has_calls and r.content == "The answer is 5."


@pytest.mark.parametrize("body,kind", [
    ("{not json", "bad_json"),
    ("[1, 2]", "bad_json"),
    ('{"arguments": {}}', "missing_name"),
    ('{"name": 3, "arguments": {}}', "missing_name"),
    ('{"name": "mul", "arguments": {"a": 1}}', "unknown_tool"),
    ('{"name": "add", "arguments": [1, 2]}', "bad_arguments"),
    ('{"name": "add", "arguments": {"a": 1}}', "bad_arguments"),            # missing required b
    ('{"name": "add", "arguments": {"a": "1", "b": 2}}', "bad_arguments"),  # wrong type
    ('{"name": "add", "arguments": {"a": true, "b": 2}}', "bad_arguments"),  # bool is not an integer
    ('{"name": "add", "arguments": {"a": 1.5, "b": 2}}', "bad_arguments"),
])
def test_error_kinds(body, kind):
    r = parse_tool_calls(f"<tool_call>{body}</tool_call>", CALC_TOOLS)
    assert len(r.calls) == 1 and not r.calls[0].ok
    assert r.calls[0].error_kind == kind and r.calls[0].error


def test_unclosed_and_mixed():
    text = format_tool_call("add", {"a": 1, "b": 2}) + ' <tool_call>{"name": "add"'
    r = parse_tool_calls(text, CALC_TOOLS)
    assert [c.error_kind for c in r.calls] == [None, "unclosed"]


def test_arguments_as_json_string_and_llama_parameters():
    r = parse_tool_calls('<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>'
                         '<tool_call>{"name": "lookup", "parameters": {"key": "z"}}</tool_call>', CALC_TOOLS)
    assert [c.call.arguments for c in r.calls] == [{"a": 1, "b": 2}, {"key": "z"}]


def test_schema_validator_nested():
    ok = {"when": "am", "who": [{"id": 1}], "price": None, "meta": {"x": 1}}
    assert validate(ok, NESTED[0]["function"]["parameters"]) is None
    for bad, msg in [({**ok, "when": "noon"}, "one of"), ({**ok, "who": [{"id": "1"}]}, "who[0].id"),
                     ({**ok, "extra": 1}, "unknown keys"), ({"when": "am"}, "missing required"),
                     ({**ok, "price": "3"}, "type"), ({**ok, "meta": []}, "meta")]:
        err = validate(bad, NESTED[0]["function"]["parameters"])
        assert err is not None and msg in err, (bad, err)


def test_no_tools_accepts_any_name():
    r = parse_tool_calls(format_tool_call("anything", {"x": [1]}), None)
    assert r.calls[0].ok and r.calls[0].call.name == "anything"


def test_non_str_raises_type_error():
    with pytest.raises(TypeError, match="text"):
        parse_tool_calls(None, CALC_TOOLS)


_json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
                            | st.text(max_size=8),
                            lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3),
                            max_leaves=10)
_pieces = st.sampled_from(["<tool_call>", "</tool_call>", "{", "}", '"name"', '"arguments"', ":", ",",
                           '"add"', '"lookup"', "[", "]", "\\", '"', "null", "1e999", "9" * 30, "\n", " "])


@settings(max_examples=400, deadline=None)
@given(st.lists(_pieces | st.text(max_size=6), max_size=30).map("".join))
def test_fuzz_never_raises_on_model_text(text):
    r = parse_tool_calls(text, CALC_TOOLS)
    for c in r.calls:
        assert c.ok != (c.error_kind is not None)
        assert c.error_kind is None or c.error_kind in ERROR_KINDS
    n_open = text.count("<tool_call>")
    assert min(1, n_open) <= len(r.calls) <= n_open  # every opener is accounted for, at most once
    for c in r.calls:  # an accepted call round-trips through the protocol formatter
        if c.ok:
            again = parse_tool_calls(format_tool_call(c.call.name, c.call.arguments), CALC_TOOLS)
            assert again.calls[0].call.name == c.call.name


@settings(max_examples=200, deadline=None)
@given(name=st.text(max_size=8) | st.sampled_from(["add", "lookup", "book"]), args=_json_values,
       wrap=st.booleans())
def test_fuzz_structured_calls(name, args, wrap):
    body = json.dumps({"name": name, "arguments": args}) if wrap else json.dumps(args)
    r = parse_tool_calls(f"<tool_call>{body}</tool_call>", CALC_TOOLS + NESTED)
    assert len(r.calls) == 1
    c = r.calls[0]
    if c.ok:  # a call accepted by the parser satisfies its tool's schema
        assert c.call.name in ("add", "lookup", "book") and isinstance(c.call.arguments, dict)
        schema = {t["function"]["name"]: t["function"]["parameters"] for t in CALC_TOOLS + NESTED}
        assert validate(c.call.arguments, schema[c.call.name]) is None


def test_deep_nesting_is_bad_json_not_a_crash():
    r = parse_tool_calls("<tool_call>" + "[" * 100000 + "</tool_call>", CALC_TOOLS)
    assert r.calls[0].error_kind == "bad_json"
