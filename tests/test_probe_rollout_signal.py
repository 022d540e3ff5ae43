"""benchmarks/probe_rollout_signal.py: the trainer's first-step rollouts of an arm, scored, no update."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import probe_rollout_signal as probe  # noqa: E402


def test_probe_reports_the_arms_rollout_signal(tmp_path, capsys):
    out = tmp_path / "sig"
    rc = probe.main(["--model", "tiny=tiny-llama", "--config", "configs/learning_tiny.yaml", "--arms", "Ca,Cag",
                     "--temperatures", "0.9", "--steps", "1", "--show", "1", "--out", str(out)])
    assert rc == 0
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert [(r["arm"], r["temperature"]) for r in rows] == [("Ca", 0.9), ("Cag", 0.9)]
    for r in rows:
        step = r["steps"][0]
        assert r["episodes"] == len(step["rewards"]) == 4 - r["failures"]     # 2 tasks x group 2
        assert r["reward"] == pytest.approx(sum(step["rewards"]) / len(step["rewards"]))
        assert all(x in (0.0, 1.0) for x in step["rewards"])                  # consistent: 0 or 1 (or malformed 0)
        assert r["groups"] == 2 and r["groups_with_act_signal"] == step["act_signal_groups"] <= 2
        # a group has ACT signal iff its two rewards differ (no strata in rehearse mode)
        assert r["groups_with_act_signal"] == sum(step["rewards"][i] != step["rewards"][i + 1] for i in (0, 2)) \
            or r["failures"]
        # the pass rule, recomputed
        assert r["signal"] == (0.05 < r["reward"] < 0.95 and r["groups_with_act_signal"] > 0)
        assert "world_reward" in r    # mode world: REHEARSE scored
    # same seeds, same checkpoint, no update: the gate changes advantages, never the rollouts
    assert rows[0]["steps"][0]["rewards"] == rows[1]["steps"][0]["rewards"]
    text = capsys.readouterr().out
    assert "--- task" in text and "signal" in text


@pytest.mark.parametrize("argv, msg", [
    (["--model", "a=tiny-llama", "--arms", "S"], "cannot be probed"),
    (["--model", "tiny-llama"], "NAME=PATH"),
    (["--model", "a=tiny-llama", "--model", "a=tiny-llama"], "given twice"),
    (["--model", "a=tiny-llama", "--steps", "0"], "--steps"),
    (["--model", "a=tiny-llama", "--temperatures", "0.5,0"], "must be > 0"),
    (["--model", "a=tiny-llama", "--temperatures", "hot"], "comma-separated numbers"),
])
def test_probe_refuses_bad_arguments(argv, msg, capsys):
    with pytest.raises(SystemExit):
        probe.parse_args(argv)
    assert msg in capsys.readouterr().err


def test_probe_refuses_a_directory_that_is_not_an_export(tmp_path, capsys):
    with pytest.raises(SystemExit):
        probe.parse_args(["--model", f"a={tmp_path}"])
    assert "not an HF export" in capsys.readouterr().err
