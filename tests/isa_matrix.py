"""Run the numeric tests under every CPU instruction set and thread count this machine has.

torch's CPU kernels (and MKL's GEMM) sum in a different order for each instruction set
(`ATEN_CPU_CAPABILITY=default | avx2 | avx512`), thread count and BLAS code path, so an fp32
tolerance that fits one summation order can fail on another CPU (docs/tolerances.md: an Intel
Xeon dispatching to AVX-512 fails bounds that pass on AMD machines). This runs the kernel,
loss, packing, model, trainer-equivalence and adapter test files once per configuration and
prints a table; it exits non-zero if any configuration fails.

    python tests/isa_matrix.py            # the full matrix (`make test-isa`)
    python tests/isa_matrix.py --quick    # what `make test` adds: the non-native instruction
                                          # sets and the alt-BLAS paths, 1 thread each

Configurations: each capability the CPU supports x {1, 2} threads, plus one run on the other
libraries' other code paths ("alt BLAS"): MKL's "compatible" GEMM branch (`MKL_CBWR=COMPATIBLE`:
another blocking, so another summation order for every torch matmul), and for the Triton
interpreter, which computes `tl.dot` with numpy's OpenBLAS and `tl.exp` with numpy's SIMD exp,
OpenBLAS's Haswell kernels (`OPENBLAS_CORETYPE`, unless already set) and numpy without its
AVX2 / AVX-512 loops (`NPY_DISABLE_CPU_FEATURES`). Modules that pin one thread (`one_thread`
fixture) run single-threaded in every configuration; the thread axis reaches the rest.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

NUMERIC_FILES = [
    "tests/test_fused_lse.py", "tests/test_linear_logprobs.py", "tests/test_kernel_model_heads.py",
    "tests/test_kernel_variants.py", "tests/test_kernel_vocab_outer.py", "tests/test_policy_loss.py",
    "tests/test_fused_loss_plan.py", "tests/test_algo.py", "tests/test_algo_tis.py",
    "tests/test_packing.py", "tests/test_model.py", "tests/test_model_attention.py",
    "tests/test_integration_trl.py", "tests/test_integration_verl.py",
    "tests/test_teacher_forced.py", "tests/test_train_heads.py", "tests/test_tolerances.py",
]


@dataclass
class Config:
    capability: str
    threads: int
    alt_blas: dict[str, str] | None = None
    result: str = "not run"
    failed: list[str] = field(default_factory=list)
    seconds: float = 0.0
    rc: int | None = None

    @property
    def name(self) -> str:
        return f"{self.capability}/{self.threads}t" + ("/alt-BLAS" if self.alt_blas else "")

    def env(self) -> dict[str, str]:
        env = dict(os.environ, ATEN_CPU_CAPABILITY=self.capability,
                   OMP_NUM_THREADS=str(self.threads), PYTHONUNBUFFERED="1")
        env.pop("MKL_CBWR", None)
        env.update(self.alt_blas or {})
        return env


def alt_blas(caps: list[str]) -> dict[str, str]:
    """The other code paths of MKL, OpenBLAS and numpy that this CPU can run."""
    env = {"MKL_CBWR": "COMPATIBLE"}
    if "avx2" in caps and "OPENBLAS_CORETYPE" not in os.environ:
        env["OPENBLAS_CORETYPE"] = "Haswell"
    probe = ("from numpy._core._multiarray_umath import __cpu_dispatch__ as d, __cpu_features__ as f;"
             "print(' '.join(k for k in d if f.get(k)))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    if out.returncode == 0 and out.stdout.strip():   # numpy's dispatched loops -> its baseline
        env["NPY_DISABLE_CPU_FEATURES"] = out.stdout.strip()
    return env


def capability_under(value: str | None) -> str:
    """What torch dispatches to with ATEN_CPU_CAPABILITY=value (None: the machine's own choice).
    torch ignores a value the CPU cannot run and falls back, so this also tells support."""
    env = dict(os.environ)
    env.pop("ATEN_CPU_CAPABILITY", None)
    if value:
        env["ATEN_CPU_CAPABILITY"] = value
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.backends.cpu."
                          "get_cpu_capability())"], env=env, capture_output=True, text=True,
                         check=True)
    return out.stdout.strip().lower()


def plan(quick: bool) -> tuple[str, list[Config]]:
    native = capability_under(None)
    caps = [c for c in ("default", "avx2", "avx512") if capability_under(c) == c]
    if quick:   # every summation order the machine's own `make test` does not already cover
        cfgs = [Config(c, 1) for c in caps if c != native]
        cfgs.append(Config(native, 1, alt_blas(caps)))
    else:
        cfgs = [Config(c, t) for c in caps for t in (1, 2)]
        cfgs.append(Config(native, 2, alt_blas(caps)))
    return native, cfgs


def run(cfgs: list[Config], files: list[str], cores: int, extra: list[str]) -> None:
    """Run configurations side by side while their threads fit the cores."""
    pending, running = list(cfgs), []
    while pending or running:
        while pending and sum(c.threads for c, _, _ in running) + pending[0].threads <= max(
                cores, pending[0].threads):
            cfg = pending.pop(0)
            cmd = [sys.executable, "-m", "pytest", "-q", "--no-header", "-p", "no:cacheprovider",
                   "-rf", *extra, *files]
            proc = subprocess.Popen(cmd, cwd=ROOT, env=cfg.env(), stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True)
            print(f"[isa] start {cfg.name}", flush=True)
            running.append((cfg, proc, time.monotonic()))
        time.sleep(0.5)
        for item in list(running):
            cfg, proc, t0 = item
            if proc.poll() is None:
                continue
            out = proc.stdout.read()
            running.remove(item)
            cfg.seconds, cfg.rc = time.monotonic() - t0, proc.returncode
            tail = [ln for ln in out.strip().splitlines() if ln.strip()]
            cfg.result = tail[-1].strip("= ") if tail else "no output"
            cfg.failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", out, flags=re.M)
            if cfg.rc != 0:
                print(out[-6000:], flush=True)
            print(f"[isa] done  {cfg.name}: {cfg.result}", flush=True)


def table(native: str, cfgs: list[Config]) -> None:
    from rich.console import Console
    from rich.table import Table
    t = Table(title=f"numeric tests per summation order (this CPU dispatches to {native})")
    for col in ("capability", "threads", "library paths", "result", "seconds", "failed"):
        t.add_column(col)
    for c in cfgs:
        t.add_row(c.capability, str(c.threads),
                  "\n".join(f"{k}={v}" for k, v in c.alt_blas.items()) if c.alt_blas else "native",
                  c.result, f"{c.seconds:.0f}", "\n".join(c.failed) or "-",
                  style=None if c.rc == 0 else "bold red")
    Console(width=160).print(t)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="only the orders the native run lacks, 1 thread each (CI)")
    ap.add_argument("--cores", type=int, default=os.cpu_count() or 1,
                    help="run configurations side by side up to this many threads in all")
    ap.add_argument("pytest_args", nargs="*", help="extra pytest arguments (e.g. -k softcap)")
    a = ap.parse_args()
    native, cfgs = plan(a.quick)
    t0 = time.monotonic()
    run(cfgs, NUMERIC_FILES, a.cores, a.pytest_args)
    table(native, cfgs)
    bad = [c.name for c in cfgs if c.rc != 0]
    print(f"[isa] {len(cfgs) - len(bad)} of {len(cfgs)} configurations passed in "
          f"{time.monotonic() - t0:.0f} s" + (f"; failed: {', '.join(bad)}" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
