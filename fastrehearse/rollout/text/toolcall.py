"""Parse the policy's `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks.

`parse_tool_calls(text, tools)` never raises on model text: every block becomes either a valid
`ToolCall` or an error with a kind (counted in rollout metrics):

  unclosed       `<tool_call>` without a matching `</tool_call>`
  bad_json       the block is not one JSON object
  missing_name   no string "name"
  unknown_tool   the name is not one of the episode's tools
  bad_arguments  "arguments" is not an object (a JSON-encoded object string is accepted), or fails the
                 tool's JSON schema (required keys, types, enums, unknown keys when
                 additionalProperties is false)

Schemas are checked by a small lenient validator instead of `jsonschema`: benchmark schemas use
non-standard type names (BFCL writes "dict", "float", "tuple", "any"), which `jsonschema` rejects.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from fastrehearse.envs.base import ToolCall
from fastrehearse.rollout.text.template import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

ERROR_KINDS = ("unclosed", "bad_json", "missing_name", "unknown_tool", "bad_arguments")

_BLOCK_RE = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.S)

# JSON-schema type names, plus the aliases benchmark schemas use (BFCL: dict, float, tuple, any).
_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,), "dict": (dict,),
    "array": (list,), "list": (list,), "tuple": (list,),
    "string": (str,), "str": (str,),
    "integer": (int,), "int": (int,),
    "number": (int, float), "float": (int, float),
    "boolean": (bool,), "bool": (bool,),
    "null": (type(None),),
}


@dataclass
class ParsedCall:
    raw: str                            # the text inside the block (or after an unclosed opener)
    call: ToolCall | None = None        # set when the call is well-formed
    error_kind: str | None = None       # one of ERROR_KINDS when malformed
    error: str = ""                     # human-readable reason (used as the error tool response)

    @property
    def ok(self) -> bool:
        return self.call is not None


@dataclass
class ParseResult:
    calls: list[ParsedCall] = field(default_factory=list)
    content: str = ""                   # the turn's text outside tool-call blocks

    @property
    def has_calls(self) -> bool:
        return bool(self.calls)


def _type_ok(value: Any, type_name: str) -> bool:
    if type_name == "any":
        return True
    types = _TYPES.get(type_name)
    if types is None:
        return True  # unknown type name in the schema: do not fail the model for it
    if isinstance(value, bool) and bool not in types:
        return False  # bool is an int subclass in Python, not in JSON
    return isinstance(value, types)


def validate(value: Any, schema: Any, path: str = "arguments") -> str | None:
    """First schema violation of `value` as a message, or None. Covers type (incl. unions), enum,
    required, properties, additionalProperties=false, items. Lenient on anything else."""
    if not isinstance(schema, dict):
        return None
    t = schema.get("type")
    if t is not None:
        names = t if isinstance(t, list) else [t]
        if not any(_type_ok(value, str(n)) for n in names):
            return f"{path} must be of type {t}, got {type(value).__name__}"
    if "enum" in schema and isinstance(schema["enum"], list) and value not in schema["enum"]:
        return f"{path} must be one of {schema['enum']}, got {value!r}"
    if isinstance(value, dict):
        props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        for key in schema.get("required") or []:
            if key not in value:
                return f"{path} is missing required key {key!r}"
        if schema.get("additionalProperties") is False:
            extra = sorted(set(value) - set(props))
            if extra:
                return f"{path} has unknown keys {extra}"
        for key, sub in props.items():
            if key in value:
                err = validate(value[key], sub, f"{path}.{key}")
                if err:
                    return err
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            err = validate(item, schema["items"], f"{path}[{i}]")
            if err:
                return err
    return None


def tool_index(tools: list[dict] | None) -> dict[str, dict]:
    """name -> parameters schema, from OpenAI-shaped tool schemas (or bare function dicts)."""
    out = {}
    for t in tools or []:
        f = t.get("function", t) if isinstance(t, dict) else None
        if isinstance(f, dict) and isinstance(f.get("name"), str):
            out[f["name"]] = f.get("parameters") or {}
    return out


def parse_one(raw: str, tools: dict[str, dict] | None) -> ParsedCall:
    """One block's inner text -> ParsedCall. `tools` None skips the name/argument checks."""
    try:
        obj = json.loads(raw.strip())
    except (ValueError, RecursionError) as e:
        return ParsedCall(raw, error_kind="bad_json", error=f"tool call is not valid JSON: {e}")
    if not isinstance(obj, dict):
        return ParsedCall(raw, error_kind="bad_json",
                          error='tool call must be a JSON object {"name": ..., "arguments": {...}}')
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ParsedCall(raw, error_kind="missing_name", error='tool call has no string "name"')
    if tools is not None and name not in tools:
        return ParsedCall(raw, error_kind="unknown_tool",
                          error=f"unknown tool {name!r}; available: {sorted(tools)}")
    args = obj.get("arguments", obj.get("parameters", {}))  # "parameters": Llama-3 style
    if isinstance(args, str):  # OpenAI style: arguments as a JSON-encoded string
        try:
            args = json.loads(args) if args.strip() else {}
        except (ValueError, RecursionError):
            pass
    if not isinstance(args, dict):
        return ParsedCall(raw, error_kind="bad_arguments",
                          error=f"arguments of {name!r} must be a JSON object")
    if tools is not None:
        try:
            err = validate(args, tools[name])
        except RecursionError:
            err = "arguments nest too deeply"
        if err:
            return ParsedCall(raw, error_kind="bad_arguments", error=f"{name}: {err}")
    return ParsedCall(raw, call=ToolCall(name=name, arguments=args, raw=raw))


def malformed_response(pc: ParsedCall) -> str:
    """The tool-response text the agent sees for a malformed call: one text for training and
    evaluation (the engine forces it as the tool response, tagged CONTEXT: no environment wrote it)."""
    return json.dumps({"error": pc.error_kind, "message": pc.error}, ensure_ascii=False)


def parse_tool_calls(text: str, tools: list[dict] | None = None) -> ParseResult:
    """All tool-call blocks of one assistant turn, in order. Never raises on model text.

    `tools` (OpenAI schemas) enables the unknown_tool / bad_arguments checks; None accepts any
    name and any object arguments."""
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    index = tool_index(tools) if tools is not None else None
    result = ParseResult()
    outside, pos = [], 0
    for m in _BLOCK_RE.finditer(text):
        outside.append(text[pos:m.start()])
        pos = m.end()
        result.calls.append(parse_one(m.group(1), index))
    rest = text[pos:]
    j = rest.find(TOOL_CALL_OPEN)
    if j >= 0:  # an opener never closed (e.g. the turn ran out of tokens)
        result.calls.append(ParsedCall(rest[j + len(TOOL_CALL_OPEN):], error_kind="unclosed",
                                       error="tool call opened with <tool_call> but never closed"))
        rest = rest[:j]
    outside.append(rest)
    result.content = "".join(outside).strip()
    return result
