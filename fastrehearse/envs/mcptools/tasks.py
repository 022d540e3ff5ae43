"""MCP task files: one JSON object per line, checked when read (errors name the file and line).

    {"id": "t1", "prompt": "How many hammers are in stock?", "split": "train",
     "check": {"type": "number", "value": 22, "tol": 0, "source": {"tool": "get_item", "field": "stock"}},
     "gold_calls": [{"name": "find_item", "arguments": {"name": "hammer"}}, ...],
     "system": "optional system prompt", "tools": ["optional", "subset", "of", "tool", "names"]}

check.type, applied to the final answer (the last assistant message without tool calls):
  exact     the answer, stripped, equals str(value)
  number    a number written in the answer is within `tol` (default 1e-6) of value
  regex     re.search(value, answer) matches
  contains  str(value) occurs in the answer (case-insensitive)
  function  "function": "package.module:fn" is called as fn(answer=..., task=<the task line>,
            trajectory=...) and returns a bool or a float in [0, 1]
check.source {"tool": NAME, "field": "dotted.path"} names the tool response field the answer is
copied from: the "consistent" reward compares the answer with that field of the episode's own
(possibly rehearsed) response to NAME instead of `value`.
"""
from __future__ import annotations

import importlib
import json
import math
import re
from pathlib import Path
from typing import Any

CHECK_TYPES = ("exact", "number", "regex", "contains", "function")
TASK_KEYS = {"id", "prompt", "split", "check", "gold_calls", "system", "tools"}
CHECK_KEYS = {"type", "value", "tol", "source", "function"}
NUMBER = re.compile(r"(?<![\w.])-?\d[\d,]*(?:\.\d+)?(?![\w])")


class TaskFileError(ValueError):
    pass


def load_tasks(path: Path) -> list[dict]:
    if not path.is_file():
        raise TaskFileError(f"tasks: file not found: {str(path)!r}")
    out, ids = [], set()
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"tasks {path.name}:{n}"
        try:
            t = json.loads(line)
        except ValueError as e:
            raise TaskFileError(f"{where}: not JSON ({e})") from None
        check_task(t, where)
        if t["id"] in ids:
            raise TaskFileError(f"{where}: duplicate id {t['id']!r}")
        ids.add(t["id"])
        t.setdefault("split", "train")
        t.setdefault("gold_calls", [])
        out.append(t)
    if not out:
        raise TaskFileError(f"tasks: {str(path)!r} holds no task")
    return out


def check_task(t: Any, where: str) -> None:
    if not isinstance(t, dict):
        raise TaskFileError(f"{where}: a task is a JSON object, got {type(t).__name__}")
    extra = set(t) - TASK_KEYS
    if extra:
        raise TaskFileError(f"{where}: unknown key(s) {sorted(extra)}; allowed: {sorted(TASK_KEYS)}")
    for k in ("id", "prompt"):
        if not isinstance(t.get(k), str) or not t[k]:
            raise TaskFileError(f"{where}: '{k}' must be a non-empty string")
    for k in ("split", "system"):
        if k in t and not isinstance(t[k], str):
            raise TaskFileError(f"{where}: '{k}' must be a string")
    if "tools" in t and not (isinstance(t["tools"], list) and all(isinstance(x, str) for x in t["tools"])):
        raise TaskFileError(f"{where}: 'tools' must be a list of tool names")
    c = t.get("check")
    if not isinstance(c, dict):
        raise TaskFileError(f"{where}: 'check' must be an object with a 'type' from {list(CHECK_TYPES)}")
    extra = set(c) - CHECK_KEYS
    if extra:
        raise TaskFileError(f"{where}: unknown check key(s) {sorted(extra)}; allowed: {sorted(CHECK_KEYS)}")
    if c.get("type") not in CHECK_TYPES:
        raise TaskFileError(f"{where}: check.type must be one of {list(CHECK_TYPES)}, got {c.get('type')!r}")
    if c["type"] == "function":
        if not isinstance(c.get("function"), str) or ":" not in c["function"]:
            raise TaskFileError(f"{where}: a function check names 'function': 'package.module:fn'")
        resolve_function(c["function"], where)
    elif "value" not in c:
        raise TaskFileError(f"{where}: a {c['type']} check needs 'value'")
    if c["type"] == "number":
        if not _is_num(c["value"]):
            raise TaskFileError(f"{where}: a number check's value must be a number, got {c['value']!r}")
        if "tol" in c and not (_is_num(c["tol"]) and c["tol"] >= 0):
            raise TaskFileError(f"{where}: check.tol must be a number >= 0, got {c['tol']!r}")
    if c["type"] == "regex":
        try:
            re.compile(str(c["value"]))
        except re.error as e:
            raise TaskFileError(f"{where}: check.value is not a regular expression ({e})") from None
    s = c.get("source")
    if s is not None and not (isinstance(s, dict) and isinstance(s.get("tool"), str)
                              and isinstance(s.get("field"), str) and set(s) <= {"tool", "field"}):
        raise TaskFileError(f"{where}: check.source must be {{\"tool\": NAME, \"field\": \"dotted.path\"}}, got {s!r}")
    gc = t.get("gold_calls", [])
    if not isinstance(gc, list) or not all(
            isinstance(g, dict) and isinstance(g.get("name"), str) and isinstance(g.get("arguments", {}), dict)
            and set(g) <= {"name", "arguments"} for g in gc):
        raise TaskFileError(f"{where}: gold_calls must be a list of {{\"name\", \"arguments\"}} objects")


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


_FUNCTIONS: dict[str, Any] = {}


def resolve_function(spec: str, where: str = "check.function"):
    if spec not in _FUNCTIONS:
        module, _, name = spec.partition(":")
        try:
            fn = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as e:
            raise TaskFileError(f"{where}: cannot load check function {spec!r} ({e})") from None
        if not callable(fn):
            raise TaskFileError(f"{where}: check function {spec!r} is not callable")
        _FUNCTIONS[spec] = fn
    return _FUNCTIONS[spec]


def numbers_in(text: str) -> list[float]:
    out = []
    for m in NUMBER.findall(text):
        try:
            out.append(float(m.replace(",", "")))
        except ValueError:
            pass
    return out


def check_answer(check: dict, answer: str, value: Any, task: dict | None = None, trajectory=None) -> float:
    """1.0 / 0.0 (a function check may return a fraction) for `answer` against `value`."""
    kind = check["type"]
    if kind == "function":
        r = resolve_function(check["function"])(answer=answer, task=task, trajectory=trajectory)
        r = float(r)
        if not 0.0 <= r <= 1.0:
            raise ValueError(f"check function {check['function']} returned {r}, not a score in [0, 1]")
        return r
    if kind == "exact":
        return float(answer.strip() == _text(value).strip())
    if kind == "contains":
        return float(_text(value).casefold() in answer.casefold())
    if kind == "regex":
        return float(re.search(str(value), answer) is not None)
    if not _is_num(value):       # number: a consistent-mode value read from a response may be text
        try:
            value = float(value)
        except (TypeError, ValueError):
            return 0.0
    tol = float(check.get("tol", 1e-6))
    return float(any(abs(x - value) <= tol + 1e-12 for x in numbers_in(answer)))


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def field_of(obj: Any, dotted: str) -> tuple[bool, Any]:
    """(found, value) of a dotted path ("items.0.stock") in a parsed JSON response."""
    for part in dotted.split(".") if dotted else []:
        if isinstance(obj, dict) and part in obj:
            obj = obj[part]
        elif isinstance(obj, list) and part.lstrip("-").isdigit() and -len(obj) <= int(part) < len(obj):
            obj = obj[int(part)]
        else:
            return False, None
    return True, obj
