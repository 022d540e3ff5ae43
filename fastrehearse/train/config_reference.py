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

from .config import TrainConfig, _type_name


def _comments(cls) -> dict[str, str]:
    """field name -> its comment: the `#` lines right above it and the one beside it (continued
    on the following comment-only lines), from the class's source (a dataclass keeps none)."""
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
            above = []
            j = i - 1
            while j >= 0 and lines[j].strip().startswith("#"):
                above.insert(0, lines[j].strip().lstrip("#").strip())
                j -= 1
            beside = []
            if "#" in lines[node.end_lineno - 1]:
                beside.append(lines[node.end_lineno - 1].split("#", 1)[1].strip())
                k = node.end_lineno
                while k < len(lines) and lines[k].strip().startswith("#") and \
                        len(lines[k]) - len(lines[k].lstrip()) > len(lines[i]) - len(lines[i].lstrip()):
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


def _rows(cls, prefix: str, sections: list):
    hints = typing.get_type_hints(cls)
    notes = _comments(cls)
    rows = []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(tp):
            sections.append((key, tp, notes.get(f.name, "")))
            continue
        rows.append((key, _type(tp), default, notes.get(f.name, "")))
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
    sections = [("", TrainConfig, "")]
    while sections:
        prefix, cls, note = sections.pop(0)
        found = []
        rows = _rows(cls, f"{prefix}." if prefix else "", found)
        title = f"`{prefix}`" if prefix else "top level"
        out += [f"## {title}", ""]
        doc = (cls.__doc__ or "").strip()
        if note:
            out += [note, ""]
        elif doc and not doc.startswith(cls.__name__ + "("):
            out += [" ".join(doc.split()), ""]
        if rows:
            out += ["| key | type | default | meaning |", "|---|---|---|---|"]
            out += [f"| `{k}` | {_cell(t)} | `{_cell(repr(d))}` | {_cell(c)} |" for k, t, d, c in rows]
            out.append("")
        sections[0:0] = found
    return "\n".join(out)


if __name__ == "__main__":
    print(reference(), end="")
