"""LM-head variants real models use, applied between the logits GEMM and the row kernels.

As transformers' forward computes them (Cohere: `logits * logit_scale`; Granite: `logits /
logits_scaling`, i.e. scale = 1 / logits_scaling; Gemma 2/3: `cap * tanh(logits / cap)` with
cap = final_logit_softcapping; an `lm_head` bias), followed by the sampler's temperature T:

    z = X W^T                         the GEMM (fp32 result)
    u = a (z + b)                     a = logit_scale, b = bias [V]
    u = c tanh(u / c)                 c = logit_softcap (when given)
    s = u / T                         what the row kernels see (they apply 1/T themselves)

Backward: dL/dz = dL/du * du/dz with du/dz = a (1 - tanh^2(a (z + b) / c)) (just a without a cap);
dL/db = sum over rows of dL/dz. Exact through the tanh.

A plain positive scale without bias or cap is folded into 1/T (s = z a / T): every path,
including the torch backend's shift-free blocked one, stays exact and as fast as without it. Any
other variant goes through `HeadTransform` on the row-chunked path (fp32 [C, V] logits per
chunk; with a cap the backward keeps z next to u, two such blocks).
"""
from __future__ import annotations

import math
from numbers import Real

import torch

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _finite_number(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (Real, torch.Tensor)):
        raise ValueError(f"{name} must be a number or None, got {type(value).__name__}")
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a scalar, got a tensor of shape {tuple(value.shape)}")
        value = value.item()
    v = float(value)
    if not math.isfinite(v):
        raise ValueError(f"{name} must be finite, got {value}")
    return v


def check_head_args(bias, logit_softcap, logit_scale, weight):
    """Validate the head-variant arguments; returns (bias or None, cap or None, scale float)."""
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise ValueError(f"bias must be a torch.Tensor or None, got {type(bias).__name__}")
        if any(c.__name__ == "DTensor" for c in type(bias).__mro__):
            raise ValueError("bias is a DTensor: pass the unsharded LM-head bias "
                             "(e.g. inside the FSDP root module's forward) or bias.full_tensor()")
        v = weight.shape[0]
        if bias.dim() != 1 or bias.shape[0] != v:
            raise ValueError(f"bias must have shape [V]=[{v}], got {tuple(bias.shape)}")
        if bias.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"bias must be a float tensor, got {bias.dtype}")
        if bias.device != weight.device:
            raise ValueError(f"bias is on {bias.device} but weight is on {weight.device}")
    cap = None
    if logit_softcap is not None:
        cap = _finite_number("logit_softcap", logit_softcap)
        if not cap > 0.0:
            raise ValueError(f"logit_softcap must be > 0 (or None), got {logit_softcap}")
    scale = 1.0 if logit_scale is None else _finite_number("logit_scale", logit_scale)
    if scale == 0.0:
        raise ValueError("logit_scale must be nonzero (0 makes every token equally likely)")
    return bias, cap, scale


class HeadTransform:
    """u = c tanh(a (z + b) / c) (or a (z + b) without a cap) on fp32 [C, V] logit blocks."""

    def __init__(self, bias: torch.Tensor | None, softcap: float | None, scale: float):
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.bias_dtype = None if bias is None else bias.dtype
        self.softcap = softcap
        self.scale = float(scale)

    def cols(self, v0: int, v1: int) -> "HeadTransform":
        """The transform of vocabulary columns [v0, v1) (the bias sliced; scale and cap shared)."""
        out = HeadTransform.__new__(HeadTransform)
        out.__dict__.update(self.__dict__)
        out.bias = None if self.bias is None else self.bias[v0:v1]
        return out

    @property
    def needs_pre(self) -> bool:
        """The backward needs the pre-transform logits z (only the tanh's derivative does)."""
        return self.softcap is not None

    def forward(self, z: torch.Tensor, backend: str, out: torch.Tensor | None = None):
        """u from the GEMM's fp32 logits z; in place unless `out` is given."""
        out = z if out is None else out
        if backend == "triton":
            from ._rows import head_forward_triton   # lazy: triton only when it is used
            return head_forward_triton(z, self.bias, self.scale, self.softcap, out)
        u = torch.add(z, self.bias, out=out) if self.bias is not None else (
            out if out is z else out.copy_(z))
        if self.scale != 1.0:
            u.mul_(self.scale)
        if self.softcap is not None:
            u.div_(self.softcap).tanh_().mul_(self.softcap)
        return u

    def backward_(self, du: torch.Tensor, z: torch.Tensor | None, backend: str):
        """dL/du -> dL/dz in place (z: the pre-transform logits, needed with a cap only)."""
        if backend == "triton":
            from ._rows import head_backward_triton
            return head_backward_triton(du, z, self.bias, self.scale, self.softcap)
        if self.softcap is None:
            return du.mul_(self.scale) if self.scale != 1.0 else du
        th = torch.add(z, self.bias) if self.bias is not None else z.clone()
        th.mul_(self.scale / self.softcap).tanh_()
        return du.mul_(th.mul_(th).neg_().add_(1.0).mul_(self.scale))


def build_head(bias, logit_softcap, logit_scale, weight, inv_temp: float):
    """(HeadTransform or None, effective 1/T). A lone positive scale is folded into 1/T."""
    bias, cap, scale = check_head_args(bias, logit_softcap, logit_scale, weight)
    if bias is None and cap is None:
        if scale > 0.0:
            return None, inv_temp * scale
    return HeadTransform(bias, cap, scale), inv_temp
