"""What `--suite` means for the harness: the items to run, an environment factory per category, and
how many policy turns each category allows.

  builtin  categories are split[:level[:tools[:answer]]] of the builtin suite (default: test = mixed
           levels; test:easy:task = the demo preset's task distribution, graded on the call; with
           :answer the final answer must also state the tool's result)
  bfcl     single-turn AST categories through fastrehearse.eval.bfcl_single (one turn, no real
           execution: the calls are graded by BFCL's ast_checker); multi-turn categories through the
           real BFCL environment (fastrehearse.envs.bfcl), user turns fed one at a time
  tau2     categories are tau2 domains (default: telecom, solo mode), graded by tau2's evaluator
A trainer config (`--config`, `from_config`) names any suite -- a registry name with its options
(an MCP server, ...) or a user's suite by import path; categories are its splits (default: the
config's env.eval_split), graded by the suite's own `score`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from fastrehearse.envs import get_suite
from fastrehearse.envs.base import Suite, Task, ToolEnv
from fastrehearse.eval.bfcl_suite import BfclSingleTurnSuite

BFCL_SINGLE = ("simple_python", "multiple", "parallel", "parallel_multiple", "live_simple",
               "live_multiple", "irrelevance", "live_irrelevance")
BFCL_MULTI = ("multi_turn_base", "multi_turn_miss_func", "multi_turn_miss_param",
              "multi_turn_long_context")
DEFAULT_CATEGORIES = {"builtin": ("test",), "bfcl": BFCL_SINGLE + BFCL_MULTI, "tau2": ("telecom",)}
SUITES = tuple(DEFAULT_CATEGORIES)
# Policy turns per user turn. BFCL: its own MAXIMUM_STEP_LIMIT (bfcl_eval/constants/default_prompts.py).
# builtin tasks need 2-5 calls; tau2 telecom solo tasks a handful (tau2's orchestrator allows 100
# messages; 16 turns keeps CPU runs bounded -- an episode cut short scores what its state gives).
DEFAULT_MAX_TURNS = {"builtin": 12, "bfcl": 20, "tau2": 16}


@dataclass
class SuiteRun:
    items: list[tuple[str, Task]]
    make_env: Callable[[str], ToolEnv]
    max_turns_for: Callable[[str], int]


def _window(tasks_of, limit: int | None, offset: int) -> list[Task]:
    """Items offset .. offset+limit-1 of a category (`tasks_of(n)`: its first n items, None = all):
    a pilot set disjoint from the reported one, with the same item ids as in a full listing."""
    if offset < 0:
        raise ValueError(f"--offset must be >= 0, got {offset}")
    return tasks_of(None if limit is None else offset + limit)[offset:]


def build(suite: str, categories: list[str] | None, limit: int | None, max_turns: int | None = None,
          seed: int = 0, offset: int = 0) -> SuiteRun:
    """max_turns None: the suite's default (DEFAULT_MAX_TURNS); offset: skip each category's first
    items (`_window`)."""
    if suite not in SUITES:
        raise ValueError(f"--suite must be one of {SUITES}, got {suite!r}")
    cats = list(categories or DEFAULT_CATEGORIES[suite])
    max_turns = DEFAULT_MAX_TURNS[suite] if max_turns is None else max_turns
    if limit is not None and limit < 0:
        raise ValueError(f"--limit must be >= 0, got {limit}")
    suites: dict[str, Suite] = {}
    items: list[tuple[str, Task]] = []

    if suite == "builtin":
        for c in cats:   # "split[:level[:tools[:answer]]]", e.g. "test", "test:easy:task" (the demo's tasks)
            parts = c.split(":")
            split, level, tools, answer = parts[:1] + (parts[1:] + ["mixed", "auto", ""][len(parts) - 1:])[:3]
            if split not in ("train", "test") or c.count(":") > 3 or answer not in ("", "answer"):
                raise ValueError(f"--categories for builtin are split[:level[:tools[:answer]]] with split "
                                 f"train or test (e.g. test, test:easy:task, test:easy:task:answer), got {c!r}")
            # ":answer": EASY tasks also require the final answer to state the tool's result (levels
            # 1-3 always check the answer); without it EASY success = the spelled-out call was made.
            opts = {"easy_answer": True} if answer else {}
            suites[c] = get_suite("builtin", level=level, tools=tools, **opts)
            items += [(c, t) for t in _window(lambda n: suites[c].tasks(split, n), limit, offset)]
    elif suite == "bfcl":
        bad = [c for c in cats if c not in BFCL_SINGLE + BFCL_MULTI]
        if bad:
            raise ValueError(f"--categories: unknown BFCL categories {bad}; known: "
                             f"{list(BFCL_SINGLE + BFCL_MULTI)}")
        multi = None
        for c in cats:
            if c in BFCL_SINGLE:
                suites[c] = BfclSingleTurnSuite()
            else:
                multi = multi or get_suite("bfcl")
                suites[c] = multi
            items += [(c, t) for t in _window(lambda n: suites[c].tasks(c, n), limit, offset)]
    else:
        s = get_suite("tau2")
        for c in cats:      # a domain ("telecom") or "<domain>:<split>" ("telecom:test")
            suites[c] = s
            items += [(c, t) for t in _window(lambda n: s.tasks(c, n), limit, offset)]

    def make_env(c: str) -> ToolEnv:
        return suites[c].make_env()

    def max_turns_for(c: str) -> int:
        # Single-turn BFCL: one assistant turn is the whole answer.
        return 1 if c in BFCL_SINGLE else max_turns

    return SuiteRun(items, make_env, max_turns_for)


def from_config(cfg, categories: list[str] | None, limit: int | None, max_turns: int, offset: int = 0) -> SuiteRun:
    """The env of a trainer config (`cfg.env`: suite + options) over `categories` (its splits;
    default: env.eval_split)."""
    suite = get_suite(cfg.env.suite, **cfg.env.options)
    cats = list(categories or [cfg.env.eval_split])
    if limit is not None and limit < 0:
        raise ValueError(f"--limit must be >= 0, got {limit}")
    items = [(c, t) for c in cats for t in _window(lambda n: suite.tasks(c, n), limit, offset)]
    return SuiteRun(items, lambda c: suite.make_env(), lambda c: max_turns)
