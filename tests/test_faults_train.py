"""Faults inside the trainer, in one process (docs/faults.md): non-finite updates rolled back, checkpoints
of non-finite weights refused, rotation keeps the checkpoint just written, a checkpoint that fails
to load falls back to the previous one, torn metrics lines, full disks, plots that fail, and
zero_signal_groups with groups of one."""
import errno
import json
import os
from pathlib import Path

import pytest
import torch

from fastrehearse.train.build import setup
from fastrehearse.train.loop import rl_step
from fastrehearse.train.checkpoint import Checkpointer
from fastrehearse.train.config import load_config, warnings_for
from fastrehearse.train.errors import DiskFullError, TrainingError
from fastrehearse.train.metrics import MetricsLogger, read_metrics
from fastrehearse.train.parallelize import DistInfo, init_distributed
from fastrehearse.train.update import policy_update

pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = Path(__file__).resolve().parents[1]
INFO = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend=None)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("faults")
    cfg = load_config(ROOT / "configs/smoke.yaml", [f"run_dir={d}", "eval.num_tasks=0",
                                                    "max_consecutive_skips=2", "rollout.group_size=1"])
    return setup(cfg, init_distributed("cpu"))


def _params(run):
    return {n: p.detach().clone() for n, p in run.policy.named_parameters()}


def test_nonfinite_update_is_rolled_back_and_counted_then_stops(run):
    """optim.lr=inf: the non-finite update is rolled back and counted, never applied (NaN weights
    checkpointed as COMPLETE), and the run stops."""
    from _train_dist_worker import episodes
    eps = episodes(len(run.tokenizer))
    run.state.consecutive_skips = run.state.skipped_steps = 0
    policy_update(run, eps, stage="sft")             # healthy step: Adam moments exist
    before = _params(run)
    moments = {k: v.clone() for k, v in run.optimizer.state[next(iter(run.policy.parameters()))].items()}
    for g in run.optimizer.param_groups:
        g["lr"] = float("inf")
    try:
        row = policy_update(run, eps, stage="sft")
        assert row["skipped"] == 1 and run.state.skipped_steps == 1
        for n, p in run.policy.named_parameters():         # rolled back exactly, finite
            assert torch.equal(p, before[n]), n
        st = run.optimizer.state[next(iter(run.policy.parameters()))]
        for k, v in moments.items():                       # Adam moments and step count too
            assert torch.equal(st[k], v), k
        with pytest.raises(TrainingError, match="2 consecutive steps skipped.*non-finite weights"):
            policy_update(run, eps, stage="sft")
    finally:
        for g in run.optimizer.param_groups:
            g["lr"] = run.cfg.optim.lr
        run.state.consecutive_skips = 0


def test_checkpoint_of_nonfinite_weights_is_never_complete(run, tmp_path):
    ck = Checkpointer(tmp_path, INFO, keep=2)
    ck.save(1, run.policy, run.optimizer, {"step": 1})
    w = run.hf_model.model.norm.weight
    saved = w.detach().clone()
    with torch.no_grad():
        w[0] = float("nan")
    try:
        with pytest.raises(TrainingError, match=r"weights are not finite at step 2 .*norm.*last complete "
                                                r"one kept: .*step_00000001"):
            ck.save(2, run.policy, run.optimizer, {"step": 2})
    finally:
        with torch.no_grad():
            w.copy_(saved)
    assert [p.name for p in ck.complete()] == ["step_00000001"]
    assert not (tmp_path / "checkpoints" / "step_00000002.tmp").exists()


def test_rotation_never_deletes_the_checkpoint_just_written(run, tmp_path):
    """Rotation kept the highest step numbers: a checkpoint written below an older run's (or a
    fallback's) steps was deleted right after it was announced."""
    ck = Checkpointer(tmp_path, INFO, keep=2)
    for s in (5, 6):
        ck.save(s, run.policy, run.optimizer, {"step": s})
    ck.save(2, run.policy, run.optimizer, {"step": 2})
    ck.save(3, run.policy, run.optimizer, {"step": 3})
    names = [p.name for p in ck.complete()]
    assert "step_00000003" in names and "step_00000002" in names     # keep=2 among this run's
    assert {"step_00000005", "step_00000006"} <= set(names)          # later steps are not rotation's


def test_unloadable_checkpoint_falls_back_to_the_previous_one(run, tmp_path):
    ck = Checkpointer(tmp_path, INFO, keep=3)
    ck.save(1, run.policy, run.optimizer, {"step": 1})
    want = _params(run)
    ck.save(2, run.policy, run.optimizer, {"step": 2})
    shard = next((tmp_path / "checkpoints" / "step_00000002").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])     # torn shard
    logs = []
    path, state = ck.load_latest(run.policy, run.optimizer, log=logs.append)
    assert path.name == "step_00000001" and state == {"step": 1}
    assert len(logs) == 1 and "step_00000002 failed to load" in logs[0] and "previous" in logs[0]
    assert (tmp_path / "checkpoints" / "step_00000002.unloadable").is_dir()   # kept, never picked
    assert ck.latest().name == "step_00000001"
    for n, p in run.policy.named_parameters():
        assert torch.equal(p, want[n]), n


def test_metrics_torn_last_line_is_skipped_and_cut(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text('{"step": 1, "loss": 0.5}\n{"step": 2, "loss": 0.4}\n{"step": 3, "lo')
    rows, notes = read_metrics(p)
    assert [r["step"] for r in rows] == [1, 2] and "torn last line" in notes[0]
    log = MetricsLogger(tmp_path, progress=False, plot_every=0)    # a resumed run: cut, then append
    log.log({"step": 3, "loss": 0.3})
    assert [json.loads(x)["step"] for x in p.read_text().splitlines()] == [1, 2, 3]


def test_full_disk_on_metrics_is_a_clear_error_and_plot_failures_never_stop(tmp_path, capsys):
    log = MetricsLogger(tmp_path, progress=False, plot_every=1)
    log.log({"step": 1, "loss": 0.5})
    assert (tmp_path / "curves.png").is_file()
    # the PNG's temporary file lands on a full device: reported once, training goes on
    for step in (2, 3):
        os.symlink("/dev/full", tmp_path / "curves.tmp.png")
        log.log({"step": step, "loss": 0.4})
        (tmp_path / "curves.tmp.png").unlink(missing_ok=True)
    out = capsys.readouterr().out
    assert out.count("curves.png update failed (no space left on device)") == 1
    assert len(read_metrics(tmp_path / "metrics.jsonl")[0]) == 3
    (tmp_path / "metrics.jsonl").unlink()
    os.symlink("/dev/full", tmp_path / "metrics.jsonl")            # metrics.jsonl itself: stop
    with pytest.raises(DiskFullError, match=f"no space left on device at {tmp_path}/metrics.jsonl"):
        log.log({"step": 4, "loss": 0.2})


def test_disk_full_is_recognised_from_torch_short_writes(tmp_path, monkeypatch):
    from fastrehearse.train import errors
    assert errors.is_disk_full(OSError(errno.ENOSPC, "No space left on device"), tmp_path)
    monkeypatch.setattr(errors, "_free_bytes", lambda p: 1000)
    assert errors.is_disk_full(RuntimeError("[enforce fail at inline_container.cc] unexpected pos 704 vs 598"),
                               tmp_path)
    monkeypatch.setattr(errors, "_free_bytes", lambda p: 10 << 30)
    assert not errors.is_disk_full(RuntimeError("unexpected pos 704 vs 598"), tmp_path)


def test_group_size_one_reports_zero_signal_honestly(run):
    """zero_signal_groups was 0.0 with group_size=1 while every advantage was 0."""
    run.state.consecutive_skips = 0
    row = rl_step(run)
    assert row["zero_signal_groups"] == 1.0
    assert any("group_size=1" in w for w in warnings_for(run.cfg))


def test_tensorboard_writer_mirrors_metrics(tmp_path):
    pytest.importorskip("tensorboard")
    log = MetricsLogger(tmp_path, progress=False, plot_every=0, tensorboard=True)
    log.log({"step": 1, "stage": "rl", "loss": 0.5, "reward": 0.25})
    log.close()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("rl/loss")] == [(1, 0.5)]
    assert len(read_metrics(tmp_path / "metrics.jsonl")[0]) == 1        # metrics.jsonl stays the truth
