"""Process group, device mesh and FSDP2 -- the one place `fully_shard` is applied.

Gradient reduction is a plain SUM on every backend. The trainer divides each role's loss by that
role's *global* token count (all-reduced over ranks, summed over micro-batches), so the summed
gradient already is the full-batch gradient and the result does not depend on the world size. The
FSDP2 default (average over ranks) would divide by the world size a second time, and on gloo AVG is
emulated and has been seen to sum instead (pytorch issue 162338); a custom divide factor becomes
PREMUL_SUM, which gloo lacks. Hence `set_gradient_divide_factor(1.0)` plus
`set_force_sum_reduction_for_comms(True)`: SUM, no scaling, on NCCL and gloo alike.

Collectives live here and only here. They run whenever a process group exists -- also a 1-rank group
(one GPU, or `torchrun --nproc_per_node=1`) -- so a single-GPU machine exercises every collective a
node runs. Tensor collectives take tensors on the compute device (`info.device`): NCCL rejects host
tensors. On CUDA the group is `cuda:nccl,cpu:gloo` (torchtitan's choice), so the object collectives
(pickled, small) and DCP's host-side coordination run on gloo while tensors go through NCCL.
`sum_over_ranks` is the one way host numbers (token counts, loss sums, flags) are summed: it puts them
on the compute device itself. With FASTREHEARSE_STRICT_COLLECTIVES=1 (the test suite sets it) a tensor
on another device is refused instead of moved, so a misplaced tensor fails the tests
(tests/test_train_collectives.py drives a full step under a CUDA-placement simulator).
"""
from __future__ import annotations

import atexit
import os
import socket
import sys
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from fastrehearse.dtensor import full_tensor

from . import failures


@dataclass
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None          # None: single process, no process group
    mesh: object | None = None   # DeviceMesh when world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """More than one rank (the data is split); collectives run whenever `sharded`."""
        return self.world_size > 1

    @property
    def sharded(self) -> bool:
        """A process group exists: FSDP2 is applied and every collective runs (also 1 rank: one
        GPU gets bf16 compute with fp32 master weights, and runs the collectives of a node)."""
        return self.backend is not None


def resolve_device(pref: str, local_rank: int = 0) -> torch.device:
    if pref == "cuda" or (pref == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ValueError("device='cuda' but torch.cuda.is_available() is False")
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def launched_by_torchrun() -> bool:
    """This process is a torchrun (torch.distributed.run) worker."""
    return "TORCHELASTIC_RUN_ID" in os.environ or "GROUP_RANK" in os.environ


def backend_for(device: torch.device) -> str:
    """NCCL for tensors on CUDA plus gloo for host-side work (object collectives, DCP); gloo on CPU."""
    return "cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo"


class NetworkConfigError(ValueError):
    """A multi-node launch whose ranks would talk over loopback (raised before the process group)."""


_LOOPBACK = ("127.", "::1", "localhost")


def _is_loopback(addr: str) -> bool:
    return addr.startswith(_LOOPBACK) or addr in ("0:0:0:0:0:0:0:1",)


def check_multinode_network(env: dict | None = None, resolve=None, hostname=None) -> None:
    """Refuse a job that spans nodes (WORLD_SIZE > LOCAL_WORLD_SIZE) when this host's name resolves
    to loopback (127.0.1.1 on stock Ubuntu / Debian), the rendezvous is not on loopback, and no
    GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME names the interface: gloo (and NCCL's bootstrap) would
    bind to the hostname's address and the nodes could not reach each other -- a hang at the first
    collective, not an error. All ranks on one machine (the loopback tests) are exempt."""
    env = os.environ if env is None else env
    world = int(env.get("WORLD_SIZE", "1"))
    local = int(env.get("LOCAL_WORLD_SIZE", str(world)))
    if world <= local:
        return
    master = env.get("MASTER_ADDR", "")
    if not master or _is_loopback(master):
        return
    if env.get("GLOO_SOCKET_IFNAME") or env.get("NCCL_SOCKET_IFNAME"):
        return
    host = hostname or socket.gethostname()
    try:
        addr = (resolve or socket.gethostbyname)(host)
    except OSError:
        return      # no answer: the backends fall back to an interface of their own
    if _is_loopback(addr):
        raise NetworkConfigError(
            f"this job spans nodes (WORLD_SIZE {world} > LOCAL_WORLD_SIZE {local}, rendezvous "
            f"{master}) but this host's name {host!r} resolves to {addr}, a loopback address the "
            f"other nodes cannot reach: set GLOO_SOCKET_IFNAME (and NCCL_SOCKET_IFNAME on GPUs) to "
            f"the interface they share, e.g. GLOO_SOCKET_IFNAME=eth0 (see docs/training.md)")


def init_distributed(device_pref: str = "auto", timeout_s: float | None = None) -> DistInfo:
    """Join the torchrun rendezvous when launched by torchrun (any world size, 1 included), else run
    alone: a plain process on the CPU, a 1-rank group on one GPU (FSDP2 mixed precision applies).

    Multi-node works through torchrun's rendezvous (--nnodes, --rdzv-endpoint); nothing here is
    node-aware beyond LOCAL_RANK picking the GPU and the network check above. `timeout_s`
    (`dist.timeout_s`) bounds every collective on both backends: a rank left waiting for a peer that
    is alive but stuck raises after it instead of after torch's default (30 min gloo, 10 min NCCL).
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(device_pref, local_rank)
    if world <= 1 and device.type != "cuda" and not launched_by_torchrun():
        return DistInfo(0, 1, 0, device, None)
    if world <= 1:   # one GPU without torchrun: a 1-rank group of the same kind a node uses
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
    backend = backend_for(device)
    check_multinode_network()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        kw = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
        dist.init_process_group(backend=backend, device_id=device if device.type == "cuda" else None,
                                **kw)
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp",))
    return DistInfo(rank, world, local_rank, device, backend, mesh)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def destroy_distributed(sync: bool = True) -> None:
    """Leave the group. `sync`: all ranks first meet at a barrier -- a rank that tears gloo down
    while a peer is still inside a collective has been seen to abort ("terminate called without an
    active exception"). Pass sync=False on an error path, where a peer may never arrive."""
    if dist.is_available() and dist.is_initialized():
        if sync:
            dist.barrier()
        dist.destroy_process_group()


def exit_worker(rc: int) -> int:
    """`rc` back to the caller -- except in a torchrun worker, which ends here with exit code `rc`,
    skipping the interpreter's finalization.

    Why: torch's C++ threads (gloo's workers, the autograd engine's) can outlive
    destroy_process_group() through objects torch keeps, and race the GIL's teardown during
    Py_FinalizeEx (pytorch issue 190489). Under load a rank whose work was done and saved has died
    there -- SIGSEGV, or SIGABRT "terminate called without an active exception" -- and torchrun then
    reported the whole job failed. What exit must still do is done first, while the interpreter
    is whole: non-daemon threads joined, atexit handlers run, stdio flushed. Call it on the way out
    of an entry point, after the group is destroyed; an uncaught exception keeps
    Python's normal exit (its traceback and code are the report)."""
    if not launched_by_torchrun():
        return rc
    for t in threading.enumerate():
        if t is not threading.main_thread() and not t.daemon:
            t.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):   # closed or broken pipe: nothing left to save
            pass
    os._exit(rc)


def mixed_precision(precision: str, device: torch.device):
    """bf16 compute params with fp32 gradient reduction on CUDA; fp32 on CPU (bf16 GEMMs are
    slow on CPU and the Triton interpreter mis-computes bf16 dots)."""
    use_bf16 = precision == "bf16" or (precision == "auto" and device.type == "cuda")
    # cast_forward_inputs=False: the forward's input is a PackedBatch whose advantages / old
    # log-probs must stay fp32 (the module casts its own activations).
    if use_bf16:
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                    cast_forward_inputs=False)
    return MixedPrecisionPolicy(cast_forward_inputs=False)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The transformer blocks: the adapter's `layers` if it exposes them, else HF's model.layers."""
    for path in ("layers", "model.model.layers", "model.layers", "hf_model.model.layers"):
        obj = model
        try:
            for part in path.split("."):
                obj = getattr(obj, part)
        except AttributeError:
            continue
        if isinstance(obj, nn.ModuleList):
            return obj
    raise ValueError(f"cannot find the decoder layers of {type(model).__name__} (looked for "
                     f"'layers', 'model.layers', 'model.model.layers')")


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each decoder block in backward. Uses the adapter's own switch when it has one."""
    if hasattr(model, "enable_activation_checkpointing"):   # fastrehearse.model.RehearsalModel
        model.enable_activation_checkpointing()
        return
    layers = decoder_layers(model)
    for i, layer in enumerate(layers):
        layers[i] = checkpoint_wrapper(layer, checkpoint_impl=CheckpointImpl.NO_REENTRANT)


def parallelize(model: nn.Module, info: DistInfo, *, precision: str = "auto",
                activation_checkpointing: bool = False, reshard_after_forward: bool = True) -> nn.Module:
    """Activation checkpointing, then FSDP2 on every decoder block and on the root.

    `model` must be the module whose forward runs the LM head (the RehearsalModel adapter): the
    head weight belongs to the root's parameter group, so it is unsharded (a plain tensor, not a
    DTensor) while the fused loss kernel reads it inside that forward.
    """
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    if not info.sharded:
        return model.to(info.device)
    if not any(p.is_meta for p in model.parameters()):   # a model built on meta is sharded there
        model.to(info.device)                            # and allocated by to_empty() after
    mp = mixed_precision(precision, info.device)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=info.mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    # The root's parameters (embeddings, final norm, LM head; tied or not) are needed again right
    # after the last block, so there is no point resharding them between forward and backward.
    fully_shard(model, mesh=info.mesh, mp_policy=mp, reshard_after_forward=False)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)
    return model


# ---- collectives: the only calls into torch.distributed's collectives ---------------------------

class CollectiveDeviceError(RuntimeError):
    """A tensor reached a collective on a device other than the compute device (strict mode)."""


def strict_collectives() -> bool:
    return os.environ.get("FASTREHEARSE_STRICT_COLLECTIVES", "") not in ("", "0")


_warned_moves: set = set()


def _device_of(t: torch.Tensor) -> torch.device:
    """Where `t` lives (tests replace this with a probe that simulates a CUDA run on the CPU)."""
    return t.device


def _on_compute_device(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """`t` itself when it is on info.device; else refused (strict mode) or moved with a warning
    naming the caller (a host tensor would make NCCL fail on the first multi-GPU step)."""
    dev = _device_of(t)
    if dev == info.device:
        return t
    caller = sys._getframe(2)
    where = f"{os.path.basename(caller.f_code.co_filename)}:{caller.f_lineno} ({caller.f_code.co_name})"
    msg = (f"a collective got a tensor on {dev} from {where}; the compute device is "
           f"{info.device} (NCCL rejects host tensors): build it there or use sum_over_ranks")
    if strict_collectives():
        raise CollectiveDeviceError(msg)
    if where not in _warned_moves:
        _warned_moves.add(where)
        warnings.warn(msg + "; moved it", stacklevel=3)
    return t.to(info.device)


def all_reduce_sum(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Sum of `t` (on info.device) over ranks, as a new tensor; runs whenever a group exists."""
    if not info.sharded:
        return t
    out = _on_compute_device(t, info).clone()
    failures.progress()   # entering: the wait is the collective timeout's, not the watchdog's
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    failures.progress()
    return out


def sum_over_ranks(values, info: DistInfo) -> torch.Tensor:
    """Host numbers (a list of floats or a CPU tensor) summed over ranks in float64 (exact for token
    counts); returns a CPU float64 tensor of the same shape. The values travel on the compute device."""
    host = torch.as_tensor(values, dtype=torch.float64)
    if not info.sharded:
        return host.clone()
    return all_reduce_sum(host.to(info.device), info).cpu()


def any_rank(flag: bool, info: DistInfo) -> bool:
    """True on every rank when `flag` is true on any rank."""
    return bool(sum_over_ranks([1.0 if flag else 0.0], info).item() > 0)


def all_gather_object(obj, info: DistInfo) -> list:
    if not info.sharded:
        return [obj]
    out = [None] * info.world_size
    failures.progress()
    dist.all_gather_object(out, obj)
    failures.progress()
    return out


def barrier(info: DistInfo) -> None:
    if info.sharded:
        failures.progress()
        dist.barrier()
        failures.progress()


def broadcast_object(obj, info: DistInfo, src: int = 0):
    if not info.sharded:
        return obj
    box = [obj]
    failures.progress()
    dist.broadcast_object_list(box, src=src)
    failures.progress()
    return box[0]


def iter_full_params(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) of every parameter and buffer of `module`, one at a time: a sharded
    (DTensor) parameter is all-gathered alone, so the peak is one whole tensor, never the whole
    model (collective: every rank must iterate to the end). Names are as in `module`, with the
    activation-checkpointing wrapper's segment removed."""
    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        full = full_tensor(t)
        yield name.replace("_checkpoint_wrapped_module.", ""), full.detach()
