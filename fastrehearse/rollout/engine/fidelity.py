"""World-model fidelity: how close a rehearsed tool response is to the real one for the same call.

Per pair (rehearsed, real):
  exact     1 if the two texts are equal after stripping whitespace (and, when both are JSON, if they
            parse to equal values, so key order and spacing do not matter)
  field_f1  F1 over the leaf fields of the two JSON values, each field a (path, value) pair:
            precision = |common| / |rehearsed fields|, recall = |common| / |real fields|. A list is
            indexed by position. When the real response is not JSON, the whole stripped text is one
            field (so F1 = exact); a non-JSON rehearsal of a JSON response has F1 0.
  predictable / hidden  (environments that label fields, e.g. the builtin suite's
            `fidelity_by_label`): the share of the real response's fields the episode's earlier
            responses and the tools' documented rules give (predictable), and of the others (hidden),
            that the rehearsal reproduces; None where the env gives no labels or a label has no field
Aggregated per tool and overall (means over pairs) by `aggregate`.
"""
from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any

_NOT_JSON = object()


def _load(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError, TypeError):
        return _NOT_JSON


def json_fields(value: Any, prefix: str = "$") -> Counter:
    """Leaf (path, value) pairs of a JSON value as a multiset. Empty containers are leaves."""
    out: Counter = Counter()
    if isinstance(value, dict) and value:
        for k, v in value.items():
            out += json_fields(v, f"{prefix}.{k}")
    elif isinstance(value, list) and value:
        for i, v in enumerate(value):
            out += json_fields(v, f"{prefix}[{i}]")
    else:
        out[(prefix, json.dumps(value, sort_keys=True))] += 1
    return out


@dataclass
class FidelityScore:
    tool: str
    exact: float
    field_f1: float
    predictable: float | None = None
    hidden: float | None = None


def score_pair(tool: str, rehearsed: str, real: str) -> FidelityScore:
    a, b = rehearsed.strip(), real.strip()
    ja, jb = _load(a), _load(b)
    if jb is _NOT_JSON:
        exact = float(a == b)
        return FidelityScore(tool, exact, exact)
    if ja is _NOT_JSON:
        return FidelityScore(tool, 0.0, 0.0)
    fa, fb = json_fields(ja), json_fields(jb)
    common = sum((fa & fb).values())
    p = common / max(1, sum(fa.values()))
    r = common / max(1, sum(fb.values()))
    f1 = 0.0 if common == 0 else 2 * p * r / (p + r)
    return FidelityScore(tool, float(ja == jb), f1)


def aggregate(scores: list[FidelityScore]) -> dict:
    """{"n", "exact", "field_f1", "per_tool": {tool: {"n", "exact", "field_f1"}}} (means)."""
    per: dict[str, list[FidelityScore]] = defaultdict(list)
    for s in scores:
        per[s.tool].append(s)

    def summary(ss):
        n = len(ss)
        out = {"n": n, "exact": sum(s.exact for s in ss) / n if n else None,
               "field_f1": sum(s.field_f1 for s in ss) / n if n else None}
        for k in ("predictable", "hidden"):   # only where the env labels fields
            v = [getattr(s, k) for s in ss if getattr(s, k) is not None]
            if v:
                out[k], out[f"n_{k}"] = sum(v) / len(v), len(v)
        return out

    out = summary(scores)
    out["per_tool"] = {t: summary(ss) for t, ss in sorted(per.items())}
    return out
