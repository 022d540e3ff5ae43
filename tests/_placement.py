"""A CUDA-placement simulator for CPU test runs: which tensors would be on the host on a GPU machine?

On a CPU every tensor is on the CPU, so a trainer that hands NCCL a host tensor (a counter built with
`torch.tensor([...])`, a `.cpu()` copy) passes every CPU test and fails on the first multi-GPU step.
`SimulatedAccelerator` runs the code with `info.device = ACCEL` (`cpu:0`, a device object that differs
from the host's `cpu`) and tracks, per tensor, where it would live on CUDA:

  host        created by a factory with no device or with device "cpu"; `.cpu()` / `.to("cpu")`;
              any op whose tensor inputs are all host tensors (as CUDA would compute it on the host)
  accelerator everything else: created on ACCEL, moved there with `.to(ACCEL)`, or computed from at
              least one accelerator tensor (parameters, batches after `.to(info.device)`, ...)

`device_of(t)` says where `t` would be (`cpu` for host tensors, `cpu:0` for the others); the worker
installs it as the collective helper's device probe (fastrehearse.train.parallelize._device_of), so
the strict check `device_of(t) == info.device` sees the CUDA-time device. (`tensor.device` itself is
left alone: FSDP2 checks it against its mesh's device.) A tensor placed with `device=x.device` is a
host tensor here even when x is not: only tensors reaching collectives matter, and the trainer gives
collectives host numbers through `sum_over_ranks`, which places them itself.
"""
from __future__ import annotations

import weakref

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

ACCEL = torch.device("cpu", 0)
HOST = torch.device("cpu")
_DEVICE_GET = torch.Tensor.device.__get__
_MOVES = {torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.cuda}


def _is_cpu(dev) -> bool:
    return dev is None or str(dev) == "cpu"


def _target(func, args, kwargs, sim_device):
    """The device a `.to(...)` / `.cpu()` call asks for (None: no device given)."""
    if func is torch.Tensor.cpu:
        return HOST
    dev = kwargs.get("device")
    for a in args[1:]:
        if isinstance(a, (str, torch.device)):
            dev = a
        elif isinstance(a, torch.Tensor):
            dev = sim_device(a)   # .to(other): where `other` would be
    return None if dev is None else torch.device(dev)


class _IdSet:
    """A set of tensors by identity (weakly held; a WeakSet would compare tensors with ==)."""

    def __init__(self):
        self._refs: dict[int, weakref.ref] = {}

    def add(self, t: torch.Tensor) -> None:
        key = id(t)
        self._refs[key] = weakref.ref(t, lambda _, k=key: self._refs.pop(k, None))

    def discard(self, t: torch.Tensor) -> None:
        self._refs.pop(id(t), None)

    def __contains__(self, t) -> bool:
        r = self._refs.get(id(t))
        return r is not None and r() is t


class SimulatedAccelerator(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.host = _IdSet()

    def is_host(self, t: torch.Tensor) -> bool:
        return t in self.host

    def device_of(self, t: torch.Tensor) -> torch.device:
        real = _DEVICE_GET(t)
        if real.type != "cpu":
            return real                     # meta tensors etc. keep their device
        return HOST if t in self.host else ACCEL

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _MOVES:
            src = args[0]
            dest = _target(func, args, kwargs, self.device_of)
            out = func(*args, **kwargs)
            if dest is None or dest.type != "cpu" or not isinstance(out, torch.Tensor):
                if isinstance(out, torch.Tensor) and src in self.host and out is not src:
                    self.host.add(out)      # a dtype-only .to() keeps the device
                return out
            to_host = dest.index is None
            if out is src and (src in self.host) != to_host:
                out = src.clone()           # CUDA would copy across devices; a no-op here
            if to_host:
                self.host.add(out)
            else:
                self.host.discard(out)
            return out
        out = func(*args, **kwargs)
        tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        if tensors:
            on_host = all(t in self.host for t in tensors)
        else:                                   # a factory: where did it ask to be?
            on_host = _is_cpu(kwargs.get("device"))
        if on_host:
            for o in tree_flatten(out)[0]:
                if isinstance(o, torch.Tensor) and _DEVICE_GET(o).type == "cpu" and not any(o is t for t in tensors):
                    self.host.add(o)
        return out
