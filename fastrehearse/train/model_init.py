"""Building the run's models without a whole copy per rank: on `meta`, sharded, then loaded into the shards.

A sharded run (any process group, also 1 rank on one GPU) never materializes the full model on a
rank:
  1. the architecture is built with parameters on `meta` (accelerate's `init_empty_weights`, buffers
     such as RoPE's inv_freq computed for real: they are small and not in the checkpoint);
  2. FSDP2 shards it (parallelize.parallelize) and each rank allocates only its shards;
  3. the weights go into the shards: from a Hugging Face directory each rank reads just its rows of
     each tensor from the safetensors files (`safe_open(...).get_slice`); any other spec (a GGUF,
     the embedded model, a tiny-* test model) is loaded whole by rank 0 alone and broadcast shard by
     shard (`set_model_state_dict(..., full_state_dict=True, broadcast_from_rank0=True)`).
The reference model (only with a KL term) is built the same way, frozen, in the compute dtype, and
filled from the policy's own shards. The generation copy (only for a rollout backend that decodes
with the trainer's weights in process: HF) is built on meta in the serving dtype and filled one
whole parameter at a time (`sync_generation_model`), the peak being one tensor. A single process
without a group loads the model whole: there is nothing to shard.

Host memory per rank: O(model / world + one tensor) for HF directories (benchmarks/bench_load_memory.py).
"""
from __future__ import annotations

import copy
from pathlib import Path

import torch
from accelerate import init_empty_weights
from safetensors import safe_open
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    set_model_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from transformers import AutoModelForCausalLM

from fastrehearse.dtensor import local_shard
from fastrehearse.model import RehearsalModel
from fastrehearse.model.adapter import check_lm_head
from fastrehearse.model.attention import ATTN_IMPL, register
from fastrehearse.model.loader import (
    ModelSpecError,
    load_config_and_tokenizer,
    load_model,
    safetensors_files,
)

from .config import ConfigError, TrainConfig
from .export import hf_prefix
from .parallelize import (
    DistInfo,
    broadcast_object,
    iter_full_params,
    mixed_precision,
    parallelize,
)


def load_whole(cfg: TrainConfig):
    """(model, tokenizer) whole, in fp32 (a process without a group; rank 0 of a non-HF spec).
    A spec that cannot load is a ConfigError naming the key (files checked before weights load)."""
    try:
        return load_model(cfg.model.spec, dtype=torch.float32, seed=cfg.seed, options=cfg.model.options)
    except ModelSpecError as e:
        raise ConfigError(f"{e} (config key 'model.spec')") from None


def build_policy(cfg: TrainConfig, info: DistInfo) -> tuple[nn.Module, nn.Module, object]:
    """(policy, hf_model, tokenizer): the RehearsalModel the optimizer trains (sharded when a group
    exists), the transformers model inside it, and the tokenizer."""
    if not info.sharded:
        hf_model, tok = load_whole(cfg)
        policy = parallelize(RehearsalModel(hf_model), info, precision=cfg.model.precision,
                             activation_checkpointing=cfg.model.activation_checkpointing)
        return policy, hf_model, tok
    files = safetensors_files(cfg.model.spec)
    whole = None
    if files:                                     # an HF directory: every rank reads its own rows
        config, tok = load_config_and_tokenizer(cfg.model.spec)
    else:                                         # rank 0 loads it whole and broadcasts
        if info.is_main:
            whole, tok = load_whole(cfg)
        config, tok = broadcast_object((whole.config, tok) if info.is_main else None, info)
    hf_model = empty_model(config, torch.float32)
    policy = parallelize(RehearsalModel(hf_model), info, precision=cfg.model.precision,
                         activation_checkpointing=cfg.model.activation_checkpointing)
    materialize(policy, info.device)
    prefix = hf_prefix(policy, hf_model)
    if files:
        load_local_rows(policy, prefix, files)
    else:
        full = {prefix + k: v for k, v in whole.state_dict().items()} if whole is not None else {}
        set_model_state_dict(policy, full, options=StateDictOptions(full_state_dict=True,
                                                                    broadcast_from_rank0=True))
        del whole, full
    return policy, hf_model, tok


def build_reference(cfg: TrainConfig, info: DistInfo, policy: nn.Module, hf_model: nn.Module) -> nn.Module:
    """The frozen reference for the KL term: the policy's initial weights, sharded like it, stored in
    the compute dtype (bf16 under bf16 mixed precision: it is only ever read in bf16)."""
    if not info.sharded:
        ref = copy.deepcopy(hf_model).requires_grad_(False)
        return parallelize(RehearsalModel(ref), info, precision=cfg.model.precision)
    dtype = mixed_precision(cfg.model.precision, info.device).param_dtype or torch.float32
    ref_hf = empty_model(hf_model.config, dtype)
    ref = parallelize(RehearsalModel(ref_hf), info, precision=cfg.model.precision)
    materialize(ref, info.device)
    with torch.no_grad():
        src = dict(policy.named_parameters())
        for name, p in ref.named_parameters():
            local_shard(p).copy_(local_shard(src[name]))
    return ref.requires_grad_(False)


def build_generation_model(cfg: TrainConfig, info: DistInfo, policy: nn.Module, hf_model: nn.Module) -> nn.Module:
    """The model rollouts are generated from. With rollout.backend=vllm, the trained module itself:
    the engine keeps its own copy, streamed from the shards after each update (no second model on
    the trainer's side). With hf and no group, also the trained module. With hf and a group,
    rollouts need the whole model on every rank (a sharded model would all-gather per decode step
    and make every rank decode in lockstep): a copy in the serving dtype, refreshed after every
    update (verl does the same with its rollout engine)."""
    if not info.sharded or cfg.rollout.engine.backend == "vllm":
        return hf_model
    gen = empty_model(hf_model.config, serving_dtype(cfg, info.device))
    materialize(gen, info.device)
    gen.requires_grad_(False).eval()
    sync_generation_model(policy, hf_model, gen)
    return gen


def serving_dtype(cfg: TrainConfig, device: torch.device) -> torch.dtype:
    """bf16 on GPU unless model.precision is fp32; fp32 on the CPU."""
    return torch.bfloat16 if device.type == "cuda" and cfg.model.precision != "fp32" else torch.float32


@torch.no_grad()
def sync_generation_model(policy: nn.Module, hf_model: nn.Module, gen: nn.Module) -> None:
    """Copy the policy's current weights into `gen`, one whole parameter at a time (collective)."""
    prefix = hf_prefix(policy, hf_model)
    dest = dict(gen.named_parameters())
    for name, full in iter_full_params(policy):
        name = name[len(prefix):]
        if name in dest:
            dest[name].copy_(full)


# ---- helpers -----------------------------------------------------------------------------------

def empty_model(config, dtype: torch.dtype) -> nn.Module:
    """The architecture of `config` with parameters on meta (buffers real), in `dtype`, with the
    varlen attention; checked like a loaded model (an inexpressible LM head is refused)."""
    register()
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=ATTN_IMPL)
    model.tie_weights()   # not applied under init_empty_weights (tied embeddings stay one parameter)
    check_lm_head(model)
    return model.eval()


def materialize(module: nn.Module, device: torch.device) -> None:
    """Allocate `module`'s meta parameters (this rank's shards) on `device`, uninitialized.

    `to_empty` would also wipe the real buffers (RoPE's inv_freq): their values are kept. Tensors are
    swapped in place (`swap_module_params_on_conversion`), so a parameter shared by two modules (tied
    embeddings) stays one parameter, as FSDP2 expects."""
    saved = {n: b.detach().clone() for n, b in module.named_buffers() if b.device.type != "meta"}
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        module.to_empty(device=device)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
    with torch.no_grad():
        for n, b in module.named_buffers():
            if n in saved:
                b.copy_(saved[n])


@torch.no_grad()
def load_local_rows(module: nn.Module, prefix: str, files: list[Path]) -> None:
    """Fill this rank's shard of every parameter (and persistent buffer) of `module` from the
    safetensors `files`, reading only its rows. A parameter the files do not hold is an error
    naming it (tied weights are one parameter, found under either name)."""
    where: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                where[k] = f
    tied = _tied_names(module, prefix)
    handles: dict[Path, object] = {}
    try:
        persistent = set(module.state_dict().keys())
        items = list(module.named_parameters()) + [(n, b) for n, b in module.named_buffers() if n in persistent]
        for name, t in items:
            key = name.replace("_checkpoint_wrapped_module.", "")[len(prefix):]
            key = next((k for k in [key, *tied.get(key, [])] if k in where), None)
            if key is None:
                raise ConfigError(f"model.spec: {name[len(prefix):]!r} is not in the checkpoint's safetensors "
                                  f"files ({', '.join(f.name for f in files)})")
            if where[key] not in handles:
                handles[where[key]] = safe_open(str(where[key]), framework="pt")
            sl = handles[where[key]].get_slice(key)
            local = local_shard(t)
            if isinstance(t, DTensor):
                shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
            else:
                shape, offset = tuple(t.shape), (0,) * t.dim()
            if list(sl.get_shape()) != list(t.shape):
                raise ConfigError(f"model.spec: {key!r} has shape {sl.get_shape()} in the checkpoint, "
                                  f"the model built from config.json has {list(t.shape)}")
            if local.numel() == 0:
                continue
            index = tuple(slice(o, o + n) for o, n in zip(offset, shape))
            local.copy_(sl[index] if index else sl[:])
    finally:
        handles.clear()


def _tied_names(module: nn.Module, prefix: str) -> dict[str, list[str]]:
    """Other names of each parameter shared by several modules (tied embeddings)."""
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name.replace("_checkpoint_wrapped_module.", "")[len(prefix):])
    return {n: [m for m in group if m != n] for group in names.values() if len(group) > 1 for n in group}


