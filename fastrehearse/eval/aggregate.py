"""Overall scores: BFCL's own leaderboard aggregation, and a plain mean for the other suites.

BFCL v4 (bfcl_eval/eval_checker/eval_runner_helper.py, `generate_leaderboard_csv`) computes
  non_live    = unweighted mean of [simple (= mean of simple_python/java/javascript), multiple,
                parallel, parallel_multiple]
  live        = mean of live_simple/live_multiple/live_parallel/live_parallel_multiple weighted by
                category size
  irrelevance = unweighted mean of [irrelevance, live_irrelevance]
  multi_turn  = unweighted mean of [base, miss_func, miss_param, long_context]
  agentic     = web search + memory (needs live web / memory backends: not run offline)
  overall     = weights 10/10/10/30/40 over those five groups, a category not run counting as 0.
We call BFCL's own helper functions for every mean. Two overall numbers are reported:
  `overall`              the same formula restricted to what was run: a group averages only its
                         evaluated categories and the group weights are renormalized over groups
                         with at least one evaluated category (agentic is never run offline);
  `bfcl_overall_strict`  BFCL's exact formula, every category not run (java, javascript,
                         live_parallel*, agentic, ...) counting as 0, as the leaderboard would print.
Live weighting uses each category's full size (what BFCL weights by), not the --limit sample size.
"""
from __future__ import annotations

import functools
from typing import Any

from fastrehearse.envs.bfcl_compat import install_shim

GROUPS = {
    "non_live": ["simple_python", "multiple", "parallel", "parallel_multiple"],
    "live": ["live_simple", "live_multiple", "live_parallel", "live_parallel_multiple"],
    "irrelevance": ["irrelevance", "live_irrelevance"],
    "multi_turn": ["multi_turn_base", "multi_turn_miss_func", "multi_turn_miss_param",
                   "multi_turn_long_context"],
    "agentic": ["web_search_base", "web_search_no_snippet", "memory_kv", "memory_vector",
                "memory_rec_sum"],
}
WEIGHTS = {"non_live": 10, "live": 10, "irrelevance": 10, "multi_turn": 30, "agentic": 40}
SIMPLE = ["simple_python", "simple_java", "simple_javascript"]


def mean_overall(categories: dict[str, dict[str, Any]]) -> float | None:
    """Item-weighted accuracy over every scored item (builtin, tau2); None when nothing was scored
    (items that could not run are errors, never zeros)."""
    scored = [c for c in categories.values() if c["n"] and c["accuracy"] is not None]
    n = sum(c["n"] for c in scored)
    return sum(c["accuracy"] * c["n"] for c in scored) / n if n else None


def _bfcl_helpers():
    """BFCL's helper module. bfcl_eval (optional) is imported here, behind the shim, and below in
    _category_size after this has run: the other suites' scores never need it."""
    install_shim()
    from bfcl_eval.eval_checker import eval_runner_helper as h
    return h


@functools.lru_cache(maxsize=None)
def _category_size(name: str) -> int | None:
    """Entries in a BFCL category: lines of its JSONL data file (cheap; BFCL's own loader also
    builds every entry's function docs, seconds per category)."""
    try:
        _bfcl_helpers()
        from bfcl_eval.constants.category_mapping import VERSION_PREFIX
        from bfcl_eval.constants.eval_config import PROMPT_PATH
        path = PROMPT_PATH / f"{VERSION_PREFIX}_{name}.json"
        with open(path) as f:
            return sum(1 for line in f if line.strip())
    except Exception:
        return None


def bfcl_overall(categories: dict[str, dict[str, Any]]) -> dict[str, Any]:
    h = _bfcl_helpers()
    # a category none of whose items could run (all errors) counts as not run
    categories = {k: c for k, c in categories.items() if c["n"] and c["accuracy"] is not None}

    def cat(name: str, strict: bool) -> dict | None:
        if name in categories:
            c = categories[name]
            size = _category_size(name) or c["n"]
            return {"accuracy": c["accuracy"], "total_count": size, "display_accuracy": c["accuracy"]}
        if strict:
            return {"accuracy": 0.0, "total_count": _category_size(name) or 1, "display_accuracy": "N/A"}
        return None

    def groups(strict: bool) -> dict[str, dict | None]:
        out: dict[str, dict | None] = {}
        simple = [x for x in (cat(n, strict) for n in SIMPLE) if x is not None]
        simple_d = h.calculate_unweighted_accuracy(simple, False) if simple else None
        nl = [x for x in [simple_d] + [cat(n, strict) for n in GROUPS["non_live"][1:]] if x is not None]
        out["non_live"] = h.calculate_unweighted_accuracy(nl, False) if nl else None
        lv = [x for x in (cat(n, strict) for n in GROUPS["live"]) if x is not None]
        out["live"] = h.calculate_weighted_accuracy(lv, False) if lv else None
        for g in ("irrelevance", "multi_turn"):
            xs = [x for x in (cat(n, strict) for n in GROUPS[g]) if x is not None]
            out[g] = h.calculate_unweighted_accuracy(xs, False) if xs else None
        if strict:
            ws = [cat(n, True) for n in GROUPS["agentic"][:2]]
            mem = [cat(n, True) for n in GROUPS["agentic"][2:]]
            out["agentic"] = h.calculate_unweighted_accuracy(
                [h.calculate_unweighted_accuracy(ws, False), h.calculate_unweighted_accuracy(mem, False)], False)
        else:
            out["agentic"] = None
        return out

    def total(gs: dict[str, dict | None]) -> float | None:
        names = [g for g in WEIGHTS if gs.get(g) is not None]
        if not names:
            return None
        r = h.calculate_percentage_weighted_accuracy([gs[g] for g in names], [WEIGHTS[g] for g in names],
                                                     display_na_if_category_missing=False)
        return float(r["accuracy"])

    loose, strict = groups(False), groups(True)
    return {
        "overall": total(loose),
        "bfcl_overall_strict": total(strict),
        "groups": {g: (None if v is None else float(v["accuracy"])) for g, v in loose.items()},
        "group_weights": WEIGHTS,
    }
