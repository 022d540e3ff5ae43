"""The learning experiment (benchmarks/bench_learning.py, docs/learning.md) and the builtin suite's
held-out tool family it evaluates on.

Fast: the held-out family split (gold replay scores 1.0 on it; train tasks never expose, call or
name a held-out tool; splits stay disjoint and deterministic) and the experiment's plan (--dry-run).
Slow-marked: the --tiny pipeline end to end (a tiny random Llama through `fastrehearse train` and
`fastrehearse eval` for every arm and seed), checking the JSON schema and that every arm's numbers
are read from its own run directories.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fastrehearse.envs.builtin import DOMAINS, BuiltinSuite
from fastrehearse.envs.builtin.suite import parse_level_spec
from fastrehearse.envs.builtin.tasks import TEMPLATE_FAMILIES, TEMPLATES
from fastrehearse.envs.replay import replay_gold

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "bench_learning.py"
HELD = "calendar"


def _mentions(task, names) -> set[str]:
    """Held-out tool names anywhere in what the task shows or does (prompt, tools, gold messages)."""
    text = json.dumps({"prompt": task.payload["prompt"], "tools": task.payload["tools"], "gold": task.gold})
    return {n for n in names if n in text}


@pytest.mark.parametrize("level", ["easy", "mixed", "all"])
@pytest.mark.parametrize("tools", ["auto", "task", "all"])
def test_train_side_never_uses_the_held_out_family(level, tools):
    suite = BuiltinSuite(level=f"{level}@-{HELD}", tools=tools)
    for split in ("train", "test"):
        for t in suite.tasks(split, 40):
            assert not _mentions(t, DOMAINS[HELD]), (t.id, _mentions(t, DOMAINS[HELD]))


@pytest.mark.parametrize("level", ["easy", "mixed", "all"])
def test_held_out_family_is_its_own_tools_only_and_gold_scores_1(level):
    suite = BuiltinSuite(level=f"{level}@{HELD}", tools="auto", easy_answer=True)
    others = [n for d, ts in DOMAINS.items() if d != HELD for n in ts]
    tasks = suite.tasks("test", 24)
    assert len({t.id for t in tasks}) == 24
    for t in tasks:
        assert set(t.payload["tools"]) <= set(DOMAINS[HELD]) and not _mentions(t, others), t.id
        assert replay_gold(suite, t).score == 1.0, t.id


def test_family_split_is_deterministic_and_disjoint():
    a = BuiltinSuite(level=f"all@{HELD}")
    b = BuiltinSuite(level=f"all@{HELD}")
    ta, tb = a.tasks("test", 16), b.tasks("test", 16)
    assert [t.payload for t in ta] == [t.payload for t in tb]
    train = BuiltinSuite(level=f"all@{HELD}").tasks("train", 64)
    assert not {json.dumps(t.payload["combo"]) for t in train} & {json.dumps(t.payload["combo"]) for t in ta}
    assert not {t.payload["world_seed"] for t in train} & {t.payload["world_seed"] for t in ta}
    # a filter changes the task ids, so a filtered task is never confused with an unfiltered one
    assert not {t.id for t in ta} & {t.id for t in BuiltinSuite(level="all").tasks("test", 16)}


def test_template_family_map_matches_what_templates_do():
    for level in TEMPLATES:
        for t in BuiltinSuite(level=level).tasks("train", 30):
            fams = TEMPLATE_FAMILIES[t.payload["template"]]
            used = {d for d, ts in DOMAINS.items() for n in t.payload["tools"] if n in ts}
            assert fams is None or used <= fams, (t.id, used, fams)


@pytest.mark.parametrize("bad", ["mixed@", "mixed@weather", "mixed@-", "nope@calendar", "easy@calendar@x"])
def test_bad_family_spec_is_refused(bad):
    with pytest.raises(ValueError):
        BuiltinSuite(level=bad)


def test_plain_levels_unchanged():
    assert parse_level_spec("mixed") == ((1, 2, 3), None)
    assert parse_level_spec("easy@-convert")[1] == frozenset({"accounts", "shop", "calendar"})
