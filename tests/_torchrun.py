"""Run a test worker under real `torchrun` processes (gloo on the CPU)."""
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc: int, script: str, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node=nproc script args...` from the repository root (`script`: a file in
    tests/, or "-m module"), one OpenMP thread per rank, Python tracebacks on a crash."""
    target = script.split() if script.startswith("-m ") else [str(ROOT / "tests" / script)]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--nnodes=1",
           f"--master_port={free_port()}", *target, *map(str, args)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
