"""BFCL test helpers (import after `pytest.importorskip("bfcl_eval")`)."""
from __future__ import annotations

from fastrehearse.envs import bfcl_compat
from fastrehearse.eval.bfcl_single import IRRELEVANCE_CATEGORIES, category_of


def answer_problems(entry: dict) -> list[str]:
    """Why no output can pass BFCL's checker for this single-turn entry ([] for a sound entry). A
    handful of live entries ship a possible_answer that contradicts their own function doc: a
    required parameter absent from the answer, a non-optional answer parameter the doc does not
    declare, or a required parameter whose list of acceptable values is empty."""
    if category_of(entry) in IRRELEVANCE_CATEGORIES:
        return []
    answer = entry.get("possible_answer")
    if answer is None:
        answer = bfcl_compat.load_answers(category_of(entry))[entry["id"]]["ground_truth"]
    docs = {d["name"]: d for d in entry["function"]}
    problems = []
    for item in answer:
        (name, params), = item.items()
        p = (docs.get(name) or {}).get("parameters") or {}
        declared, required = set(p.get("properties") or {}), set(p.get("required") or [])
        problems += [f"{name}: required parameter {r!r} has no acceptable value in possible_answer"
                     for r in sorted(required) if r not in params or params[r] == []]
        problems += [f"{name}: possible_answer requires {k!r}, which the doc does not declare"
                     for k, opts in params.items() if k not in declared and "" not in opts]
    return problems
