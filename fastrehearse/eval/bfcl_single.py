"""BFCL v4 single-turn AST categories, scored by BFCL's own `ast_checker`.

Categories: simple_python, multiple, parallel, parallel_multiple, live_simple, live_multiple (AST:
the calls must match one of the acceptable values per argument in `possible_answer`), irrelevance,
live_irrelevance (pass when the model makes no call).

    entries = load_category("simple_python")          # BFCL's own loader (docs carry its hints)
    msgs, tools = prompt_messages(entry), tools_for(entry)
    ... the model answers one assistant turn ...
    ok = score_bfcl_single(entry, model_output)        # bool
    gold = gold_calls(entry)                           # [{"name", "arguments"}] that pass

`model_output` may be the assistant text (`<tool_call>{...}</tool_call>` blocks, parsed with
fastrehearse.rollout.text.toolcall), an assistant message dict (its "tool_calls", else its "content"),
or a list of calls ({"name", "arguments"}, OpenAI {"function": {...}}, or ToolCall).

Decoding follows BFCL: an output with a malformed call block does not decode; for AST categories
that fails the entry, for irrelevance categories it counts as "no function call" (a pass), as
BFCL's relevance runner does. Argument JSON strings (OpenAI style) are decoded.
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Any

from fastrehearse.envs import bfcl_compat
from fastrehearse.envs.base import ToolCall
from fastrehearse.rollout.text.toolcall import parse_tool_calls

CATEGORIES = bfcl_compat.SINGLE_TURN_AST_CATEGORIES
AST_CATEGORIES = tuple(c for c in CATEGORIES if "irrelevance" not in c)
IRRELEVANCE_CATEGORIES = tuple(c for c in CATEGORIES if "irrelevance" in c)


def category_of(entry: dict) -> str:
    """BFCL's category of an entry, from its id ("live_simple_3-2-0" -> "live_simple")."""
    return bfcl_compat.import_bfcl().utils.extract_test_category_from_id(entry["id"])


def load_category(name: str, limit: int | None = None) -> list[dict]:
    """Entries of one category in BFCL's order, each with "possible_answer" (the ground-truth list
    of {function: {arg: [acceptable values]}}) attached; irrelevance entries get None."""
    if name not in CATEGORIES:
        raise ValueError(f"name: {name!r} is not a BFCL single-turn AST category; use one of {list(CATEGORIES)}")
    if limit is not None and limit < 0:
        raise ValueError(f"limit: must be >= 0, got {limit}")
    entries = bfcl_compat.load_entries(name, limit)
    answers = bfcl_compat.load_answers(name)
    for e in entries:
        e["possible_answer"] = answers[e["id"]]["ground_truth"] if answers else None
    return entries


def prompt_messages(entry: dict) -> list[dict]:
    """The entry's messages (BFCL FC mode: its question as is; the functions go in as tools)."""
    return [dict(m) for m in entry["question"][0]]


def tools_for(entry: dict) -> list[dict]:
    """The entry's function docs as OpenAI tool schemas (BFCL's own converter)."""
    return [bfcl_compat.func_doc_to_tool(d) for d in entry["function"]]


# ---------------------------------------------------------------------------------------------
# Decoding model output
# ---------------------------------------------------------------------------------------------
@dataclass
class Decoded:
    calls: list[dict] = field(default_factory=list)   # [{"name": str, "arguments": dict}]
    error: str | None = None                          # set when the output does not decode


def _one_call(c: Any) -> dict:
    if isinstance(c, ToolCall):
        name, args = c.name, c.arguments
    elif isinstance(c, dict):
        fn = c.get("function", c)
        if not isinstance(fn, dict):
            raise ValueError("a tool call's 'function' must be an object")
        name, args = fn.get("name"), fn.get("arguments", fn.get("parameters", {}))
    else:
        raise ValueError(f"a tool call must be a dict or ToolCall, got {type(c).__name__}")
    if isinstance(args, str):
        args = json.loads(args) if args.strip() else {}
    if args is None:
        args = {}
    if not isinstance(name, str) or not name:
        raise ValueError("a tool call has no string name")
    if not isinstance(args, dict):
        raise ValueError(f"arguments of {name!r} must be an object")
    return {"name": name, "arguments": args}


def decode(model_output: Any) -> Decoded:
    """Model output -> calls. Never raises."""
    try:
        if isinstance(model_output, dict):          # an assistant message
            if model_output.get("tool_calls"):
                model_output = model_output["tool_calls"]
            else:
                model_output = model_output.get("content") or ""
        if model_output is None:
            return Decoded()
        if isinstance(model_output, str):
            parsed = parse_tool_calls(model_output, tools=None)
            bad = [p for p in parsed.calls if not p.ok]
            if bad:
                return Decoded(error=f"{bad[0].error_kind}: {bad[0].error}")
            model_output = [p.call for p in parsed.calls]
        if not isinstance(model_output, (list, tuple)):
            return Decoded(error=f"unsupported model output type {type(model_output).__name__}")
        return Decoded(calls=[_one_call(c) for c in model_output])
    except (ValueError, TypeError, RecursionError) as e:
        return Decoded(error=str(e))


def to_bfcl_format(calls: list[dict]) -> list[dict]:
    """[{"name", "arguments"}] -> BFCL's decoded AST format [{name: {arg: value}}]."""
    return [{c["name"]: copy.deepcopy(c["arguments"])} for c in calls]


# ---------------------------------------------------------------------------------------------
# Scoring
# ---------------------------------------------------------------------------------------------
def check_bfcl_single(entry: dict, model_output: Any) -> dict:
    """BFCL's verdict for one entry: {"valid": bool, "error": ..., "error_type": ...}."""
    cat = category_of(entry)
    if cat not in CATEGORIES:
        raise ValueError(f"entry: {entry.get('id')!r} is not in a single-turn AST category")
    dec = decode(model_output)
    if cat in IRRELEVANCE_CATEGORIES:
        # BFCL: no function call = the output does not decode, or decodes to no call.
        if dec.error is not None or not dec.calls:
            return {"valid": True}
        return {"valid": False, "error": ["Valid syntax. Successfully decode AST when it should not."],
                "error_type": "irrelevance_error:decoder_success"}
    if dec.error is not None:
        return {"valid": False, "error": [f"Invalid syntax. Failed to decode AST. {dec.error}"],
                "error_type": "ast_decoder:decoder_failed"}
    answer = entry.get("possible_answer")
    if answer is None:
        answer = bfcl_compat.load_answers(cat)[entry["id"]]["ground_truth"]
    bfcl = bfcl_compat.import_bfcl()
    try:
        return bfcl.ast_checker(entry["function"], to_bfcl_format(dec.calls), answer,
                                bfcl.Language.PYTHON, cat, bfcl_compat.CHECKER_MODEL_NAME)
    except Exception as e:   # the checker indexes into odd outputs (e.g. a nested type mismatch)
        return {"valid": False, "error": [f"checker error: {e!r}"], "error_type": "checker_error"}


def score_bfcl_single(entry: dict, model_output: Any) -> bool:
    """True when BFCL's checker accepts the model output for this entry."""
    return bool(check_bfcl_single(entry, model_output)["valid"])


# ---------------------------------------------------------------------------------------------
# Gold policy
# ---------------------------------------------------------------------------------------------
def _first(options: list) -> tuple[bool, Any]:
    """First acceptable value that is not "" (BFCL's "may be omitted" marker)."""
    for v in options:
        if v != "":
            return True, v
    return False, None


def _concrete_dict(option: dict) -> dict:
    """{key: [acceptable values]} (BFCL's dict answers) -> one concrete dict (keys that may be
    omitted are left out, as for top-level arguments)."""
    out = {}
    for k, opts in option.items():
        if "" in opts:
            continue
        ok, v = _first(opts)
        if ok:
            out[k] = v
    return out


def _param_type(doc: dict | None, param: str) -> tuple[str | None, str | None]:
    props = ((doc or {}).get("parameters") or {}).get("properties") or {}
    p = props.get(param) or {}
    return p.get("type"), (p.get("items") or {}).get("type")


def gold_calls(entry: dict) -> list[dict]:
    """One concrete call list for BFCL's checker, from possible_answer. Per argument: an optional
    one ("" among its acceptable values, not required by the doc) is left out -- some answers
    allow values for parameters the doc does not even declare, which only omission satisfies;
    otherwise the first acceptable value that is not "" ("" itself when that is all a required
    argument allows). Dict and list-of-dict answers are made concrete key by key the same way.
    Irrelevance entries: [] (no call)."""
    answer = entry.get("possible_answer")
    cat = category_of(entry)
    if cat in IRRELEVANCE_CATEGORIES:
        return []
    if answer is None:
        answer = bfcl_compat.load_answers(cat)[entry["id"]]["ground_truth"]
    docs = {d["name"]: d for d in entry["function"]}
    calls = []
    for item in answer:
        (name, params), = item.items()
        required = set(((docs.get(name) or {}).get("parameters") or {}).get("required") or [])
        args = {}
        for param, options in params.items():
            if "" in options and param not in required:
                continue
            ok, value = _first(options)
            if not ok:
                value = ""
            ptype, itype = _param_type(docs.get(name), param)
            if ptype == "dict" and isinstance(value, dict):
                value = _concrete_dict(value)
            elif ptype in ("array", "tuple") and itype == "dict" and isinstance(value, list):
                value = [_concrete_dict(v) if isinstance(v, dict) else v for v in value]
            args[param] = value
        calls.append({"name": name, "arguments": args})
    return calls


def gold_message(entry: dict) -> dict:
    """The gold answer as an assistant message (OpenAI shape; no tool_calls for irrelevance)."""
    calls = gold_calls(entry)
    if not calls:
        return {"role": "assistant", "content": "None of the available functions can be used for this request."}
    return {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]}
