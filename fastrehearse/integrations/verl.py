"""verl adapter: `verl.utils.kernel.linear_cross_entropy.linear_cross_entropy` on fastrehearse.kernels.

    from fastrehearse.integrations.verl import patch_verl
    patch_verl()     # in every process that runs the actor (e.g. a Ray worker_process_setup_hook)
    patch_verl(backend="triton-fused")   # old / reference log-probs through the fused tile kernel

verl (0.9.x) calls `linear_cross_entropy(hidden, weight, labels, temperature, reduction)` from its
fused model forwards (`use_fused_kernels=True` with `fused_kernel_options.impl_backend=triton`),
importing it from that module at call time or at import time. `patch_verl()` replaces the module
attribute and every already-imported verl module's copy of it. Unlike verl's own Triton kernel, the
fastrehearse one also runs on CPU (torch backend) and has no `hidden_size % 128` requirement.

verl is imported only by `patch_verl()`; this module imports without it.
"""
from __future__ import annotations

import importlib
import sys

import torch

from fastrehearse.kernels import linear_logprobs
from fastrehearse.kernels import BACKENDS

__all__ = ["linear_cross_entropy", "patch_verl"]

_REDUCTIONS = ("none", "sum", "mean")
VERL_MODULE = "verl.utils.kernel.linear_cross_entropy"
_STATE = {"backend": "auto"}     # set by patch_verl(backend=...)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         temperature: float = 1.0, reduction: str = "none",
                         dist_process_group=None):
    """Same contract as verl's: returns (logprobs, entropy), both float32.

    hidden [..., H] (any leading shape), weight [V, H], labels [...] token ids in [0, V) matching
    hidden's leading shape. logprobs are flattened to [N] (reduction "none") or reduced to a scalar
    sum / mean of the log-probs; entropy is always the flat per-token [N]. Gradients flow to hidden
    (in its original shape and dtype) and weight. A vocabulary-parallel `dist_process_group` is not
    supported (raises).
    """
    if not isinstance(temperature, float):
        raise TypeError(f"temperature must be a float, but got {type(temperature)}")
    if not isinstance(reduction, str) or reduction.lower() not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if dist_process_group is not None:
        raise NotImplementedError("fastrehearse's linear_cross_entropy has no vocabulary-parallel "
                                  "mode (dist_process_group); use verl's own kernel there")
    x = hidden.reshape(-1, hidden.shape[-1])
    t = labels.reshape(-1)
    if t.shape[0] != x.shape[0]:
        raise ValueError(f"labels {tuple(labels.shape)} do not match hidden "
                         f"{tuple(hidden.shape)} (one label per hidden row)")
    if x.dtype != weight.dtype:  # autocast / mixed precision: score at the head's precision
        x = x.to(weight.dtype)
    logp, ent = linear_logprobs(x, weight, t, temperature=temperature, with_entropy=True,
                                backend=_STATE["backend"])
    red = reduction.lower()
    if red == "sum":
        logp = logp.sum()
    elif red == "mean":
        logp = logp.mean()
    return logp, ent


def patch_verl(backend: str = "auto") -> list[str]:
    """Route verl's fused linear cross-entropy through fastrehearse; returns the patched modules.

    backend: the fastrehearse.kernels backend of every call ("auto": triton on CUDA, torch on
    CPU; "triton-fused": verl's no-grad `compute_log_prob` passes skip the logits in memory, the
    update runs as "triton"). Idempotent (a second call may change the backend). Modules that
    import the function later get the patched one from verl's module.
    """
    if backend not in BACKENDS:
        raise ValueError(f"patch_verl: backend must be one of {BACKENDS}, got {backend!r}")
    _STATE["backend"] = backend
    mod = importlib.import_module(VERL_MODULE)
    original = getattr(mod, "_fastrehearse_original", mod.linear_cross_entropy)
    mod._fastrehearse_original = original
    patched = []
    for name, m in list(sys.modules.items()):
        if (name == VERL_MODULE or name.startswith("verl.")) and m is not None:
            if getattr(m, "linear_cross_entropy", None) in (original, linear_cross_entropy):
                m.linear_cross_entropy = linear_cross_entropy
                patched.append(name)
    return sorted(patched)
