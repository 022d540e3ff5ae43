"""eval.every: the held-out eval every N steps writes its own metrics rows (stage "eval"), and the
checkpoint with the best held-out success is kept (pinned against rotation) and named in
summary.json beside the last one."""
import json
from pathlib import Path

import pytest

from fastrehearse.train import loop
from fastrehearse.train.config import ConfigError, load_config

SMOKE = ["steps=3", "sft.steps=2", "eval.num_tasks=2", "eval.before=false", "checkpoint.keep=1",
         "checkpoint.export=false", "log.progress=false"]


def _rows(run_dir):
    return [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def test_smoke_run_writes_eval_rows_and_names_the_best(tmp_path):
    d = tmp_path / "run"
    summary = loop.train(load_config("smoke", [f"run_dir={d}", "eval.every=2", *SMOKE]))
    ev = [r for r in _rows(d) if r.get("stage") == "eval"]
    assert [r["step"] for r in ev] == [2, 4]
    assert all(r["eval_n"] == 2 and 0.0 <= r["eval_success"] <= 1.0 for r in ev)
    best = summary["best_checkpoint"]
    seen = [(r["step"], r["eval_success"]) for r in ev] + [(5, summary["success_after"])]
    top = max(s for _, s in seen)
    assert (best["step"], best["success"]) == (min(st for st, s in seen if s == top), top)   # earliest of the highest
    assert best["checkpoint"] == str(d / "checkpoints" / f"step_{best['step']:08d}")
    assert Path(best["checkpoint"]).is_dir() and (Path(best["checkpoint"]) / "COMPLETE").is_file()
    assert summary["last_checkpoint"] == str(d / "checkpoints" / "step_00000005")
    on_disk = json.loads((d / "summary.json").read_text())
    assert on_disk["best_checkpoint"] == best and on_disk["last_checkpoint"] == summary["last_checkpoint"]


def test_best_moves_with_success_and_survives_rotation(tmp_path, monkeypatch):
    scripted = iter([0.5, 1.0, 0.5])      # step 2, step 4, after (step 5)
    real = loop.evaluate

    def evaluate(run, *, tag):
        out = real(run, tag=tag)
        return dict(out, success=next(scripted))
    monkeypatch.setattr(loop, "evaluate", evaluate)
    d = tmp_path / "run"
    summary = loop.train(load_config("smoke", [f"run_dir={d}", "eval.every=2", *SMOKE]))
    assert [r["eval_success"] for r in _rows(d) if r.get("stage") == "eval"] == [0.5, 1.0]
    assert summary["best_checkpoint"] == {"step": 4, "success": 1.0,
                                          "checkpoint": str(d / "checkpoints" / "step_00000004")}
    kept = sorted(p.name for p in (d / "checkpoints").iterdir())
    assert kept == ["step_00000004", "step_00000005"]     # keep=1 rotated step 2 away, not the best


def test_eval_every_needs_eval_tasks():
    with pytest.raises(ConfigError, match="eval.every"):
        load_config("smoke", ["eval.every=2", "eval.num_tasks=0"])
    with pytest.raises(ConfigError, match="eval.every"):
        load_config("smoke", ["eval.every=-1"])


def test_resume_keeps_the_best_pinned(tmp_path, monkeypatch):
    scripted = iter([1.0, 0.5, 0.5, 0.5])      # step 2, step 4, after (step 4); resumed: after (step 5)
    real = loop.evaluate
    monkeypatch.setattr(loop, "evaluate", lambda run, *, tag: dict(real(run, tag=tag), success=next(scripted)))
    d = tmp_path / "run"
    base = [f"run_dir={d}", "eval.every=2", *[s for s in SMOKE if not s.startswith("steps=")]]
    loop.train(load_config("smoke", ["steps=2", *base]))
    summary = loop.train(load_config("smoke", ["steps=3", *base]), resume=True)
    best = d / "checkpoints" / "step_00000002"
    assert summary["best_checkpoint"] == {"step": 2, "success": 1.0, "checkpoint": str(best)}
    assert (best / "COMPLETE").is_file()                   # keep=1 rotated step 4 away, not step 2
    assert sorted(p.name for p in (d / "checkpoints").iterdir()) == ["step_00000002", "step_00000005"]
