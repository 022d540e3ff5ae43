"""The fault table (docs/faults.md): every case is exercised here, as a user would meet it, with the
real `fastrehearse` command on the smoke config (tiny random Llama) in subprocesses, and the row is
written from what was observed: exit code, the message the user reads, what is left on disk.

    python benchmarks/fault_table.py                 # ~10 min on 2 CPU cores; writes docs/faults.md
    python benchmarks/fault_table.py --only resume   # cases whose name contains "resume" (no write)

A row's verdict is one of: refused (exit 2, one line, nothing written), stopped (exit 1, one line,
last complete checkpoint kept), recovered (the run goes on or resumes correctly), warned, handled.
When a check fails the verdict says so ("traceback", "silent wrong", "data loss", "unexpected") and
the script exits 1: the table is meant to hold none of those.
JSON: benchmarks/results/fault_table.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _output import RESULTS, SCRATCH  # noqa: E402
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TRITON_INTERPRET": "1"}
TRAIN = [sys.executable, "-m", "fastrehearse.cli", "train", "--config", "configs/smoke.yaml"]
EVAL = [sys.executable, "-m", "fastrehearse.cli", "eval"]
QUICK = ["eval.num_tasks=0", "checkpoint.export=false"]
BAD = ("traceback", "silent wrong", "data loss", "unexpected")


@dataclass
class Row:
    area: str
    fault: str
    sees: str
    kept: str
    verdict: str
    seconds: float = 0.0


class Check(Exception):
    """A case did not behave as the table claims; the message becomes the verdict."""


def sh(cmd, timeout=900, **kw):
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout, **kw)
    p.seconds = time.perf_counter() - t0
    return p


def train(run_dir, *sets, args=(), quick=True, inproc=False, **kw):
    cmd = TRAIN + ["--set", f"run_dir={run_dir}"]
    for s in ([*QUICK] if quick else []) + list(sets):
        cmd += ["--set", s]
    return cli_inproc(cmd[3:] + list(args)) if inproc else sh(cmd + list(args), **kw)


class _Done:
    def __init__(self, rc, out, err, seconds):
        self.returncode, self.stdout, self.stderr, self.seconds = rc, out, err, seconds


def cli_inproc(argv) -> _Done:
    """`fastrehearse <argv>` in this process (imports paid once, so the config cases stay cheap);
    an exception escaping the CLI is recorded as the traceback a user would see."""
    import contextlib
    import io
    import traceback
    from fastrehearse import cli
    out, err = io.StringIO(), io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = cli.main(list(argv))
        except SystemExit as e:
            rc = e.code
        except BaseException:  # noqa: BLE001 - what the user would see
            traceback.print_exc()
            rc = 1
    return _Done(rc, out.getvalue(), err.getvalue(), time.perf_counter() - t0)


def err_line(p) -> str:
    """The one line the user reads on stderr (the CLI's own error line)."""
    lines = [x for x in p.stderr.splitlines() if x.startswith("fastrehearse")]
    return lines[-1] if lines else (p.stderr.strip().splitlines() or [""])[-1]


def expect(cond, what):
    if not cond:
        raise Check(what)


def no_traceback(p):
    if "Traceback" in p.stdout + p.stderr:
        raise Check("traceback: " + (p.stderr.strip().splitlines() or ["?"])[-1][:160])


def refused(p, *needles):
    no_traceback(p)
    expect(p.returncode == 2, f"unexpected: exit {p.returncode}: {err_line(p)[:160]}")
    line = err_line(p)
    for n in needles:
        expect(n in line, f"unexpected message: {line[:200]}")
    return line


def rows_of(run_dir):
    from fastrehearse.train.metrics import read_metrics
    return read_metrics(Path(run_dir) / "metrics.jsonl")[0]


def ckpts(run_dir):
    d = Path(run_dir) / "checkpoints"
    return sorted(p.name for p in d.iterdir()) if d.is_dir() else []


TMP = [""]


def short(line: str, n: int = 150) -> str:
    line = line.replace("|", "\\|")
    if TMP[0]:
        line = line.replace(TMP[0], "<tmp>")
    return line if len(line) <= n else line[: n - 3] + "..."


# ----------------------------------------------------------------------------------------------
# Cases. Each returns (what the user sees, what is kept, verdict) or raises Check.


def config_case(sets, needles, tmp, args=(), inproc=True, when="before the model loads"):
    d = tmp / "cfg"
    p = train(d, *sets, args=args, inproc=inproc)
    line = refused(p, *needles)
    expect(not (d / "config.yaml").exists(), "unexpected: config.yaml written")
    if not inproc:
        when += f"; {p.seconds:.0f} s as a new process, imports included"
    return f"`{short(line, 230)}` ({when})", "nothing written", "refused (exit 2)"


CONFIG_CASES = [
    ("typo in `model.options` (`hiden_size`)", ["model.options.hiden_size=32"], ["did you mean 'hidden_size'"]),
    ("typo in `env.options` (`levle`)", ["env.options={levle: easy}"], ["did you mean 'level'"]),
    ("typo in a rollout engine key (`rollout.max_chunck`)", ["rollout.max_chunck=4"], ["did you mean 'max_chunk'"]),
    ("old `rollout.options` dict", ["rollout.options={max_chunk: 4}"], ["'rollout.options'"]),
    ("unknown suite (`env.suite=bfcll`)", ["env.suite=bfcll"], ["did you mean 'bfcl'"]),
    ("unknown split (`env.train_split=nope`)", ["env.train_split=nope"], ["'env.train_split' = 'nope'"]),
    ("`optim.lr=0`", ["optim.lr=0"], ["'optim.lr' must be > 0"]),
    ("`optim.lr=inf`", ["optim.lr=inf"], ["finite"]),
    ("`optim.lr=1e39` (inf in float32)", ["optim.lr=1e39"], ["float32"]),
    ("`sft.lr=0` with SFT steps", ["sft.lr=0"], ["'sft.lr' must be > 0"]),
    ("prompt longer than `rollout.max_episode_tokens`", ["rollout.max_episode_tokens=64", "max_tokens=64"],
     ["nothing would be generated or trained"], "at start, after the model loads"),
]

# `fastrehearse train --dry-run`: the GPU preset planned on the fake process group (no GPU, no weights).
PRESET = "configs/qwen3_8b_bfcl_multi_turn.yaml"
DRY_RUN_CASES = [
    ("`--dry-run --world-size 1` for a 2-node preset", ["--world-size", "1"],
     ["does not fit 79.19 GiB per GPU at world size 1", "largest:"]),
    ("`--dry-run --world-size 3` (does not divide the model)", ["--world-size", "3"],
     ["does not divide dimension 0 (151936)"]),
    ("`--dry-run` without `--world-size`", [], ["--dry-run needs --world-size"]),
]


def dry_run_case(args, needles, tmp):
    d = tmp / "dry"
    p = cli_inproc(["train", "--config", PRESET, "--set", f"run_dir={d}", *(["--dry-run"] + list(args))])
    line = refused(p, *needles)
    expect(not d.exists(), "unexpected: run_dir written")
    return f"`{short(line, 230)}`", "nothing written", "refused (exit 2)"


def case_world_size_without_dry_run(tmp):
    p = train(tmp / "run", args=["--world-size", "16"], inproc=True)
    line = refused(p, "--world-size only goes with --dry-run")
    expect(not (tmp / "run").exists(), "unexpected: run_dir written")
    return f"`{short(line)}`", "nothing written", "refused (exit 2)"


def case_model_dirs(tmp):
    import torch
    from safetensors.torch import save_file
    out = []
    for kind in ("no weights", "truncated safetensors"):
        d = tmp / kind.replace(" ", "_")
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
        if kind != "no weights":
            save_file({"w": torch.zeros(256, 256)}, str(d / "model.safetensors"))
            data = (d / "model.safetensors").read_bytes()
            (d / "model.safetensors").write_bytes(data[: len(data) // 3])
        p = train(tmp / "run", f"model.spec={d}", "model.options={}", inproc=True)
        line = refused(p, "'model.spec'")
        out.append((f"model directory with {kind}", f"`{short(line, 230)}`", "nothing written", "refused (exit 2)"))
    return out


def case_binary_config(tmp):
    f = tmp / "weights.bin"
    f.write_bytes(struct.pack("<16d", *range(16)) + b"\xff\xfe\x00")
    p = cli_inproc(["train", "--config", str(f)])
    return f"`{short(refused(p, 'not a text'))}`", "nothing written", "refused (exit 2)"


def case_cuda(tmp):
    import torch
    if torch.cuda.is_available():
        return None
    p = train(tmp / "run", "device=cuda", inproc=True)
    return f"`{short(refused(p, 'CUDA is not available'))}`", "nothing written", "refused (exit 2)"


def case_options_merge(tmp):
    from fastrehearse.train.config import load_config
    cfg = load_config(ROOT / "configs/smoke.yaml", ["env.options={level: mixed}"])
    expect(cfg.env.options.get("n_train") == 64 and cfg.env.options["level"] == "mixed",
           f"silent wrong: env.options became {cfg.env.options}")
    return (f"the mapping is merged: `{cfg.env.options}`", "-", "handled")


def base_run(tmp):
    """The reference: 2 SFT + 3 RL steps, a checkpoint every step from step 2 (keep=2)."""
    d = tmp / "base"
    p = train(d)
    no_traceback(p)
    if p.returncode != 0:
        raise SystemExit(f"the smoke run failed:\n{p.stderr[-3000:]}")
    return d


def copy(base, tmp, name):
    d = tmp / name
    shutil.copytree(base, d)
    return d


def case_reuse(base, tmp):
    d = copy(base, tmp, "reuse")
    before = (d / "metrics.jsonl").read_bytes()
    line = refused(train(d), "already holds a run")
    expect((d / "metrics.jsonl").read_bytes() == before and ckpts(d) == ckpts(base), "data loss")
    return f"`{short(line, 230)}`", "the old run, untouched", "refused (exit 2)"


def case_overwrite(base, tmp):
    d = copy(base, tmp, "overwrite")
    p = train(d, "steps=1", "checkpoint.keep=1", args=["--overwrite"])
    no_traceback(p)
    expect(p.returncode == 0, f"unexpected: exit {p.returncode}")
    expect(ckpts(d) == ["step_00000003"], f"data loss: checkpoints {ckpts(d)}")
    expect([r["step"] for r in rows_of(d)] == [1, 2, 3], "silent wrong: metrics mix two runs")
    return ("`--overwrite: removed the previous run's ...`, then the new run",
            "the new run's checkpoint step_00000003 and metrics", "handled")


def case_resume_lr(base, tmp):
    from fastrehearse.train.config import load_config
    from fastrehearse.train.build import LRSchedule
    d = copy(base, tmp, "resume_lr")
    p = train(d, "steps=5", "optim.lr=1e-3", args=["--resume"])
    no_traceback(p)
    expect(p.returncode == 0, f"unexpected: exit {p.returncode}")
    expect("'optim.lr' changed 0.0001 -> 0.001" in p.stdout, "silent wrong: change not announced")
    f = LRSchedule(load_config(ROOT / "configs/smoke.yaml", ["steps=5", "optim.lr=1e-3"]))
    new = rows_of(d)[5:]
    expect([r["step"] for r in new] == [6, 7], f"unexpected steps {[r['step'] for r in new]}")
    for r in new:
        expect(abs(r["lr"] - 1e-3 * f(r["step"])) <= 1e-15, f"silent wrong: lr {r['lr']} at step {r['step']}")
    expect((d / "config.until_step_00000005.yaml").is_file(), "data loss: previous config.yaml not kept")
    return ("`--resume: 'optim.lr' changed 0.0001 -> 0.001 (takes effect from step 5)`; lr of steps 6-7 "
            "follows the new schedule", "config.yaml (new) + config.until_step_00000005.yaml (old)", "handled")


def case_resume_forbidden(base, tmp):
    d = copy(base, tmp, "resume_forbidden")
    before = {n: (d / n).read_bytes() for n in ("config.yaml", "metrics.jsonl")}
    line = refused(train(d, "seed=1", "rollout.group_size=3", args=["--resume"]), "--resume cannot change",
                   "'seed' 0 -> 1")
    expect(all((d / n).read_bytes() == b for n, b in before.items()), "data loss: files rewritten")
    return f"`{short(line, 230)}`", "everything (nothing written)", "refused (exit 2)"


def case_torn_and_corrupt(base, tmp):
    out = []
    d = copy(base, tmp, "torn")
    with open(d / "metrics.jsonl", "a") as f:
        f.write('{"time": 1, "stage": "rl", "lo')
    p = train(d, "steps=4", args=["--resume"])
    no_traceback(p)
    expect(p.returncode == 0 and "skipped a torn last line" in p.stdout, f"unexpected: exit {p.returncode}")
    expect([r["step"] for r in rows_of(d)][-1] == 6, "unexpected: resumed run's rows missing")
    out.append(("torn last line in `metrics.jsonl` (killed mid-write), then `--resume`",
                "`[fastrehearse] .../metrics.jsonl: skipped a torn last line (29 bytes)`; resumes",
                "every complete row; the torn fragment is cut", "recovered"))
    d = copy(base, tmp, "corrupt")
    shard = next((d / "checkpoints" / "step_00000005").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:1000])
    p = train(d, "steps=4", args=["--resume"])
    no_traceback(p)
    line = next((x for x in p.stdout.splitlines() if "failed to load" in x), "")
    expect(p.returncode == 0 and line and "(step 4)" in p.stdout, f"unexpected: exit {p.returncode}")
    out.append(("corrupt newest checkpoint (truncated shard), then `--resume`", f"`{short(line, 200)}`; "
                "resumes from step 4", "step_00000005.unloadable (for inspection), step_00000004", "recovered"))
    return out


def case_kill9(base, tmp):
    d = tmp / "kill9"
    proc = subprocess.Popen(TRAIN + ["--set", f"run_dir={d}"] + sum([["--set", s] for s in QUICK], []),
                            cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    marker = d / "checkpoints" / "step_00000003" / "COMPLETE"
    t0 = time.time()
    while not marker.exists() and proc.poll() is None and time.time() - t0 < 600:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    p = train(d, args=["--resume"])
    no_traceback(p)
    ref = {r["step"]: r for r in rows_of(base)}
    done = {r["step"]: r for r in rows_of(d)}
    expect(p.returncode == 0 and max(done) == 5, f"unexpected: exit {p.returncode}")
    for s in (4, 5):
        expect(done[s]["loss"] == ref[s]["loss"], f"silent wrong: loss at step {s} differs after resume")
    return ("kill -9 after the step-3 checkpoint, then `--resume`", "resumes; steps 4-5 have the "
            "uninterrupted run's losses exactly", "complete checkpoints", "recovered")


def case_sigterm(tmp):
    d = tmp / "term"
    proc = subprocess.Popen(TRAIN + ["--set", f"run_dir={d}", "--set", "steps=50", "--set", "checkpoint.every=0"]
                            + sum([["--set", s] for s in QUICK], []), cwd=ROOT, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    t0 = time.time()
    while len(rows_of(d)) < 3 and proc.poll() is None and time.time() - t0 < 600:
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=600)
    expect(proc.returncode == 0 and "SIGTERM: checkpoint saved at step" in out, f"unexpected: exit {proc.returncode}")
    expect("Traceback" not in out, "traceback")
    return ("SIGTERM mid-run", "`SIGTERM: checkpoint saved at step N; exiting` (exit 0)", f"{ckpts(d)}", "handled")


def case_lr_overflow(tmp):
    d = tmp / "overflow"
    p = train(d, "optim.lr=1e38")
    no_traceback(p)
    expect(p.returncode == 0, f"unexpected: exit {p.returncode}: {err_line(p)[:160]}")
    line = next((x for x in p.stdout.splitlines() if "rolled back" in x), "")
    skipped = [r["step"] for r in rows_of(d) if r.get("skipped")]
    expect(line and skipped, "silent wrong: no update was rolled back")
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from fastrehearse.train.checkpoint import Checkpointer, nonfinite_keys
    from fastrehearse.train.parallelize import DistInfo
    done = Checkpointer(d, DistInfo(0, 1, 0, torch.device("cpu"), None)).complete()
    for c in done:
        dcp_to_torch_save(str(c), str(tmp / "flat.pt"))
        sd = torch.load(tmp / "flat.pt", weights_only=False)["model"]
        expect(not nonfinite_keys(sd), f"silent wrong: non-finite weights in COMPLETE {c.name}")
    return ("`optim.lr=1e38`: AdamW's step size (lr / (1 - beta1)) overflows float32",
            f"steps {skipped} `{short(line.split('skipped ', 1)[-1], 110)}`; counted in `skipped_steps`, "
            f"the run goes on as the cosine lowers the lr", f"finite COMPLETE checkpoints "
            f"{[c.name for c in done]}", "recovered")


def case_group1(tmp):
    d = tmp / "group1"
    p = train(d, "rollout.group_size=1", "sft.steps=0", "steps=1")
    no_traceback(p)
    expect(p.returncode == 0 and "group_size=1" in p.stdout, f"unexpected: exit {p.returncode}")
    z = [r.get("zero_signal_groups") for r in rows_of(d) if r.get("stage") == "rl"]
    expect(z == [1.0], f"silent wrong: zero_signal_groups {z}")
    return ("`rollout.group_size=1`", "warning at start: `rollout.group_size=1: ... every GRPO advantage is 0`;"
            " `zero_signal_groups` 1.0", "the run", "warned")


def case_plot_full(tmp):
    d = tmp / "plotfull"
    d.mkdir()
    os.symlink("/dev/full", d / "curves.tmp.png")      # the PNG is drawn into a full device
    p = train(d, "steps=1")
    no_traceback(p)
    expect(p.returncode == 0 and "curves.png update failed (no space left on device)" in p.stdout,
           f"unexpected: exit {p.returncode}")
    expect(len(rows_of(d)) == 3, "data loss: metrics rows missing")
    return ("`curves.png` cannot be written (full device)", "`curves.png update failed (no space left on device); "
            "training continues, metrics.jsonl has every row` (once)", "every metrics row, checkpoints",
            "handled")


def case_enospc(tmp):
    if shutil.which("unshare") is None:
        return None
    mnt, out = tmp / "mnt", tmp / "enospc_copy"
    mnt.mkdir()
    cmd = " ".join(TRAIN + ["--set", f"run_dir={mnt}/run"] + [f"--set {s}" for s in QUICK])
    script = f"mount -t tmpfs -o size=80m tmpfs {mnt} || exit 99; {cmd}; echo rc=$?; cp -r {mnt}/run {out}"
    p = sh(["unshare", "-rm", "sh", "-c", script])
    if p.returncode == 99:
        return None
    no_traceback(p)
    line = err_line(p)
    expect("rc=1" in p.stdout and "no space left on device at" in line, f"unexpected: {line[:160]}")
    expect(ckpts(out) == ["step_00000002"], f"data loss: {ckpts(out)}")
    q = train(out, args=["--resume"])
    expect(q.returncode == 0 and "(step 2)" in q.stdout, "unexpected: the kept checkpoint did not resume")
    return ("disk full while writing a checkpoint (80 MB tmpfs, ~50 MB per checkpoint)",
            f"`{short(line.replace(str(mnt), '<tmpfs>'), 170)}` (exit 1)",
            "step_00000002, complete; `--resume` continues from it", "stopped (exit 1)")


def eval_cases(tmp):
    out = []
    base = ["--suite", "builtin", "--policy", "tiny-llama", "--out", str(tmp / "ev")]
    for fault, args, needle in [
        ("`fastrehearse eval --limit 0`", ["--limit", "0"], "limit"),
        ("`fastrehearse eval --limit -1`", ["--limit", "-1"], "limit"),
        ("`fastrehearse eval --categories nope` (builtin)", ["--categories", "nope"], "nope"),
        ("`fastrehearse eval --suite bfcl --categories simple_pyton`",
         ["--suite", "bfcl", "--categories", "simple_pyton"], "simple_pyton"),
        ("`fastrehearse eval --policy /no/such/model`", ["--policy", "/no/such/model"], "/no/such/model"),
    ]:
        p = cli_inproc(EVAL[3:] + base + args)
        line = refused(p, needle)
        out.append((fault, f"`{short(line, 230)}`", "nothing run or written", "refused (exit 2)"))
    # items that cannot run: a prompt that alone exceeds --max-episode-tokens is an error, not a 0
    ev = tmp / "ev_err"
    cmd = EVAL + ["--suite", "builtin", "--policy", "tiny-llama", "--limit", "2", "--max-episode-tokens", "32",
                  "--out", str(ev), "--quiet"]
    p = sh(cmd)
    no_traceback(p)
    res = json.loads((ev / "results.json").read_text()) if (ev / "results.json").is_file() else {}
    expect(p.returncode == 1, f"unexpected: exit {p.returncode}: {err_line(p)[:160]}")
    items = [json.loads(x) for x in (ev / "items.jsonl").read_text().splitlines() if x.strip()] \
        if (ev / "items.jsonl").is_file() else []
    expect(all(i.get("score") is None for i in items), "silent wrong: an item that could not run was scored")
    p2 = sh(cmd)
    expect(p2.returncode == 1, "unexpected: the rerun did not retry the errors")
    out.append(("eval items that cannot run (prompt > `--max-episode-tokens 32`)",
                f"exit 1; `{short(err_line(p), 120)}`; reported as errors apart from accuracy",
                f"items.jsonl with {len(items)} error records (score null), retried on rerun"
                + (f"; results.json keys: {sorted(res)[:4]}" if res else ""), "stopped (exit 1)"))
    return out


# rollout.backend=vllm (ROLLOUT): the smoke config's model with head_dim 64 (vLLM-CPU has no
# attention kernel for the smoke model's 16), vLLM without torch.compile (start-up ~35 s, not ~150 s)
VLLM = ["rollout.backend=vllm", "model.options.hidden_size=128", "model.options.num_heads=2",
        "model.options.num_kv_heads=1", "rollout.vllm.enforce_eager=true", "rollout.vllm.kv_cache_gib=1",
        "algo.loss.entropy_coef=0"]


def case_vllm_missing(tmp):
    """vLLM hidden the way Python treats a missing package (sys.modules["vllm"] = None: find_spec
    gives None, import raises ModuleNotFoundError), in a new process."""
    d = tmp / "run"
    hide = "import sys; sys.modules['vllm'] = None; from fastrehearse.cli import main; sys.exit(main(sys.argv[1:]))"
    cmd = [sys.executable, "-c", hide] + TRAIN[3:] + ["--set", f"run_dir={d}"]
    for x in QUICK + VLLM:
        cmd += ["--set", x]
    line = refused(sh(cmd), "'rollout.backend' = 'vllm'", "vllm-cpu")
    expect(not d.exists(), "unexpected: run_dir written")
    return f"`{short(line, 230)}` (before the model loads)", "nothing written", "refused (exit 2)"


def _vllm_run(d, steps):
    """A trainer on vLLM in the background, its output in files (vLLM logs enough to fill a pipe
    nobody reads). `steps` large: the tiny model takes ~0.5 s a step, and the case must act while
    the run is still going (metrics.jsonl is block-buffered: rows can show up only at the end)."""
    out, err = (open(d.parent / f"{d.name}.{x}", "w+") for x in ("out", "err"))
    proc = subprocess.Popen(TRAIN + ["--set", f"run_dir={d}", "--set", f"steps={steps}"]
                            + sum([["--set", s] for s in QUICK + VLLM], []), cwd=ROOT, env=ENV,
                            stdout=out, stderr=err, text=True)
    proc.out, proc.err = out, err
    return proc


def _finish(proc, timeout=600) -> _Done:
    t0 = time.time()
    proc.wait(timeout=timeout)
    proc.out.seek(0)
    proc.err.seek(0)
    return _Done(proc.returncode, proc.out.read(), proc.err.read(), time.time() - t0)


def _descendants(pid):
    import psutil
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _vllm_run_until(d, n, timeout=900):
    """A trainer on vLLM (_vllm_run), returned once `n` RL rows are on disk while it is still going;
    killed, and the case failed, if it never gets there."""
    d.parent.mkdir(parents=True, exist_ok=True)
    proc = _vllm_run(d, 2000)
    t0 = time.time()
    while proc.poll() is None and time.time() - t0 < timeout:
        if sum(r.get("stage") == "rl" for r in rows_of(d)) >= n:
            return proc
        time.sleep(0.2)
    proc.kill()
    expect(False, f"unexpected: the run did not reach {n} RL step(s): {_finish(proc).stderr[-300:]}")


def case_vllm_owner_killed(tmp):
    """The vLLM engine runs inside the trainer's process (rollout/backends/vllm_backend.py): killing the
    trainer must leave no process of it behind."""
    import psutil
    d = tmp / "vllm_owner"
    proc = _vllm_run_until(d, 1)
    tree = _descendants(proc.pid)
    t0 = time.time()
    proc.kill()
    proc.wait()

    def left():
        return [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    while left() and time.time() - t0 < 30:
        time.sleep(0.1)
    stray = left()
    for p in stray:      # the table must not leave a process behind, whatever the verdict
        p.kill()
    expect(not stray, f"unexpected: {len(stray)} process(es) of the trainer still running 30 s after it died")
    return ("the trainer itself killed (`kill -9`, as by the OOM killer) with `rollout.backend=vllm`",
            "nothing (killed); the vLLM engine ran inside it: no process of the trainer is left, and no "
            "weights file exists to clean up (weights are streamed in process)",
            f"complete checkpoints {ckpts(d)}; no process left", "handled")


# ----------------------------------------------------------------------------------------------


def run_all(only: str | None) -> list[Row]:
    tmp = Path(tempfile.mkdtemp(prefix="fault_table_"))
    TMP[0] = str(tmp)
    rows: list[Row] = []

    def add(area, fault, fn, *a):
        if only and only not in fault and only not in area:
            return
        t0 = time.perf_counter()
        try:
            res = fn(*a)
        except Check as e:
            res = ("-", "-", str(e))
        except subprocess.TimeoutExpired:
            res = ("-", "-", "unexpected: timed out")
        dt = time.perf_counter() - t0
        if res is None:
            print(f"skip  {fault} (not possible here)", flush=True)
            return
        results = res if isinstance(res, list) else [res] if len(res) == 4 else [(fault, *res)]
        for r in results:
            rows.append(Row(area, r[0], r[1], r[2], r[3], round(dt / len(results), 1)))
            print(f"{rows[-1].verdict:18s} {r[0]}  ({dt:.0f} s)", flush=True)

    def sub(name):
        d = tmp / name
        d.mkdir()
        return d

    try:
        for i, (fault, sets, needles, *when) in enumerate(CONFIG_CASES):
            add("config", fault, config_case, sets, needles, sub(f"c{i}"), (), i > 0, *when)
        add("config", "`--set env.options={level: mixed}`", case_options_merge, sub("merge"))
        add("config", "bad model directories", case_model_dirs, sub("dirs"))
        add("config", "binary file as `--config`", case_binary_config, sub("bin"))
        add("config", "`device=cuda` without CUDA", case_cuda, sub("cuda"))
        for i, (fault, args, needles) in enumerate(DRY_RUN_CASES):
            add("dry run", fault, dry_run_case, args, needles, sub(f"d{i}"))
        add("dry run", "`--world-size 16` without `--dry-run`", case_world_size_without_dry_run, sub("ws"))
        base = base_run(tmp)
        add("run_dir", "training into a finished run's run_dir without `--resume`", case_reuse, base, tmp)
        add("run_dir", "same, with `--overwrite`", case_overwrite, base, tmp)
        add("resume", "`--resume --set optim.lr=1e-3 --set steps=5`", case_resume_lr, base, tmp)
        add("resume", "`--resume --set seed=1 --set rollout.group_size=3`", case_resume_forbidden, base, tmp)
        add("resume", "torn metrics line / corrupt checkpoint", case_torn_and_corrupt, base, tmp)
        add("resume", "kill -9 mid-run", case_kill9, base, tmp)
        add("resume", "SIGTERM", case_sigterm, tmp)
        add("integrity", "lr overflow", case_lr_overflow, sub("ovf"))
        add("integrity", "group_size=1", case_group1, sub("g1"))
        add("disk", "curves.png on a full device", case_plot_full, sub("plot"))
        add("disk", "ENOSPC during a checkpoint", case_enospc, sub("nospc"))
        add("eval", "eval CLI mistakes", eval_cases, sub("eval"))
        add("vllm", "`rollout.backend=vllm` without vLLM installed", case_vllm_missing, sub("novllm"))
        add("vllm", "trainer killed with a vLLM instance running", case_vllm_owner_killed, sub("vowner"))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return rows


def write(rows: list[Row], wall: float, record: bool) -> list[Path]:
    md = [
        "# Fault table: what a user sees, what is kept",
        "",
        "Regenerated by `python benchmarks/fault_table.py --record` (every row is exercised by that script with the",
        "real `fastrehearse` command on `configs/smoke.yaml`, a tiny random Llama: runs as subprocesses,",
        "config and CLI mistakes through `fastrehearse.cli.main` in the script's process, the first as a",
        "new process to time it; tmpfs rows need `unshare -rm`). Verdicts: **refused** (exit 2, one line naming the problem, nothing written),",
        "**stopped** (exit 1, one line, the last complete checkpoint kept), **recovered**, **warned**,",
        "**handled**. The script fails if a row is a traceback, a silent wrong result or a data loss.",
        f"Last run: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.machine()}, "
        f"{os.cpu_count()} CPU cores (load average {os.getloadavg()[0]:.1f} at the end: times in the table "
        f"include waiting for a shared CPU), Python {platform.python_version()}, {wall / 60:.1f} min. "
        "JSON: `benchmarks/results/fault_table.json`.",
        "",
        "| area | fault | what the user sees | what is kept | verdict |",
        "|---|---|---|---|---|",
    ]
    md += [f"| {r.area} | {r.fault} | {r.sees} | {r.kept} | {r.verdict} |" for r in rows]
    md += ["", "Not in this table (tested elsewhere): the kernels' `normalizers` / temperature checks",
           "(tests/test_policy_loss.py), eval items whose environment or user simulator is unreachable",
           "(tests/test_eval_*.py), full disk while appending `metrics.jsonl` (tests/test_faults_train.py).",
           ""]
    doc = ROOT / "docs" / "faults.md" if record else SCRATCH / "faults.md"
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text("\n".join(md))
    out = (RESULTS if record else SCRATCH) / "fault_table.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"hardware": f"{platform.machine()}, {os.cpu_count()} CPU cores, no GPU used",
                               "load_average_end": round(os.getloadavg()[0], 2),
                               "wall_s": round(wall, 1), "rows": [r.__dict__ for r in rows]}, indent=2))
    return [doc, out]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", help="run the cases whose area or name contains this (docs not written)")
    ap.add_argument("--record", action="store_true",
                    help="write docs/faults.md and benchmarks/results/fault_table.json (default: "
                         "runs/bench/faults.md and runs/bench/fault_table.json)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    rows = run_all(args.only)
    wall = time.perf_counter() - t0
    bad = [r for r in rows if any(r.verdict.startswith(b) for b in BAD)]
    if not args.only:
        paths = write(rows, wall, args.record)
        print(f"wrote {', '.join(map(str, paths))} ({len(rows)} rows, {wall / 60:.1f} min)")
    for r in bad:
        print(f"BAD: {r.fault}: {r.verdict}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
