"""Evaluation through the rollout engine: equal to the recorded pre-engine harness on the same
greedy model and items; errors are never scores; the CLI refuses bad arguments before loading."""
import importlib.util
import json
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
    """Same greedy model, same items: the same score, steps, real calls and malformed calls on every
    item, and the same first turn (the first prompt is the same token for token; later turns may
    differ: the harness that recorded the reference re-tokenized the conversation). Every turn here
    is cut by max_new_tokens: multi-turn items take one turn per user turn, as in that harness and BFCL."""
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
        assert (g["steps"], g["real_calls"], g["malformed"]) == (
            want["steps"], want["real_calls"], want["malformed"]), want["id"]
        turns = [m.get("content") for m in g["extra"]["transcript"] if m["role"] == "assistant"]
        assert turns[0] == want["assistant_turns"][0], want["id"]
    assert res["overall"] == pytest.approx(run["overall"])


def test_trainer_held_out_number_equals_fastrehearse_eval(tmp_path, monkeypatch):
    """The trainer's eval (train/rollouts.py evaluate) and `fastrehearse eval` on its exported checkpoint,
    same items, limits and seed: the same per-item scores, steps, sampled tokens and transcripts
    (sampled at temperature 1, so equal transcripts mean equal prompts, seeds and sampling), and the
    same success and fidelity numbers."""
    from fastrehearse.eval import runner
    from fastrehearse.train import rollouts
    from fastrehearse.train.config import load_config
    from fastrehearse.train.loop import train

    stores = []

    class Recording(runner.MemoryStore):
        def __init__(self):
            super().__init__()
            stores.append(self)

    monkeypatch.setattr(runner, "MemoryStore", Recording)     # the fidelity pass's scratch store
    monkeypatch.setattr(rollouts, "MemoryStore", Recording)   # the trainer's store (stores[0])
    run_dir = tmp_path / "run"
    cfg = load_config("configs/smoke.yaml", [f"run_dir={run_dir}", "steps=1", "sft.steps=1", "eval.num_tasks=3",
                                             "eval.before=false", "eval.temperature=1.0", "eval.fidelity=true"])
    summary = train(cfg)
    trainer = {r.id: r for r in stores[0].items()}
    assert len(trainer) == 3 and all(r.error is None for r in trainer.values())

    out = tmp_path / "cli"
    rc = cfg.rollout.engine
    res = cli.run(cli.build_parser().parse_args([
        "--suite", "builtin", "--categories", "test:easy:task", "--policy", str(run_dir / "export"),
        "--limit", "3", "--max-turns", str(rc.max_turns), "--max-new-tokens", str(rc.max_new_tokens),
        "--max-episode-tokens", str(rc.max_episode_tokens), "--batch-size", str(rc.max_batch_size),
        "--on-max-new-tokens", rc.on_max_new_tokens, "--on-malformed", rc.on_malformed,
        "--temperature", "1.0", "--seed", str(cfg.seed), "--measure-fidelity", "--out", str(out), "--quiet"]))
    got = {k[1]: v for k, v in _items(out).items()}
    assert set(got) == set(trainer)
    for i, t in trainer.items():
        c = got[i]
        assert (c["score"], c["steps"], c["gen_tokens"], c["rehearsal_tokens"], c["real_calls"]) == \
            (t.score, t.steps, t.gen_tokens, t.rehearsal_tokens, t.real_calls), i
        assert c["extra"]["transcript"] == t.extra["transcript"], i
        assert c["fidelity"] == t.fidelity, i
    assert res["overall"] == pytest.approx(summary["success_after"])


def test_trainer_eval_fails_loudly_when_no_task_could_run(tmp_path, monkeypatch):
    """Every held-out environment refuses to start (a simulator that is not there): the trainer stops
    with TrainingError naming the cause, instead of logging success 0.000."""
    from fastrehearse.envs.builtin.suite import BuiltinEnv
    from fastrehearse.train.config import load_config
    from fastrehearse.train.loop import TrainingError, train

    real_reset = BuiltinEnv.reset

    def refuse(self, task):   # held-out tasks only (setup checks a training prompt's length)
        if task.split == "test":
            raise ConnectionRefusedError("[Errno 111] Connection refused")
        return real_reset(self, task)

    monkeypatch.setattr(BuiltinEnv, "reset", refuse)
    cfg = load_config("configs/smoke.yaml", [f"run_dir={tmp_path / 'run'}", "steps=1", "sft.steps=0",
                                             "eval.num_tasks=2"])
    with pytest.raises(TrainingError, match="none of the 2 held-out tasks could run.*Connection refused"):
        train(cfg)
