"""Run-directory and resume faults with the real `fastrehearse train` command on configs/smoke.yaml
(docs/faults.md): reusing a run_dir, resuming with changed settings, a torn metrics line, a corrupt
newest checkpoint, and a full disk (a small tmpfs; skipped where it cannot be mounted)."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXE = [sys.executable, "-m", "fastrehearse.cli", "train", "--config", "configs/smoke.yaml"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
QUICK = ["eval.num_tasks=0", "checkpoint.export=false"]


def _train(run_dir, *sets, args=(), check=True):
    cmd = EXE + ["--set", f"run_dir={run_dir}"]
    for s in (*QUICK, *sets):
        cmd += ["--set", s]
    out = subprocess.run(cmd + list(args), cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    if check and out.returncode != 0:
        raise AssertionError(f"train failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return out


def _rows(run_dir):
    return [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if x]


def _ckpts(run_dir):
    return sorted(p.name for p in (Path(run_dir) / "checkpoints").iterdir())


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A finished smoke run: 2 SFT + 3 RL steps, checkpoints at steps 4 and 5 (keep=2)."""
    d = tmp_path_factory.mktemp("base") / "run"
    _train(d)
    assert _ckpts(d) == ["step_00000004", "step_00000005"]
    return d


def _copy(base, tmp_path):
    d = tmp_path / "run"
    shutil.copytree(base, d)
    return d


def test_reuse_is_refused_and_overwrite_keeps_the_new_run(base, tmp_path):
    d = _copy(base, tmp_path)
    old_rows = (d / "metrics.jsonl").read_text()
    out = _train(d, check=False)
    assert out.returncode == 2 and "already holds a run" in out.stderr and "Traceback" not in out.stderr
    assert (d / "metrics.jsonl").read_text() == old_rows
    out = _train(d, "steps=1", "checkpoint.keep=1", args=["--overwrite"])
    assert "--overwrite: removed the previous run's" in out.stdout
    assert _ckpts(d) == ["step_00000003"]                      # the new run's last step, kept
    assert [r["step"] for r in _rows(d)] == [1, 2, 3]


def test_resume_follows_a_changed_lr_and_steps(base, tmp_path):
    """--resume with a changed LR and step count follows the new config.yaml, not the LR schedule
    (LambdaLR state) saved in the checkpoint."""
    from fastrehearse.train.config import load_config
    from fastrehearse.train.build import LRSchedule
    d = _copy(base, tmp_path)
    old_cfg = (d / "config.yaml").read_text()
    out = _train(d, "steps=5", "optim.lr=1e-3", args=["--resume"])
    assert "--resume: 'optim.lr' changed 0.0001 -> 0.001" in out.stdout
    assert "--resume: 'steps' changed 3 -> 5" in out.stdout
    new = load_config(ROOT / "configs/smoke.yaml", [f"run_dir={d}", *QUICK, "steps=5", "optim.lr=1e-3"])
    f = LRSchedule(new)
    rows = _rows(d)[5:]
    assert [r["step"] for r in rows] == [6, 7]
    for r in rows:
        assert r["lr"] == pytest.approx(1e-3 * f(r["step"]), rel=1e-12), r["step"]
    assert load_config(d / "config.yaml").optim.lr == 1e-3
    assert (d / "config.until_step_00000005.yaml").read_text() == old_cfg   # the previous one kept


def test_torn_metrics_line_and_corrupt_newest_checkpoint_resume(base, tmp_path):
    """A torn metrics line does not block --resume, and a corrupt newest checkpoint falls back to
    the previous one instead of ending in a torch traceback."""
    d = _copy(base, tmp_path)
    with open(d / "metrics.jsonl", "a") as f:
        f.write('{"time": 1, "stage": "rl", "lo')
    shard = next((d / "checkpoints" / "step_00000005").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:1000])
    out = _train(d, "steps=4", args=["--resume"])
    text = out.stdout + out.stderr
    assert "skipped a torn last line" in text
    assert "step_00000005 failed to load" in text and "previous complete checkpoint" in text
    assert "resumed from" in text and "step_00000004 (step 4)" in text
    assert "Traceback" not in text
    rows = _rows(d)                                            # every line parses again
    assert [r["step"] for r in rows][-2:] == [5, 6]
    assert "step_00000005.unloadable" in _ckpts(d) and "step_00000006" in _ckpts(d)


def _can_mount_tmpfs(tmp_path) -> bool:
    if shutil.which("unshare") is None:
        return False
    m = tmp_path / "probe"
    m.mkdir()
    r = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs {m}"],
                       capture_output=True)
    return r.returncode == 0


def test_full_disk_names_the_path_and_keeps_the_last_checkpoint(tmp_path):
    """A full disk is reported naming the path (not torch's "unexpected pos 704 vs 598"), and the
    last complete checkpoint stays."""
    if not _can_mount_tmpfs(tmp_path):
        pytest.skip("cannot mount a tmpfs here (needs unshare -rm)")
    mnt, out_dir = tmp_path / "mnt", tmp_path / "out"
    mnt.mkdir()
    # one checkpoint of the smoke model is ~50 MB (weights + Adam moments): the second cannot fit
    cmd = " ".join(EXE + ["--set", f"run_dir={mnt}/run", *[f"--set {s}" for s in QUICK]])
    script = (f"mount -t tmpfs -o size=80m tmpfs {mnt} || exit 99; {cmd}; echo rc=$?; "
              f"cp -r {mnt}/run {out_dir}")
    r = subprocess.run(["unshare", "-rm", "sh", "-c", script], cwd=ROOT, env=ENV, capture_output=True,
                       text=True, timeout=600)
    if r.returncode == 99:
        pytest.skip("tmpfs mount failed")
    assert "rc=1" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
    err = [x for x in r.stderr.splitlines() if x.startswith("fastrehearse train:")]
    assert len(err) == 1, r.stderr[-3000:]
    assert f"no space left on device at {mnt}/run/checkpoints/step_00000003.tmp" in err[0]
    assert "last complete checkpoint kept" in err[0] and "step_00000002" in err[0]
    assert "Traceback" not in r.stderr
    assert _ckpts(out_dir) == ["step_00000002"]
    # the kept checkpoint loads (weights finite) and resumes on a disk with room
    out = _train(out_dir, args=["--resume"])
    assert "resumed from" in out.stdout and "(step 2)" in out.stdout
    assert [r["step"] for r in _rows(out_dir)][-3:] == [3, 4, 5]
