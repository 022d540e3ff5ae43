"""`fastrehearse train --config X --dry-run --world-size N`: will this run fit, per rank, before any GPU?

The run's model is built the way `setup` builds it -- on meta, wrapped, FSDP2-sharded over a world of
N ranks on torch's fake process group (one CPU process, no GPU, no weights), with the run's mixed
precision and activation checkpointing -- and each rank's GPU memory is added up from what that build
really holds (every parameter's padded shard) plus what the run allocates around it:

  resident  fp32 master shards, fp32 gradient shards, AdamW's two moments, the non-finite rollback
            copy (optim.rollback_nonfinite), the reference shards (KL only, in the compute dtype), the
            rollout backend (HF: a whole generation copy in the serving dtype; vLLM: its
            gpu_memory_utilization share, held through the update), CUDA context + NCCL (assumed)
  rollout   the HF backend's KV cache when every decoded row reaches max_episode_tokens, and one
            layer's working set over the largest prefill
  update    FSDP2's gathered bf16 parameters (root + 2 layers in flight) and unsharded fp32
            gradients (root + 1 layer), activations of one max_tokens micro-batch, the LM-head
            kernel's workspace (fastrehearse.kernels' own budget) and the hidden-state gradient

Activation bytes are measured, not modelled: one real decoder layer of this architecture (random
weights, bf16, CPU, SDPA attention, which saves what flash attention saves) runs forward on a few
tokens under `saved_tensors_hooks`, with and without checkpointing; bytes per token scale to
max_tokens. peak = resident + max(rollout, update). The plan is an upper bound of what the code
allocates by design, not an allocator trace: fragmentation and the caching allocator's slack come on
top (the README's dry-run-vs-measured row says by how much on an H200 when one is available).
"""
from __future__ import annotations

import copy
import functools
import json
import math
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

from fastrehearse.kernels import FUSED_WORKSPACE_BYTES_CUDA
from fastrehearse.model import RehearsalModel, base_model
from fastrehearse.model.loader import (EMBEDDED_SPECS, head_dim, load_model, load_tokenizer,
                                      tiny_config)

from .config import ConfigError, TrainConfig
from .model_init import empty_model
from .parallelize import DistInfo, decoder_layers, mixed_precision, parallelize

GIB = 1 << 30
CUDA_CONTEXT_BYTES = int(1.5 * GIB)   # assumption: CUDA context + NCCL buffers per rank
PROBE_TOKENS = 32                      # activation bytes per token are constant in T (measured)


class DryRunError(ConfigError):
    """The dry run cannot plan this configuration (bad world size, unknown architecture)."""


@dataclass
class Item:
    phase: str          # resident | rollout | update
    name: str
    bytes: int
    how: str


@dataclass
class Plan:
    config: str
    architecture: str
    world_size: int
    gpu_memory_gib: float
    params: int
    items: list[Item] = field(default_factory=list)
    activations: dict = field(default_factory=dict)   # per micro-batch, with and without checkpointing

    def total(self, phase: str) -> int:
        return sum(i.bytes for i in self.items if i.phase == phase)

    @property
    def peak_phase(self) -> str:
        return "update" if self.total("update") >= self.total("rollout") else "rollout"

    @property
    def peak_bytes(self) -> int:
        return self.total("resident") + self.total(self.peak_phase)

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.gpu_memory_gib * GIB

    def to_json(self) -> dict:
        return {**asdict(self), "resident_gib": self.total("resident") / GIB,
                "rollout_gib": self.total("rollout") / GIB, "update_gib": self.total("update") / GIB,
                "peak_phase": self.peak_phase, "peak_gib": self.peak_bytes / GIB, "fits": self.fits}

    def overflow_line(self) -> str:
        big = max((i for i in self.items if i.phase in ("resident", self.peak_phase)), key=lambda i: i.bytes)
        return (f"does not fit {self.gpu_memory_gib:g} GiB per GPU at world size {self.world_size}: peak "
                f"{self.peak_bytes / GIB:.1f} GiB per rank in the {self.peak_phase} phase (largest: "
                f"{big.name}, {big.bytes / GIB:.1f} GiB)")


# ---- the architecture ----------------------------------------------------------------------------

def shipped_architectures() -> dict[str, Path]:
    """Architectures shipped for planning (configs/models/<name>/config.json), by lower-case name."""
    root = Path(str(resources.files("fastrehearse.configs"))) / "models"
    return {p.parent.name.lower(): p.parent for p in sorted(root.glob("*/config.json"))}


def resolve_architecture(cfg: TrainConfig, arch: str | None):
    """(HF config, where it came from). model.spec itself when it is on this machine; else `arch`
    (an HF directory or a config.json); else a shipped architecture named like model.spec's folder."""
    from transformers import AutoConfig
    spec = cfg.model.spec
    if arch is not None:
        p = Path(arch).expanduser()
        if not (p.is_dir() and (p / "config.json").is_file()) and not (p.is_file() and p.suffix == ".json"):
            raise DryRunError(f"--arch {arch!r} is neither an HF directory with config.json nor a config.json")
        return AutoConfig.from_pretrained(p if p.is_dir() else p.parent), f"--arch {p}"
    if spec.startswith("tiny-"):
        o = cfg.model.options
        return tiny_config(spec[len("tiny-"):], vocab_size=len(load_tokenizer("smollm2")),
                           **asdict(o)), f"{spec} {asdict(o)}"
    if spec in EMBEDDED_SPECS or spec.lower().endswith(".gguf"):
        return load_model(spec)[0].config, spec
    p = Path(spec).expanduser()
    if (p / "config.json").is_file():
        return AutoConfig.from_pretrained(p), str(p)
    shipped = shipped_architectures()
    if p.name.lower() in shipped:
        d = shipped[p.name.lower()]
        return AutoConfig.from_pretrained(d), f"{d / 'config.json'} (model.spec {spec!r} is not on this machine)"
    raise DryRunError(f"model.spec {spec!r} is not on this machine and no shipped architecture is named "
                      f"{p.name!r} ({sorted(shipped)}); pass --arch DIR_OR_CONFIG_JSON")


# ---- the plan --------------------------------------------------------------------------------------

def check_world(world: int, named_shapes: list[tuple[str, tuple]], cfg: TrainConfig) -> None:
    if world < 1:
        raise DryRunError(f"--world-size must be >= 1, got {world}")
    for name, shape in named_shapes:
        if shape and shape[0] % world:
            g = math.gcd(*(s[0] for _, s in named_shapes if s))
            fits = [d for d in range(1, g + 1) if g % d == 0]
            raise DryRunError(f"--world-size {world} does not divide dimension 0 ({shape[0]}) of {name!r} (FSDP2 "
                              f"shards dimension 0 and would pad every shard of it); world sizes that divide "
                              f"every parameter: the divisors of {g}: {fits if len(fits) <= 12 else fits[:12] + ['...']}")
    if cfg.rollout.tasks_per_step < world:
        raise DryRunError(f"rollout.tasks_per_step={cfg.rollout.tasks_per_step} < --world-size {world}: "
                          f"some ranks would roll out nothing")


def _padded_shard(shape: tuple, world: int) -> int:
    if not shape:
        return 1
    return math.ceil(shape[0] / world) * math.prod(shape[1:])


def layer_activation_bytes(config, dtype: torch.dtype = torch.bfloat16) -> tuple[float, float]:
    """(bytes saved for backward per token by one decoder layer, ... with activation checkpointing),
    measured on one real layer of `config` (see the module docstring); memoized per architecture."""
    return _layer_activation_bytes(config.to_json_string(use_diff=False), dtype)


@functools.lru_cache(maxsize=8)
def _layer_activation_bytes(config_json: str, dtype: torch.dtype) -> tuple[float, float]:
    from transformers import AutoConfig
    d = json.loads(config_json)
    config = AutoConfig.for_model(d.pop("model_type"), **d)
    config._attn_implementation = "sdpa"
    model = empty_model(config, dtype)
    stack = base_model(model)
    layer = copy.deepcopy(stack.layers[0])
    layer.to_empty(device="cpu")
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.02)
    for m in layer.modules():
        if getattr(m, "config", None) is not None:
            m.config._attn_implementation = "sdpa"
    x = torch.randn(1, PROBE_TOKENS, config.hidden_size, dtype=dtype, requires_grad=True)
    pos = torch.arange(PROBE_TOKENS).unsqueeze(0)
    pe = stack.rotary_emb(x, pos) if hasattr(stack, "rotary_emb") else None
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}

    def run(h):
        out = layer(h, position_embeddings=pe, position_ids=pos)
        return out[0] if isinstance(out, tuple) else out

    def saved(fn) -> float:
        seen: dict[int, int] = {}

        def pack(t):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in params:
                seen.setdefault(ptr, t.untyped_storage().nbytes())
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn(x)
        return sum(seen.values()) / PROBE_TOKENS
    full = saved(run)
    ckpt = saved(lambda h: torch.utils.checkpoint.checkpoint(run, h, use_reentrant=False))
    return full, ckpt


def plan(cfg: TrainConfig, world: int, gpu_memory_gib: float, arch: str | None = None,
         config_name: str = "") -> Plan:
    """The per-rank plan of `cfg` at `world` ranks (builds and shards on torch's fake process group)."""
    if dist.is_initialized():
        raise DryRunError("a process group is already initialized in this process; run the dry run alone")
    hf_config, source = resolve_architecture(cfg, arch)
    policy = RehearsalModel(empty_model(hf_config, torch.float32))
    named_shapes = [(n, tuple(p.shape)) for n, p in policy.named_parameters()]
    check_world(world, named_shapes, cfg)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        info = DistInfo(0, world, 0, torch.device("cuda", 0), "fake", mesh)   # planning for CUDA
        policy = parallelize(policy, info, precision=cfg.model.precision,
                             activation_checkpointing=cfg.model.activation_checkpointing)
        shard = sum(_padded_shard(tuple(p.shape), world) for p in policy.parameters())
        for p in policy.parameters():   # what FSDP2 built is what was counted
            assert p.to_local().numel() <= _padded_shard(tuple(p.shape), world)
        layers = decoder_layers(policy)
        layer_params = sum(p.numel() for p in layers[0].parameters())
    finally:
        dist.destroy_process_group()
    n_params = sum(math.prod(s) for _, s in named_shapes)
    root_params = n_params - layer_params * len(layers)
    compute = mixed_precision(cfg.model.precision, info.device).param_dtype or torch.float32
    cb = torch.finfo(compute).bits // 8
    p = Plan(config_name, source, world, gpu_memory_gib, n_params)
    add = p.items.append

    # resident
    add(Item("resident", "policy shards (fp32 master)", shard * 4, f"{shard / 1e6:.0f}M elements per rank (padded)"))
    add(Item("resident", "gradient shards (fp32)", shard * 4, "reduce_dtype fp32"))
    add(Item("resident", "AdamW moments (2 x fp32)", shard * 8, "exp_avg + exp_avg_sq"))
    if cfg.optim.rollback_nonfinite:
        add(Item("resident", "rollback copy (params + moments)", shard * 12, "optim.rollback_nonfinite"))
    if cfg.algo.loss.kl_coef > 0:
        add(Item("resident", f"reference shards ({compute})", shard * cb, "algo.loss.kl_coef > 0"))
    backend = getattr(cfg.rollout, "backend", "hf")
    kv_token = 2 * hf_config.num_hidden_layers * hf_config.num_key_value_heads * head_dim(hf_config) * 2
    rows = min(cfg.rollout.max_batch_size, math.ceil(cfg.rollout.tasks_per_step / world) * cfg.rollout.group_size)
    gen_bytes = 2 if cfg.model.precision != "fp32" else 4
    if backend == "vllm":
        frac = cfg.rollout.vllm.gpu_memory_utilization
        add(Item("resident", "vLLM (weights + KV cache)", int(frac * gpu_memory_gib * GIB),
                 f"rollout.vllm.gpu_memory_utilization={frac} of {gpu_memory_gib:g} GiB, held through the update"))
        # train/model_init.build_generation_model: the vLLM weight sync writes the served file from
        # this copy (the in-process CUDA load from the shards in docs/training.md is not built)
        add(Item("resident", "generation copy (staging for the vLLM weight sync)", n_params * gen_bytes,
                 "whole model per rank, as the code builds it today"))
    else:
        add(Item("resident", "generation copy (whole model)", n_params * gen_bytes,
                 "HF rollout backend: every rank decodes with the whole model"))
        add(Item("rollout", "KV cache, every row at max_episode_tokens", rows * cfg.rollout.max_episode_tokens * kv_token,
                 f"{rows} rows x {cfg.rollout.max_episode_tokens} tokens x {kv_token / 1024:.0f} KiB"))
    add(Item("resident", "CUDA context + NCCL", CUDA_CONTEXT_BYTES, "assumed"))

    # activations (measured per token on one real layer)
    full, ckpt = layer_activation_bytes(hf_config, compute)
    t, n_layers, h = cfg.max_tokens, hf_config.num_hidden_layers, hf_config.hidden_size
    edges = t * h * cb * 2                                  # embedding output, final norm
    act_off = int(full * t * n_layers + edges)
    act_on = int(ckpt * t * n_layers + full * t + edges)   # + one layer recomputed in backward
    p.activations = {"per_token_per_layer_bytes": full, "checkpointed_per_token_per_layer_bytes": ckpt,
                     "max_tokens": t, "without_checkpointing_gib": act_off / GIB, "with_checkpointing_gib": act_on / GIB}
    # a GRPO group's copies share one prefill; at most max_batch_size rows are decoded together
    distinct = min(math.ceil(cfg.rollout.tasks_per_step / world), cfg.rollout.max_batch_size)
    if backend != "vllm":
        add(Item("rollout", "prefill working set, one layer (bound)",
                 int(full * distinct * cfg.rollout.max_episode_tokens),
                 f"{distinct} distinct prompts x {cfg.rollout.max_episode_tokens} tokens x the layer's "
                 f"saved set"))

    # update
    add(Item("update", "gathered params (root + 2 layers)", (root_params + 2 * layer_params) * cb,
             "FSDP2 all-gather in the compute dtype, next layer prefetched"))
    add(Item("update", "unsharded grads (root + 1 layer, fp32)", (root_params + layer_params) * 4, "before reduce-scatter"))
    ac = cfg.model.activation_checkpointing
    add(Item("update", f"activations, {t} tokens (checkpointing {'on' if ac else 'off'})", act_on if ac else act_off,
             f"measured {full / 1024:.0f} KiB/token/layer ({ckpt / 1024:.0f} KiB checkpointed)"))
    add(Item("update", "LM-head kernel workspace", FUSED_WORKSPACE_BYTES_CUDA, "kernels._common.FUSED_WORKSPACE_BYTES_CUDA"))
    add(Item("update", "hidden-state gradient (fp32)", t * h * 4, "returned by the fused loss"))
    return p


def print_plan(p: Plan) -> None:
    from rich.console import Console
    from rich.table import Table
    t = Table(title=f"dry run: {p.config} at world size {p.world_size}, per rank ({p.architecture})")
    for col, just in (("phase", "left"), ("what", "left"), ("GiB", "right"), ("from", "left")):
        t.add_column(col, justify=just)
    for i in p.items:
        t.add_row(i.phase, i.name, f"{i.bytes / GIB:.2f}", i.how)
    for ph in ("resident", "rollout", "update"):
        t.add_row(f"[b]{ph}[/b]", "total", f"[b]{p.total(ph) / GIB:.2f}[/b]", "")
    a = p.activations
    t.add_row("", f"(activations without / with checkpointing: {a['without_checkpointing_gib']:.1f} / "
                  f"{a['with_checkpointing_gib']:.1f} GiB)", "", "")
    c = Console()
    c.print(t)
    verdict = "fits" if p.fits else "DOES NOT FIT"
    c.print(f"peak per rank: {p.peak_bytes / GIB:.1f} GiB (resident {p.total('resident') / GIB:.1f} + "
            f"{p.peak_phase} {p.total(p.peak_phase) / GIB:.1f}) of {p.gpu_memory_gib:g} GiB: {verdict}; "
            f"{p.params / 1e9:.2f}B parameters")


def write_json(p: Plan, path: str | Path) -> None:
    Path(path).write_text(json.dumps(p.to_json(), indent=2) + "\n")
