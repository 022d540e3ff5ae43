"""Shared plumbing of the fused kernels: input checks, backend choice, chunk sizing, fp32 GEMMs.

Nothing here knows about losses; `linear_logprobs.py` and `policy_loss.py` build on it.
"""
from __future__ import annotations

import os
import warnings

import torch

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BACKENDS = ("auto", "torch", "triton", "triton-fused")

# Bytes of fp32 logits one chunk may hold. The torch backend keeps ~3 chunk-sized temporaries
# alive at once (logits, shifted logits, exp), the Triton backend ~2 (logits, dlogits), so the
# real peak is a small multiple of this. GPU: large enough that the chunk GEMM saturates the
# device; CPU: small enough to stay well under the naive N x V footprint.
CHUNK_BYTES_CUDA = 256 << 20
CHUNK_BYTES_CPU = 32 << 20


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
        from ._head import build_head
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
    and item size (linear_logprobs.forward_rows, _blocked, _fused_linear_loss.fused_loss_rows,
    _vocab_outer.vocab_outer_plan).
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


def chunk_rows(n: int, v: int, device: torch.device, chunk_size: int | None = None) -> int:
    """Rows per chunk so that one fp32 [rows, V] logits block stays within the byte budget."""
    if chunk_size is not None:
        if int(chunk_size) < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        return int(chunk_size)
    budget = CHUNK_BYTES_CUDA if device.type == "cuda" else CHUNK_BYTES_CPU
    rows = max(1, budget // (4 * max(v, 1)))
    if rows >= 64:
        rows -= rows % 64  # GEMM-friendly row counts
    return max(1, min(rows, max(n, 1)))


def fused_rows(n: int, v: int, dtype: torch.dtype, device: torch.device,
               chunk_size: int | None = None, budget_bytes: int | None = None) -> int:
    """Rows per launch of backend 'triton-fused' (_fused_lse.py): its per-row workspace is 4 fp32
    numbers per vocabulary tile (partials + merge; about 1/32 of an fp32 logits row), held to the
    same byte budget as a logits chunk (or `budget_bytes`): all 16384 rows in one launch at
    V=128256 on CUDA."""
    if chunk_size is not None:
        return chunk_rows(n, v, device, chunk_size)
    from ._fused_lse import partial_bytes_per_row    # imports triton: only for this backend
    budget = budget_bytes or (CHUNK_BYTES_CUDA if device.type == "cuda" else CHUNK_BYTES_CPU)
    return max(1, min(max(n, 1), budget // partial_bytes_per_row(v, dtype, device)))


# Torch backend (vocabulary-blocked, see _blocked.py): rows per row block (dW_b GEMMs have K =
# rows, so more is better up to where X stops fitting caches); the vocabulary block then
# follows from the same byte budget.
TORCH_BLOCK_ROWS = 4096


def torch_block_rows(n: int, chunk_size: int | None = None) -> int:
    """Rows per row block of the torch backend (chunk_size overrides, as in chunk_rows)."""
    if chunk_size is not None:
        if int(chunk_size) < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        return int(chunk_size)
    return max(1, min(n, TORCH_BLOCK_ROWS))


# One [rows, V_b] fp32 block of the torch backend on the CPU: small enough that the GEMM's packed
# weight block and the elementwise passes stay in cache. Measured end to end (H=576, V=49152,
# N=4096, 1 thread, 2-core EPYC, side by side): 12 MiB (768 columns) ~3% faster than 8 and 16,
# ~8% faster than 32.
VOCAB_BLOCK_BYTES_CPU = 12 << 20


def vocab_block(rows: int, v: int, device: torch.device) -> int:
    """Vocabulary columns per block so one fp32 [rows, V_b] block stays within the budget."""
    budget = CHUNK_BYTES_CUDA if device.type == "cuda" else VOCAB_BLOCK_BYTES_CPU
    cols = max(1, budget // (4 * max(rows, 1)))
    if cols >= 128:
        cols -= cols % 64
    return max(1, min(cols, v))


# Vocabulary-outer backward of the row-chunked path (Triton backend; LM-head variants on the torch
# backend): the workspace it may use besides the dX / dW it returns. GPU: at N=16384, H=4096 the
# fp32 dX accumulator takes 256 MiB and the rest holds [N, V_b] logit blocks of 8192 columns
# (bf16 dZ), 16 blocks at V=128256. CPU: small enough to stay in the spirit of the 32 MiB chunks.
WORKSPACE_BYTES_CUDA = 1 << 30
WORKSPACE_BYTES_CPU = 64 << 20


def grad_dtype(w: torch.Tensor) -> torch.dtype:
    """dtype of dZ, the operand of the dX / dW GEMMs: the weight's on CUDA (tensor cores, fp32
    results), fp32 on the CPU (mm_f32 upcasts anyway, so fp32 avoids a rounding step)."""
    return w.dtype if w.is_cuda else torch.float32


# One-pass fused policy loss (kernels/policy_loss.py, row-chunked: a chunk holds whole rows of
# logits, its dZ^T X_c is added into one fp32 V x H dW accumulator). Its workspace = that
# accumulator + the chunk's buffers. Few chunks make the accumulator's read-modify-write cheap:
# with K = rows, its 8 bytes per element could hide behind the GEMM's FLOPs from ~740 rows on an
# H200 only at benchmarks/roofline.py's optimistic end (790 TFLOP/s, 4.3 TB/s, all traffic
# overlapped); its central estimate leaves part of it exposed (docs/kernels.md; a prediction, no GPU
# has measured it). At H=4096, V=128256 the accumulator alone is 1.96 GiB and 3 GiB leaves ~1400
# rows per chunk (12 chunks at N=16384).
FUSED_WORKSPACE_BYTES_CUDA = 3 << 30


def fused_loss_rows(n: int, v: int, device: torch.device, *, elem_bytes: int, fixed_bytes: int,
                    workspace_bytes: int | None = None, chunk_size: int | None = None) -> int:
    """Rows per chunk of the one-pass fused loss.

    Workspace = `fixed_bytes` (the fp32 V x H dW accumulator when dW is needed, plus any other
    V x H copy the path makes) + rows x V x `elem_bytes` (the chunk's fp32 logits, pre-cap
    logits, low-precision dZ). `chunk_size` overrides. Without a budget: on CUDA
    FUSED_WORKSPACE_BYTES_CUDA, but never fewer rows than `chunk_rows` (the 256 MiB logits
    chunks used before the budget existed); on the CPU `chunk_rows` (32 MiB chunks). A budget
    that cannot hold `fixed_bytes` plus one row is refused.
    """
    if chunk_size is not None or (workspace_bytes is None and device.type != "cuda"):
        return chunk_rows(n, v, device, chunk_size)
    budget = FUSED_WORKSPACE_BYTES_CUDA if workspace_bytes is None else workspace_bytes
    rows = (budget - fixed_bytes) // (max(v, 1) * elem_bytes)
    if workspace_bytes is None:
        rows = max(rows, chunk_rows(n, v, device))
    elif rows < 1:
        raise ValueError(f"workspace_bytes={workspace_bytes} cannot hold the fused loss's "
                         f"{fixed_bytes}-byte fixed part (the fp32 dW accumulator unless "
                         f"dw_accum_dtype=weight.dtype) plus one {v * elem_bytes}-byte "
                         f"row of logits; raise it or use fused=False")
    if rows >= 128:
        rows -= rows % 64       # GEMM-friendly row counts
    return max(1, min(int(rows), max(n, 1)))


def check_workspace_bytes(workspace_bytes) -> int | None:
    if workspace_bytes is None:
        return None
    if isinstance(workspace_bytes, bool) or not isinstance(workspace_bytes, int) \
            or workspace_bytes < 1:
        raise ValueError(f"workspace_bytes must be a positive int (bytes) or None, "
                         f"got {workspace_bytes!r}")
    return workspace_bytes


def vocab_outer_plan(n: int, h: int, v: int, device: torch.device, *, block_elem_bytes: int,
                     workspace_bytes: int | None = None, rows: int | None = None):
    """(rows per row group R, vocabulary columns per block V_b) of the vocabulary-outer backward.

    Workspace = fp32 dX accumulator [R, H] + per block an [R, V_b] set of buffers of
    `block_elem_bytes` per element (fp32 logits, dZ, the pre-cap logits with a soft-cap) + an
    fp32 [V_b, H] dW block. R = all rows when their dX accumulator fits half the budget (then each
    dW block is written exactly once); `rows` (the caller's chunk_size) overrides R.
    """
    budget = workspace_bytes or (WORKSPACE_BYTES_CUDA if device.type == "cuda"
                                 else WORKSPACE_BYTES_CPU)
    if rows is None:
        rows = n if n * h * 4 <= budget // 2 else (budget // 2) // (h * 4)
        if rows >= 128:
            rows -= rows % 64
    rows = max(1, min(int(rows), max(n, 1)))
    left = max(0, budget - rows * h * 4)
    cols = left // (rows * block_elem_bytes + h * 4)
    if cols >= 256:
        cols -= cols % 128      # GEMM-friendly block widths
    return rows, max(16, min(int(cols), v))


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
# listed by `fp32_gemm_fallbacks()` (tests/test_fused_loss_plan.py checks the list).
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


def fp32_gemm_fallbacks() -> list[str]:
    """The (op:device:dtype) GEMMs that ran without `out_dtype=float32` in this process."""
    return sorted(k for k, ok in _OUT_DTYPE_OK.items() if not ok)


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
