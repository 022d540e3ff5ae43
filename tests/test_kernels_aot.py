"""Ahead-of-time compile of every Triton kernel in fastrehearse.kernels for Hopper (sm_90), no GPU.

`triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))` runs the whole TTIR -> TTGIR ->
LLVM -> PTX -> cubin pipeline with the ptxas shipped inside triton, so a CPU machine can check that
the CUDA path compiles and does not spill registers. What is compiled is what the launch code
launches, not a hand-written copy of the signatures:

1. every `@triton.jit` function defined in a fastrehearse.kernels module is discovered;
2. the launch functions (`_rows.row_stats_triton`, `_rows.row_grad_triton`, ...) run at the real
   shapes (bf16, N=16384, H x V = 4096 x 128256 and 2048 x 151936) on *fake* CUDA tensors
   (torch FakeTensorMode: shapes, strides and dtypes without storage), with each kernel's `run`
   replaced by a recorder, so the grid, the arguments, the constexprs (BLOCK_V, ...) and the
   launch options (num_warps, ...) come from the code itself;
3. each recorded launch goes through triton's own binder (`create_function_from_signature` +
   `_pack_args`, the code `JITFunction.run` uses) with stand-in pointers carrying the tensor's
   dtype and a data_ptr at its storage offset (allocations are >= 256-byte aligned on CUDA), so
   the signature, the divisibility hints and the `1`-specializations are the JIT's;
4. the cubin is built for sm_90 and the ptxas log (triton's own `ptxas -v` run, captured through
   `knobs.nvidia.dump_ptxas_log`) gives registers and spill bytes.

It fails on a kernel no recipe launches (unless only called from a launched kernel), on a boolean
constexpr the recipes only ever launch one way, on a compile error and on any spill. Results go
to benchmarks/results/kernels_aot_sm90.json, one entry per triton version (CI runs 3.9; the GPU
machine has 3.6: `PYTHONPATH=<dir with triton 3.6> pytest tests/test_kernels_aot.py` checks it).

The work runs in a subprocess (`python tests/test_kernels_aot.py --report PATH`, also usable by
hand): conftest.py sets TRITON_INTERPRET=1 for the CPU suite, under which @triton.jit yields
interpreter objects that cannot be compiled, and the kernels must not be re-imported in-process.
"""
from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import json
import os
import pkgutil
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
import triton
from triton.runtime.jit import JITFunction

ARCH = 90
N_ROWS = 16384
SHAPES = [(4096, 128256), (2048, 151936)]          # (H, V)
DTYPE = torch.bfloat16
RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "kernels_aot_sm90.json"

# Boolean constexprs allowed to be launched with one value only (name -> why); none is.
ONE_SIDED_OK: dict[tuple[str, str], str] = {}


# ---- discovery ----------------------------------------------------------------------------------


def _unwrap(obj):
    """The JITFunction behind @triton.jit (possibly under @triton.heuristics / @triton.autotune)."""
    seen = 0
    while not isinstance(obj, JITFunction) and hasattr(obj, "fn") and seen < 4:
        obj, seen = obj.fn, seen + 1
    return obj if isinstance(obj, JITFunction) else None


def discover_kernels() -> dict[str, tuple[JITFunction, object]]:
    """'module.name' -> (JITFunction, the module-level object) for every kernel defined in the
    fastrehearse.kernels package (imported names from elsewhere are skipped)."""
    import fastrehearse.kernels as pkg
    found, seen = {}, set()
    for info in pkgutil.iter_modules(pkg.__path__):
        mod = importlib.import_module(f"{pkg.__name__}.{info.name}")
        for name, obj in vars(mod).items():
            fn = _unwrap(obj)
            if fn is not None and fn.fn.__module__ == mod.__name__ and id(fn) not in seen:
                seen.add(id(fn))                      # an alias is the same kernel
                found[f"{info.name}.{name}"] = (fn, obj)
    return found


# ---- launch recording on fake CUDA tensors ------------------------------------------------------


class _Ptr:
    """What triton's specializer reads from a tensor: dtype and data_ptr (alignment)."""

    BASE = 1 << 20                                   # a 256-byte-aligned allocation base

    def __init__(self, t: torch.Tensor):
        self.dtype = t.dtype
        self._ptr = self.BASE + t.storage_offset() * t.element_size()

    def data_ptr(self):
        return self._ptr


@contextlib.contextmanager
def recording(kernels: dict[str, tuple[JITFunction, object]], launches: list):
    """Replace each kernel's `run` so `kernel[grid](...)` records instead of launching."""
    patched = []
    for qual, (fn, outer) in kernels.items():
        if outer is not fn:
            continue                                  # autotuned/heuristics: refused in _record

        def run(*args, grid, warmup, _qual=qual, _fn=fn, **kwargs):
            launches.append(_record(_qual, _fn, grid, args, kwargs))
        fn.run = run
        patched.append(fn)
    try:
        yield
    finally:
        for fn in patched:
            del fn.run


def _record(qual, fn, grid, args, kwargs):
    conv = lambda a: _Ptr(a) if isinstance(a, torch.Tensor) else a  # noqa: E731
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.Tensor) and a.device.type != "cuda":
            raise AssertionError(f"{qual}: launched with a {a.device} tensor by the recipe")
    grid = grid(dict(zip(fn.arg_names, args))) if callable(grid) else grid
    return {"kernel": qual, "fn": fn, "grid": tuple(int(g) for g in grid),
            "args": [conv(a) for a in args], "kwargs": {k: conv(v) for k, v in kwargs.items()}}


def _fake(shape, dtype):
    return torch.empty(shape, device="cuda", dtype=dtype)


def _chunks(h: int, v: int) -> list[int]:
    """Rows per chunk on CUDA: linear_logprobs' forward (`forward_rows`) and the fused policy
    loss's default workspace plan (fp32 Z + bf16 dZ, the fp32 V x H dW accumulator counted)."""
    from fastrehearse.kernels._fused_linear_loss import fused_loss_rows
    from fastrehearse.kernels.linear_logprobs import forward_rows
    dev = torch.device("cuda")
    return sorted({forward_rows(N_ROWS, v, DTYPE, dev, "triton"),
                   fused_loss_rows(N_ROWS, v, dev, elem_bytes=6, fixed_bytes=v * h * 4)})


def recipe_rows(h: int, v: int) -> None:
    """The row kernels of _rows.py as linear_logprobs / linear_policy_loss launch them on CUDA:
    an fp32 [chunk, V] logits block, dZ in the weight dtype (linear_logprobs._grad_dtype)."""
    for c in _chunks(h, v):
        _recipe_rows_chunk(h, v, c)


def _recipe_rows_chunk(h: int, v: int, c: int) -> None:
    from fastrehearse.kernels import _rows
    from fastrehearse.kernels.linear_logprobs import _grad_dtype
    z = _fake((c, v), torch.float32)
    t = _fake((c,), torch.int64)
    vec = lambda: _fake((c,), torch.float32)  # noqa: E731
    for with_ent in (False, True):
        _rows.row_stats_triton(z, t, 1.0, with_ent)
    dz = _fake((c, v), _grad_dtype(_fake((v, h), DTYPE)))
    # (g1, g2) as the callers pass them: logp grad only, both, entropy grad only
    for g1, g2 in ((vec(), None), (vec(), vec()), (None, vec())):
        _rows.row_grad_triton(z, t, vec(), vec(), g1, g2, 1.0, out=dz, dt=vec())


def recipe_head(h: int, v: int) -> None:
    """The LM-head transform kernels (bias / logit scale / soft-cap, kernels/_head.py) as the
    row-chunked path runs them: u = head(z) on the fp32 GEMM output (into a second block when the
    cap's backward needs z), dL/du from the row kernel in fp32 in place (linear_logprobs.
    chunk_grad), then dL/dz in place."""
    try:
        from fastrehearse.kernels._head import HeadTransform
    except ImportError:    # a checkout without head variants (their kernels are absent too;
        return             # a kernel left unlaunched fails test_every_kernel_is_launched...)
    for c in _chunks(h, v):
        _recipe_head_chunk(h, v, c, HeadTransform)


def _recipe_head_chunk(h: int, v: int, c: int, HeadTransform) -> None:
    from fastrehearse.kernels import _rows
    t = _fake((c,), torch.int64)
    vec = lambda: _fake((c,), torch.float32)  # noqa: E731
    for bias in (None, _fake((v,), DTYPE)):
        for cap in (None, 30.0):
            head = HeadTransform(bias, cap, 0.5)
            z = _fake((c, v), torch.float32)
            u = head.forward(z, "triton", out=torch.empty_like(z) if head.needs_pre else None)
            du = _rows.row_grad_triton(u, t, vec(), vec(), vec(), None, 1.0, out=u, dt=vec())
            head.backward_(du, z if head.needs_pre else None, "triton")


def recipe_vocab_outer(h: int, v: int) -> None:
    """linear_logprobs' vocabulary-outer backward (kernels/_vocab_outer.py) on CUDA: the row and
    head kernels on [R, V_b] blocks, R and V_b from the code's own plan (`vocab_outer_plan`,
    default budget), every distinct block width (V_b and the last, narrower block), dZ in the
    weight dtype without a head variant and fp32 in place with one. Python slicing of fake CUDA
    tensors is not available on a CPU-only torch, so the bias slice is taken with narrow (same
    storage offset as `HeadTransform.cols`)."""
    from fastrehearse.kernels import _common, _rows
    try:
        from fastrehearse.kernels._head import HeadTransform
        from fastrehearse.kernels._vocab_outer import block_elem_bytes, vocab_outer_plan
    except ImportError:    # a checkout without the vocabulary-outer backward
        return
    dev = torch.device("cuda")
    w = _fake((v, h), DTYPE)
    for head in (None, HeadTransform(_fake((v,), DTYPE), 30.0, 0.5)):
        rows, cols = vocab_outer_plan(N_ROWS, h, v, dev, block_elem_bytes=block_elem_bytes(w, head))
        r = min(rows, N_ROWS)
        vec = lambda: _fake((r,), torch.float32)  # noqa: E731
        for v0 in sorted({0, (v - 1) // cols * cols}):          # a full block and the last one
            width = min(cols, v - v0)
            z = _fake((r, width), torch.float32)
            t = _fake((r,), torch.int64)
            if head is None:
                dz = _fake((r, width), _common.grad_dtype(w))
                for g1, g2 in ((vec(), None), (vec(), vec()), (None, vec())):
                    _rows.row_grad_triton(z, t, vec(), vec(), g1, g2, 1.0, out=dz, dt=vec())
                continue
            hb = HeadTransform.__new__(HeadTransform)
            hb.__dict__.update(head.__dict__)
            hb.bias = head.bias.narrow(0, v0, width)
            u = hb.forward(z, "triton", out=torch.empty_like(z) if hb.needs_pre else None)
            du = _rows.row_grad_triton(u, t, vec(), vec(), vec(), None, 1.0, out=u, dt=vec())
            hb.backward_(du, z if hb.needs_pre else None, "triton")


def recipe_fused_lse(h: int, v: int, dtype: torch.dtype = DTYPE) -> None:
    """backend='triton-fused' (kernels/_fused_lse.py): the tile kernel (tl.dot + log-sum-exp) as
    its forward launches it, rows per launch from the code's own budget (`forward_rows`), with and
    without the entropy; bf16 here (tensor cores), fp32 (IEEE dot) and fp16 in the two below."""
    from fastrehearse.kernels.linear_logprobs import forward_rows
    try:
        from fastrehearse.kernels import _fused_lse
    except ImportError:    # a checkout without the fused backend
        return
    dev = torch.device("cuda")
    c = forward_rows(N_ROWS, v, dtype, dev, "triton-fused")
    x, w, t = _fake((c, h), dtype), _fake((v, h), dtype), _fake((c,), torch.int64)
    for with_ent in (False, True):
        _fused_lse.fused_row_stats(x, w, t, 1.0, with_ent)


def recipe_fused_lse_fp32(h: int, v: int) -> None:
    recipe_fused_lse(h, v, torch.float32)


def recipe_fused_lse_fp16(h: int, v: int) -> None:
    recipe_fused_lse(h, v, torch.float16)


recipe_fused_lse_fp32.dtype_label = "fp32"
recipe_fused_lse_fp16.dtype_label = "fp16"


# Every recipe runs for every shape; together they must launch every discovered kernel.
RECIPES = [recipe_rows, recipe_head, recipe_vocab_outer, recipe_fused_lse, recipe_fused_lse_fp32,
           recipe_fused_lse_fp16]


def record_launches(kernels) -> list[dict]:
    from torch._subclasses.fake_tensor import FakeTensorMode
    launches = []
    for h, v in SHAPES:
        for recipe in RECIPES:
            n0 = len(launches)
            try:
                with recording(kernels, launches), FakeTensorMode():
                    recipe(h, v)
            except Exception as e:
                raise AssertionError(
                    f"launch recipe {recipe.__name__} failed at H={h} V={v}: {type(e).__name__}: "
                    f"{e} (the launch code changed? update tests/test_kernels_aot.py)") from e
            for rec in launches[n0:]:
                rec["shape"] = {"N": N_ROWS, "H": h, "V": v,
                                "dtype": getattr(recipe, "dtype_label", "bf16")}
    return launches


# ---- compile ------------------------------------------------------------------------------------


def _backend():
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    target = GPUTarget("cuda", ARCH, 32)
    return target, make_backend(target)


def specialize(rec, backend):
    """(options, signature, constexprs, attrs) exactly as JITFunction.run would build them."""
    from triton import knobs
    from triton.runtime.jit import create_function_from_signature
    fn = rec["fn"]
    kwargs = dict(rec["kwargs"])
    kwargs["debug"] = kwargs.get("debug", fn.debug) or knobs.runtime.debug
    for opt in ("instrumentation_mode", "fpsan_homomorphic_casts"):   # run() adds these
        if hasattr(knobs.compilation, opt):
            kwargs[opt] = getattr(knobs.compilation, opt)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, spec, options = binder(*rec["args"], **kwargs)
    return fn._pack_args(backend, kwargs, bound, spec, options)


_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_PTXAS_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def compile_one(rec, target, backend) -> dict:
    """Compile one recorded launch for sm_90; registers / spills from triton's ptxas -v log."""
    from triton import knobs
    from triton.compiler import ASTSource
    options, signature, constexprs, attrs = specialize(rec, backend)
    src = ASTSource(rec["fn"], signature, constexprs, attrs)
    buf = io.StringIO()
    t0 = time.perf_counter()
    old = knobs.nvidia.dump_ptxas_log, knobs.compilation.always_compile
    # always_compile: a cache hit would skip ptxas and its log
    knobs.nvidia.dump_ptxas_log = knobs.compilation.always_compile = True
    try:
        with contextlib.redirect_stdout(buf):
            ck = triton.compile(src, target=target, options=options.__dict__)
    finally:
        knobs.nvidia.dump_ptxas_log, knobs.compilation.always_compile = old
    log = buf.getvalue()
    regs = _PTXAS_REGS.search(log)
    spill = _PTXAS_SPILL.search(log)
    if not (regs and spill):
        raise AssertionError(f"{rec['kernel']}: no ptxas -v log captured (got {log[:300]!r})")
    nw = ck.metadata.num_warps
    r = int(regs.group(1))
    per_warp = -(-r * 32 // 256) * 256           # registers are allocated per warp in 256s
    return {"kernel": rec["kernel"],
            "constexprs": {fn_name: _plain(val) for fn_name, val in
                           ((rec["fn"].arg_names[k[0]], v) for k, v in constexprs.items())},
            "signature": {k: v for k, v in signature.items() if v != "constexpr"},
            "divisible_by_16": [rec["fn"].arg_names[k[0]] for k, a in attrs.items() if a],
            "num_warps": nw, "num_stages": ck.metadata.num_stages,
            "registers": r, "stack_bytes": int(spill.group(1)),
            "spill_store_bytes": int(spill.group(2)), "spill_load_bytes": int(spill.group(3)),
            "shared_bytes": ck.metadata.shared,
            "wgmma": "wgmma" in ck.asm["ptx"],   # Hopper tensor-core MMA (kernels with tl.dot)
            # resident CTAs per SM from registers (64K/SM) and the 64-warp / 32-CTA limits
            "max_ctas_per_sm": min(65536 // (per_warp * nw), 64 // nw, 32),
            "compile_s": round(time.perf_counter() - t0, 2)}


def _plain(v):
    return v if isinstance(v, (bool, int, float, str, type(None))) else str(v)


# ---- the subprocess: record, compile, report --------------------------------------------------


def run_all(report_path: Path | None = None) -> dict:
    from triton import knobs
    knobs.cache.dir = tempfile.mkdtemp(prefix="fr_aot_cache_")
    kernels = discover_kernels()
    out = {"triton": triton.__version__, "kernels": sorted(kernels), "launched": [],
           "autotuned": [q for q, (fn, outer) in kernels.items() if outer is not fn],
           "bool_constexprs": {}, "compiled": [], "errors": {}, "recipe_error": None}
    try:
        launches = record_launches(kernels)
    except AssertionError as e:
        out["recipe_error"] = str(e)
        launches = []
    out["launched"] = sorted({r["kernel"] for r in launches})
    out["called_from_launched"] = sorted(
        q for q, (fn, _) in kernels.items() if q not in out["launched"] and re.search(
            rf"\b{fn.__name__}\s*\(", " ".join(kernels[k][0].src for k in out["launched"])))
    for rec in launches:
        fn = rec["fn"]
        bound = inspect.signature(fn.fn).bind(
            *rec["args"], **{k: v for k, v in rec["kwargs"].items() if k in fn.arg_names})
        bound.apply_defaults()
        for p in fn.params:
            val = bound.arguments[p.name]
            if p.is_constexpr and isinstance(val, bool):
                seen = out["bool_constexprs"].setdefault(f"{rec['kernel']}.{p.name}", [])
                if val not in seen:
                    seen.append(val)
    target, backend = _backend()
    from triton.backends.nvidia import compiler as nvc
    ver = subprocess.run([nvc.get_ptxas(ARCH).path, "--version"], capture_output=True,
                         text=True).stdout.strip()
    out["ptxas"] = ver.splitlines()[-1] if ver else "?"
    by_key = {}
    for rec in launches:
        try:
            options, signature, constexprs, attrs = specialize(rec, backend)
            key = (rec["kernel"], repr(signature), repr(sorted(constexprs.items())),
                   repr(sorted(attrs.items())), repr(sorted(options.__dict__.items())))
            if key not in by_key:
                by_key[key] = compile_one(rec, target, backend)
                by_key[key]["shapes"] = []
            launch = dict(rec["shape"], grid=list(rec["grid"]))
            if launch not in by_key[key]["shapes"]:
                by_key[key]["shapes"].append(launch)
        except Exception as e:   # every failure is reported, one line each
            out["errors"].setdefault(rec["kernel"], f"{type(e).__name__}: {str(e)[:600]}")
    out["compiled"] = list(by_key.values())
    if report_path:
        Path(report_path).write_text(json.dumps(out, indent=1))
    return out


# ---- the tests ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def aot(tmp_path_factory):
    report = tmp_path_factory.mktemp("aot") / "report.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, __file__, "--report", str(report)], env=env,
                       capture_output=True, text=True, timeout=600,
                       cwd=Path(__file__).resolve().parents[1])
    assert report.exists(), f"AOT subprocess failed (rc={r.returncode}):\n{r.stderr[-3000:]}"
    return json.loads(report.read_text())


def test_every_kernel_is_launched_by_a_recipe(aot):
    assert aot["recipe_error"] is None, aot["recipe_error"]
    missing = [q for q in aot["kernels"]
               if q not in aot["launched"] and q not in aot["called_from_launched"]]
    assert not aot["autotuned"], (f"autotuned/heuristics kernels need explicit configs in "
                                  f"tests/test_kernels_aot.py: {aot['autotuned']}")
    assert not missing, (f"Triton kernels with no launch recipe in tests/test_kernels_aot.py "
                         f"(their launch parameters cannot be derived): {missing}")


def test_boolean_constexprs_launched_both_ways(aot):
    one_sided = [f"{k}={v}" for k, v in aot["bool_constexprs"].items()
                 if len(v) < 2 and k not in ONE_SIDED_OK]
    assert not one_sided, f"boolean constexprs the recipes launch one way only: {one_sided}"


def test_every_kernel_compiles_for_sm90_without_spills(aot):
    assert aot["compiled"], f"nothing compiled; recipe error: {aot['recipe_error']}"
    assert not aot["errors"], "compile failures for sm_90:\n" + "\n".join(
        f"  {k}: {e}" for k, e in aot["errors"].items())
    spills = [f"{c['kernel']} {c['constexprs']}: {c['spill_store_bytes']}/{c['spill_load_bytes']} "
              f"bytes spilled (stores/loads), {c['registers']} registers"
              for c in aot["compiled"] if c["spill_store_bytes"] or c["spill_load_bytes"]]
    assert not spills, "register spills on sm_90:\n" + "\n".join(spills)
    for c in aot["compiled"]:
        assert 0 < c["registers"] <= 255, c
    assert {c["kernel"] for c in aot["compiled"]} == set(aot["launched"])
    _write_json(aot)


def _write_json(aot):
    """One entry per triton version (3.6 on the GPU machine, 3.9 in CI) in one file."""
    data = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    data["note"] = ("tests/test_kernels_aot.py: every Triton kernel as the launch code launches "
                    "it (bf16, N=16384), compiled ahead of time for sm_90 on a CPU machine; "
                    "registers / spills from triton's ptxas -v; shared_bytes = triton's shared "
                    "memory (scratch); shapes[].grid = programs per launch")
    data.setdefault("by_triton", {})[aot["triton"]] = {
        "arch": f"sm_{ARCH}", "ptxas": aot["ptxas"],
        "variants": [{k: v for k, v in c.items() if k != "compile_s"} for c in aot["compiled"]]}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    tmp = RESULTS.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, RESULTS)


def _main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(description="AOT-compile fastrehearse's Triton kernels for sm_90")
    ap.add_argument("--report", type=Path, default=None, help="write the raw report JSON here")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: interpreted kernels cannot be compiled", file=sys.stderr)
        return 2
    out = run_all(args.report)
    for c in out["compiled"]:
        print(f"{c['kernel']:28s} {json.dumps(c['constexprs']):52s} warps={c['num_warps']} "
              f"grids={[s['grid'] for s in c['shapes']]} regs={c['registers']} spills={c['spill_store_bytes']}/"
              f"{c['spill_load_bytes']} smem={c['shared_bytes']} B  {c['compile_s']} s")
    for k, e in out["errors"].items():
        print(f"FAIL {k}: {e}")
    if out["recipe_error"]:
        print(f"FAIL recipes: {out['recipe_error']}")
    return 1 if out["errors"] or out["recipe_error"] else 0


if __name__ == "__main__":
    sys.exit(_main())
