"""Shared plumbing of the fused kernels: input checks, backend choice, chunk sizing, fp32 GEMMs.

Nothing here knows about losses; `linear_logprobs.py` and the policy loss's modules build on it.
"""
from __future__ import annotations

import os
import warnings

import torch

from ._head import build_head

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BACKENDS = ("auto", "torch", "triton", "triton-fused")

def triton_usable(device: torch.device) -> bool:
    """Triton kernels run on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1."""
    if device.type == "cuda":
        return True
    return device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


_TRITON_STATE: dict[str, str | None] = {}


def triton_missing() -> str | None:
    """None when triton imports, else the ImportError text (checked once; only the Triton backend
    imports triton, so the torch backend works without it)."""
    if "err" not in _TRITON_STATE:
        try:
            import triton  # noqa: F401
            _TRITON_STATE["err"] = None
        except ImportError as e:
            _TRITON_STATE["err"] = str(e) or "ImportError"
    return _TRITON_STATE["err"]


def resolve_backend(backend: str, device: torch.device) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        if device.type == "cuda" and triton_missing() is None:
            return "triton"
        if device.type == "cuda" and not _TRITON_STATE.get("warned"):
            _TRITON_STATE["warned"] = "1"
            warnings.warn(f"fastrehearse.kernels: triton is not importable "
                          f"({triton_missing()}); backend='auto' uses the torch backend on CUDA")
        return "torch"
    if backend in ("triton", "triton-fused"):
        if not triton_usable(device):
            raise ValueError(
                f"backend={backend!r} needs CUDA tensors or TRITON_INTERPRET=1 for CPU tensors "
                f"(got device {device}); use backend='torch' or 'auto'")
        if triton_missing() is not None:
            raise ValueError(f"backend={backend!r} needs the triton package ({triton_missing()}); "
                             f"use backend='torch' or 'auto'")
    return backend


def fused_forward_backend(backend: str, x: torch.Tensor, needs_grad: bool) -> str:
    """backend='triton-fused' saves an lse from its tile kernel's fp32 logits; a backward rebuilds
    p = exp(s - lse) from logits recomputed by `mm_f32`. Where that GEMM cannot return fp32 for
    bf16 / fp16 (a torch without `out_dtype`), its logits are rounded to the input dtype and would
    not match the saved lse (percent-level gradient errors), so a forward that will be
    differentiated runs as 'triton' (whose forward uses the same GEMM), with a warning once."""
    if backend != "triton-fused" or not needs_grad or x.dtype == torch.float32 \
            or x.device.type != "cuda" or _out_dtype_ok(torch.mm, x):
        return backend
    if not _TRITON_STATE.get("fused_warned"):
        _TRITON_STATE["fused_warned"] = "1"
        warnings.warn(f"fastrehearse.kernels: backend='triton-fused' with {x.dtype} needs an "
                      f"fp32-output GEMM (torch.mm(..., out_dtype=torch.float32)), which this torch "
                      f"({torch.__version__}) lacks; differentiated calls run as 'triton'")
    return "triton"


def check_backend(backend: str, device: torch.device, *, weight=None, bias=None, logit_softcap=None,
                  logit_scale=None) -> str:
    """Public check before any work: the backend `backend` resolves to on `device` (ValueError when
    it cannot run there: no CUDA and no TRITON_INTERPRET, triton missing), and -- given the LM-head
    `weight` and settings -- that the backend can apply that head (triton-fused cannot apply a bias
    or soft-cap). Returns the resolved backend name."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    resolved = resolve_backend(backend, device)
    if weight is not None:
        head, _ = build_head(bias, logit_softcap, logit_scale, weight, 1.0)
        check_fused_forward(backend, head)
    return resolved


def check_fused_forward(backend: str, head) -> None:
    """backend='triton-fused' computes logits inside its tile kernel, which applies no LM-head
    bias or soft-cap (a lone positive logit scale is folded into 1/T and is fine)."""
    if backend == "triton-fused" and head is not None:
        what = ("an LM-head bias" if head.bias is not None else
                "logit_softcap" if head.softcap is not None else "a negative logit_scale")
        raise ValueError(f"backend='triton-fused' does not support {what} (its tile kernel applies "
                         f"no LM-head variant; a lone positive scale is folded into the "
                         f"temperature); use backend='triton'")


def grad_dtype(w: torch.Tensor) -> torch.dtype:
    """dtype of dZ, the operand of the dX / dW GEMMs: the weight's on CUDA (tensor cores, fp32
    results), fp32 on the CPU (mm_f32 upcasts anyway, so fp32 avoids a rounding step)."""
    return w.dtype if w.is_cuda else torch.float32


def check_workspace_bytes(workspace_bytes) -> int | None:
    if workspace_bytes is None:
        return None
    if isinstance(workspace_bytes, bool) or not isinstance(workspace_bytes, int) \
            or workspace_bytes < 1:
        raise ValueError(f"workspace_bytes must be a positive int (bytes) or None, "
                         f"got {workspace_bytes!r}")
    return workspace_bytes


# ---- chunk sizing: the budgets, and the one planner every kernel loop sizes its steps with ----

# Bytes of fp32 logits one chunk may hold. The torch backend keeps ~3 chunk-sized temporaries
# alive at once (logits, shifted logits, exp), the Triton backend ~2 (logits, dlogits), so the
# real peak is a small multiple of this. GPU: large enough that the chunk GEMM saturates the
# device; CPU: small enough to stay well under the naive N x V footprint.
CHUNK_BYTES_CUDA = 256 << 20
CHUNK_BYTES_CPU = 32 << 20

# Torch backend (vocabulary-blocked, see _blocked.py): rows per row block (dW_b GEMMs have K =
# rows, so more is better up to where X stops fitting caches); the vocabulary block then
# follows from VOCAB_BLOCK_BYTES_CPU.
TORCH_BLOCK_ROWS = 4096

# One [rows, V_b] fp32 block of the torch backend on the CPU: small enough that the GEMM's packed
# weight block and the elementwise passes stay in cache. Measured end to end (H=576, V=49152,
# N=4096, 1 thread, 2-core EPYC, side by side): 12 MiB (768 columns) ~3% faster than 8 and 16,
# ~8% faster than 32.
VOCAB_BLOCK_BYTES_CPU = 12 << 20

# Vocabulary-outer backward of the row-chunked path (Triton backend; LM-head variants on the torch
# backend): the workspace it may use besides the dX / dW it returns. GPU: at N=16384, H=4096 the
# fp32 dX accumulator takes 256 MiB and the rest holds [N, V_b] logit blocks of 8192 columns
# (bf16 dZ), 16 blocks at V=128256. CPU: small enough to stay in the spirit of the 32 MiB chunks.
WORKSPACE_BYTES_CUDA = 1 << 30
WORKSPACE_BYTES_CPU = 64 << 20

# One-pass fused policy loss (_fused_linear_loss.py, row-chunked: a chunk holds whole rows of
# logits, its dZ^T X_c is added into one fp32 V x H dW accumulator). Its workspace = that
# accumulator + the chunk's buffers. Few chunks make the accumulator's read-modify-write cheap:
# with K = rows, its 8 bytes per element could hide behind the GEMM's FLOPs from ~740 rows on an
# H200 only at benchmarks/roofline.py's optimistic end (790 TFLOP/s, 4.3 TB/s, all traffic
# overlapped); its central estimate leaves part of it exposed (docs/kernels.md; a prediction, no GPU
# has measured it). At H=4096, V=128256 the accumulator alone is 1.96 GiB and 3 GiB leaves ~1400
# rows per chunk (12 chunks at N=16384).
FUSED_WORKSPACE_BYTES_CUDA = 3 << 30


def plan_chunk(limit: int, item_bytes: int, budget: int, *, fixed_bytes: int = 0,
               chunk_size: int | None = None, align: int = 64, align_from: int | None = None,
               floor: int = 1, at_least: int | None = None, refuse: str | None = None) -> int:
    """How many items -- rows of a chunk, columns of a vocabulary block -- one step of a kernel
    loop takes: the number of `item_bytes`-sized items that `budget` bytes hold beside
    `fixed_bytes`, rounded down to a multiple of `align` once it reaches `align_from` (default
    2 x align; GEMM-friendly sizes), then at most `limit` (all of them) and at least `floor`.

    chunk_size: the caller's own count, taken as it is (refused below 1).
    at_least: a count the budget may not lower the result below (applied before the rounding).
    refuse: raise ValueError(refuse) when the budget holds no item (else `floor` is taken).
    Every chunk and block size of the kernels comes from here; the callers state their budget
    and item size (linear_logprobs.forward_rows, _blocked._block_cols,
    _fused_linear_loss.fused_loss_rows, _vocab_outer.vocab_outer_plan).
    """
    if chunk_size is not None:
        if int(chunk_size) < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        return int(chunk_size)
    count = (budget - fixed_bytes) // item_bytes
    if at_least is not None:
        count = max(count, at_least)
    elif count < 1 and refuse is not None:
        raise ValueError(refuse)
    if count >= (2 * align if align_from is None else align_from):
        count -= count % align
    return max(floor, min(int(count), max(limit, 1)))


def _is_dtensor(t) -> bool:
    return any(c.__name__ == "DTensor" for c in type(t).__mro__)


def check_linear_inputs(hidden, weight, targets, mask=None, *, mask_name="mask"):
    """Validate the (hidden, weight, targets, mask) quadruple shared by every kernel entry point."""
    if _is_dtensor(weight) or _is_dtensor(hidden):
        raise ValueError(
            "weight/hidden is a DTensor: call the kernel where the LM-head weight is unsharded "
            "(e.g. inside the FSDP root module's forward) or pass weight.full_tensor()")
    for name, t in (("hidden", hidden), ("weight", weight), ("targets", targets)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be 2-D [N, H], got shape {tuple(hidden.shape)}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [V, H], got shape {tuple(weight.shape)}")
    if hidden.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"hidden dtype must be float32/bfloat16/float16, got {hidden.dtype}")
    if weight.dtype != hidden.dtype:
        raise ValueError(f"weight dtype {weight.dtype} does not match hidden dtype {hidden.dtype}")
    if weight.shape[1] != hidden.shape[1]:
        raise ValueError(
            f"weight shape {tuple(weight.shape)} does not match hidden size H={hidden.shape[1]}")
    if weight.shape[0] < 1:
        raise ValueError("weight must have at least one row (vocabulary size V >= 1)")
    if weight.device != hidden.device:
        raise ValueError(f"weight is on {weight.device} but hidden is on {hidden.device}")
    n = hidden.shape[0]
    if targets.dim() != 1 or targets.shape[0] != n:
        raise ValueError(f"targets must have shape [N]=[{n}], got {tuple(targets.shape)}")
    if targets.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"targets dtype must be int64 (or int32), got {targets.dtype}")
    if targets.device != hidden.device:
        raise ValueError(f"targets is on {targets.device} but hidden is on {hidden.device}")
    if mask is not None:
        if not isinstance(mask, torch.Tensor):
            raise ValueError(f"{mask_name} must be a torch.Tensor or None")
        if mask.dim() != 1 or mask.shape[0] != n:
            raise ValueError(f"{mask_name} must have shape [N]=[{n}], got {tuple(mask.shape)}")
        if mask.device != hidden.device:
            raise ValueError(f"{mask_name} is on {mask.device} but hidden is on {hidden.device}")


def check_targets(targets_c: torch.Tensor, rows: torch.Tensor | None, vocab: int) -> None:
    """Raise ValueError naming the first loss-bearing position whose target is outside [0, V).

    One reduction + one host sync for the whole call (not per chunk); the position is only
    looked up on the error path.
    """
    if targets_c.numel() == 0:
        return
    bad = (targets_c < 0) | (targets_c >= vocab)
    if bool(bad.any()):
        k = int(bad.nonzero()[0, 0])
        pos = int(rows[k]) if rows is not None else k
        raise ValueError(
            f"targets[{pos}] = {int(targets_c[k])} is outside the vocabulary [0, {vocab}) "
            f"at an unmasked position")


def check_temperature(temperature) -> float:
    t = float(temperature)
    if not (t > 0.0) or t == float("inf"):
        raise ValueError(f"temperature must be a finite positive number, got {temperature}")
    return t


# ---- GEMMs with fp32 results -------------------------------------------------------------------
# Low-precision inputs: the GEMM accumulates in fp32 inside cuBLAS; `out_dtype=float32` (torch
# >= 2.9 on CUDA) keeps the result in fp32 instead of rounding the logits / dW partials to bf16.
# Support is probed once per (op, device type, dtype) on a 1 x 1 problem, never by catching the
# error of a real call: an out-of-memory or shape error of a real GEMM always propagates. Where
# the probe fails the fallback rounds the result to the input dtype first; that is warned once and
# kept in `_OUT_DTYPE_OK` (benchmarks/gpu_microbench.py writes it into its JSON as
# `out_dtype_float32_gemms`).
_OUT_DTYPE_OK: dict[str, bool] = {}


def _out_dtype_ok(fn, like: torch.Tensor) -> bool:
    key = f"{fn.__name__}:{like.device.type}:{str(like.dtype).replace('torch.', '')}"
    ok = _OUT_DTYPE_OK.get(key)
    if ok is None:
        one = torch.ones(1, 1, device=like.device, dtype=like.dtype)
        try:
            if fn is torch.addmm:
                acc = torch.ones(1, 1, device=like.device, dtype=torch.float32)
                r = fn(acc, one, one, out_dtype=torch.float32, out=acc)
                ok = r.dtype == torch.float32 and float(r) == 2.0
            else:
                r = fn(one, one, out_dtype=torch.float32)
                ok = r.dtype == torch.float32 and float(r) == 1.0
        except torch.OutOfMemoryError:
            raise
        except (TypeError, RuntimeError, NotImplementedError) as e:
            ok = False
            warnings.warn(f"fastrehearse.kernels: torch.{fn.__name__}(..., out_dtype=float32) is "
                          f"unavailable for {like.dtype} on {like.device.type} ({type(e).__name__}: "
                          f"{str(e).splitlines()[0][:120] if str(e) else ''}); falling back to a "
                          f"{like.dtype} result cast to fp32 (logits / dW partials rounded once "
                          f"more, a little slower). torch >= 2.9 has it.", stacklevel=3)
        _OUT_DTYPE_OK[key] = ok
    return ok


def mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with an fp32 result (a, b of the same dtype)."""
    if a.dtype == torch.float32:
        return torch.mm(a, b)
    if a.is_cuda:
        if _out_dtype_ok(torch.mm, a):
            return torch.mm(a, b, out_dtype=torch.float32)
        return torch.mm(a, b).float()
    return torch.mm(a.float(), b.float())  # CPU bf16/fp16: correctness over speed


def addmm_f32_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b, the product always summed in fp32.

    acc fp32 (the default cross-chunk dW accumulator): exact up to fp32. acc in a low-precision
    dtype (the fused loss's `dw_accum_dtype=weight.dtype`): acc + a @ b is formed in fp32 and
    rounded once per call, on CUDA by cuBLAS itself (beta = 1, fp32 compute), as Liger's FLCE does.
    """
    if acc.dtype != torch.float32:
        if a.is_cuda and a.dtype == acc.dtype:
            acc.addmm_(a, b)
        else:
            acc.add_(mm_f32(a, b) if a.dtype == b.dtype else torch.mm(a.float(), b.float()))
        return
    if a.dtype == torch.float32:
        acc.addmm_(a, b)
        return
    if a.is_cuda:
        if _out_dtype_ok(torch.addmm, a):
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
            return
        acc.add_(torch.mm(a, b))
        return
    acc.addmm_(a.float(), b.float())
