"""Evaluation through the rollout engine: equal to the recorded pre-engine harness on the same
greedy model and items; errors are never scores; the CLI refuses bad arguments before loading."""
import importlib.util
import json
import socket
from pathlib import Path

import pytest

from fastrehearse.eval import cli

DATA = Path(__file__).parent / "data"


def _reference_module():
    spec = importlib.util.spec_from_file_location("make_eval_reference", DATA / "make_eval_reference.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def reference():
    mod = _reference_module()
    return mod, json.loads((DATA / "eval_reference.json").read_text()), mod.reference_model()


def _items(out: Path) -> dict:
    rows = [json.loads(line) for line in open(out / "items.jsonl")]
    return {(r["category"], r["id"]): r for r in rows}


@pytest.mark.parametrize("run_index", [0, 1])
def test_engine_eval_matches_the_recorded_hf_generate_reference(tmp_path, reference, run_index):
    """Same greedy model, same items: the same score and the same first turn on every item (the
    first turn is the same prompt decoded token for token), the same steps and calls on every
    single-user-turn item (multi-turn: see the xfail test below)."""
    mod, ref, loaded = reference
    run = ref["runs"][run_index]
    argv = ["--suite", run["suite"], "--categories", *run["categories"], "--limit", str(run["limit"]),
            "--out", str(tmp_path)] + mod.COMMON
    res = cli.run(cli.build_parser().parse_args(argv), loaded=loaded)
    got = _items(tmp_path)
    assert len(got) == len(run["items"])
    for want in run["items"]:
        g = got[(want["category"], want["id"])]
        assert g["error"] is None, g["error"]
        assert g["score"] == want["score"], (want["id"], g["score"], want["score"])
        if not want["category"].startswith("multi_turn"):
            assert (g["steps"], g["real_calls"], g["malformed"]) == (
                want["steps"], want["real_calls"], want["malformed"]), want["id"]
        turns = [m.get("content") for m in g["extra"]["transcript"] if m["role"] == "assistant"]
        assert turns[0] == want["assistant_turns"][0], want["id"]
    assert res["overall"] == pytest.approx(run["overall"])


@pytest.mark.xfail(strict=True, reason="the engine ends an episode at an agent turn cut by max_new_tokens; "
                   "the old harness (and BFCL's runner) took the cut text as the reply and fed the next "
                   "user turn (see docs/eval.md, 'Known differences')")
def test_multi_turn_cut_turns_continue_like_the_reference(tmp_path, reference):
    mod, ref, loaded = reference
    run = ref["runs"][1]
    cats = [c for c in run["categories"] if c.startswith("multi_turn")]
    argv = ["--suite", "bfcl", "--categories", *cats, "--limit", str(run["limit"]), "--out", str(tmp_path)] + mod.COMMON
    cli.run(cli.build_parser().parse_args(argv), loaded=loaded)
    got = _items(tmp_path)
    want = {(w["category"], w["id"]): w["steps"] for w in run["items"] if w["category"] in cats}
    assert {k: got[k]["steps"] for k in want} == want
