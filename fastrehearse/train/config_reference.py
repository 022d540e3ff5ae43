"""docs/config.md, generated from the config dataclasses: every key of `fastrehearse train`'s YAML,
its type, default and the comment written beside it in the source. The dataclasses are the one
definition; tests/test_config_reference.py fails when the committed file differs from what this
module generates (regenerate: `python -m fastrehearse.train.config_reference > docs/config.md`)."""
from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import typing

from .config import REMOVED_KEYS, TrainConfig, _at, _fields, _type_name


def _comments(cls) -> dict[str, str]:
    """field name -> its comment: the `#` lines right above it (at its indentation) and the one
    beside it (continued on the following, deeper indented, comment-only lines), from the class's
    source (a dataclass keeps none)."""
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        src = textwrap.dedent(inspect.getsource(klass))
        lines = src.splitlines()
        body = ast.parse(src).body[0].body
        for node in body:
            if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
                continue
            i = node.lineno - 1
            indent = len(lines[i]) - len(lines[i].lstrip())
            above = []
            j = i - 1
            while j >= 0 and lines[j].strip().startswith("#") and len(lines[j]) - len(lines[j].lstrip()) == indent:
                above.insert(0, lines[j].strip().lstrip("#").strip())
                j -= 1
            beside = []
            if "#" in lines[node.end_lineno - 1]:
                beside.append(lines[node.end_lineno - 1].split("#", 1)[1].strip())
                k = node.end_lineno
                while k < len(lines) and lines[k].strip().startswith("#") and \
                        len(lines[k]) - len(lines[k].lstrip()) > indent:
                    beside.append(lines[k].strip().lstrip("#").strip())
                    k += 1
            out[node.target.id] = " ".join(above + beside).strip()
    return out


def _type(tp) -> str:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType")):
        return " or ".join(_type(a) for a in typing.get_args(tp))
    if origin in (list, tuple, dict):
        return _type_name(origin)
    return _type_name(tp)


def _rows(section, prefix: str, found: list):
    """The table rows of `section` (a default instance): its keys as users write them (an inline
    component's in their place), with the comment written beside each field in its own class."""
    rows = []
    for name, (path, tp) in _fields(type(section)).items():
        key = f"{prefix}{name}"
        if key in REMOVED_KEYS:
            continue
        holder, value = _at(section, path[:-1]), _at(section, path)
        note = _comments(type(holder)).get(path[-1], "")
        if dataclasses.is_dataclass(value):
            found.append((key, value, note))
        else:
            rows.append((key, _type(tp), value, note))
    return rows


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def reference() -> str:
    out = ["# Configuration reference", "",
           "Generated from the config dataclasses by `python -m fastrehearse.train.config_reference` "
           "(tests/test_config_reference.py fails when this file is stale). Keys are written in YAML as "
           "nested sections or on the command line as `--set section.key=value`; `fastrehearse train "
           "--config C --print-config` prints a run's resolved values. What may change on resume: "
           "docs/training.md.", ""]
    sections = [("", TrainConfig(), "")]
    while sections:
        prefix, section, note = sections.pop(0)
        found = []
        rows = _rows(section, f"{prefix}." if prefix else "", found)
        title = f"`{prefix}`" if prefix else "top level"
        out += [f"## {title}", ""]
        doc = (type(section).__doc__ or "").strip()
        if note:
            out += [note, ""]
        elif doc and not doc.startswith(type(section).__name__ + "("):
            out += [" ".join(doc.split()), ""]
        if rows:
            out += ["| key | type | default | meaning |", "|---|---|---|---|"]
            out += [f"| `{k}` | {_cell(t)} | `{_cell(repr(d))}` | {_cell(c)} |" for k, t, d, c in rows]
            out.append("")
        sections[0:0] = found
    return "\n".join(out)


if __name__ == "__main__":
    print(reference(), end="")
