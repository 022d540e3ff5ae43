"""FSDP2 shards parameters (and their optimizer state) as DTensors; these two helpers give the code
that reads or writes them a plain tensor, and leave a plain tensor as it is. Torch only (the
kernels-only install imports them through the integrations). DTensors are recognised by their
methods, so a torch build without torch.distributed needs nothing from it."""
from __future__ import annotations

import torch


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of `t`, detached: a view of the same storage, so in-place writes (under
    no_grad) change the parameter or state itself. No communication."""
    t = t.detach()
    return t.to_local() if hasattr(t, "to_local") else t


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole of `t`, all-gathered from the shards when it is a DTensor (collective: every rank
    of its mesh must call it); differentiable, as DTensor.full_tensor is."""
    full = getattr(t, "full_tensor", None)
    return t if full is None else full()
