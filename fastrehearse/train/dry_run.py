"""`fastrehearse train --config X --dry-run --world-size N`: will this run fit, per rank, before any GPU?

A PLAN, not a measurement on a GPU. The run's model is built the way `setup` builds it -- on meta,
wrapped, FSDP2-sharded over a world of N ranks on torch's fake process group (one CPU process, no
GPU, no weights), with the run's mixed precision and activation checkpointing -- and each rank's GPU
memory is added up. Every term says where its number comes from (`Item.basis`):

  measured  read from that build (the padded shard every parameter has on a rank), or measured on
            one real decoder layer of the architecture on the CPU (bytes per token, scaled
            linearly to the run's token counts)
  formula   an equation over measured counts and the config (dtype sizes, rows x tokens, ...)
  assumed   a constant not derived from this build (CUDA context + NCCL, the usable HBM of a GPU)

  resident  fp32 master shards, fp32 gradient shards, AdamW's two moments, the reference shards (KL
            only, in the compute dtype), the rollout backend (HF: a whole generation copy in the
            serving dtype; vLLM: none), CUDA context + NCCL (assumed)
  rollout   HF: the KV cache when every decoded row reaches max_episode_tokens, the allocator holes
            its growth by torch.cat leaves, and one layer's no-grad working set over the largest
            prefill; vLLM: its gpu_memory_utilization share (slept through the update: designed,
            not run on CUDA) and the weight sync's one gathered parameter
  update    two moments, the larger counts: forward/backward -- FSDP2's gathered params (root + 2
            layers in flight) and unsharded fp32 gradients (root + 1 layer), activations of one
            max_tokens micro-batch, the LM-head kernel's workspace and the hidden-state gradient;
            optimizer step -- the non-finite rollback copy of shards and moments
            (optim.rollback_nonfinite, taken just before `optimizer.step()`) and AdamW's foreach
            temporaries

peak = resident + max(rollout, update). The default budget is the usable HBM of an "80 GB" H100
(79.19 GiB: the total capacity PyTorch reports for it); fragmentation beyond the KV-cache holes and
the caching allocator's slack come on top. `tests/test_dry_run_tracker.py` checks the plan of the
smoke model against torch's own FSDPMemTracker on the CPU. The step time printed beside it is
PREDICTED (fastrehearse/train/step_time.py), from stated assumptions.
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
from rich.console import Console
from rich.table import Table
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore
from transformers import AutoConfig

from fastrehearse.dtensor import local_shard
from fastrehearse.kernels import FUSED_WORKSPACE_BYTES_CUDA
from fastrehearse.model import RehearsalModel, base_model
from fastrehearse.model.loader import (EMBEDDED_SPECS, head_dim, load_model, load_tokenizer,
                                      tiny_config)

from .config import ConfigError, TrainConfig
from .model_init import empty_model
from .parallelize import DistInfo, decoder_layers, mixed_precision, parallelize
from .step_time import format_step_time, predict_step_time

GIB = 1 << 30
CUDA_CONTEXT_BYTES = int(1.5 * GIB)   # assumption: CUDA context + NCCL buffers per rank
# Usable HBM per GPU: the total capacity PyTorch reports (torch.cuda.get_device_properties().
# total_memory, printed in its CUDA out-of-memory messages) -- not the marketing 80 / 141 GB. Not
# measured here: the values PyTorch prints on an H100 80GB and on an H200 141GB (as quoted in
# public CUDA out-of-memory reports).
USABLE_HBM_GIB = {"h100-80gb": 79.19, "h200-141gb": 139.80}
DEFAULT_BUDGET_GIB = USABLE_HBM_GIB["h100-80gb"]
# The HF backend's DynamicCache grows each layer's keys / values by torch.cat: every decode step
# allocates the longer tensor and frees the shorter one, which the caching allocator cannot hand to
# the next, longer request. Assumed bound: the holes left reach the live cache again (2x in all).
KV_GROWTH_FACTOR = 2.0
# What torch's foreach AdamW allocates in its step, in fp32 copies of the parameter shards: 4,
# measured by MemTracker on the CPU over the smoke model's DTensor shards (tests/test_dry_run_tracker.py;
# plain CPU tensors: 2). Not measured on CUDA, where torch's foreach source has one explicit
# temporary (the sqrt of exp_avg_sq): kept at 4 as the conservative value.
ADAMW_FOREACH_SHARDS = 4
PROBE_TOKENS = 32                      # activation bytes per token are constant in T (measured)


class DryRunError(ConfigError):
    """The dry run cannot plan this configuration (bad world size, unknown architecture)."""


BASES = ("measured", "formula", "assumed")
MOMENTS = ("forward/backward", "optimizer step")


@dataclass
class Item:
    phase: str          # resident | rollout | update
    name: str
    bytes: int
    how: str
    basis: str          # measured | formula | assumed (see the module docstring)
    moment: str = ""    # update only: forward/backward | optimizer step

    def __post_init__(self):
        assert self.basis in BASES, self.basis
        assert (self.moment in MOMENTS) == (self.phase == "update"), (self.phase, self.moment)


@dataclass
class Plan:
    config: str
    architecture: str
    world_size: int
    gpu_memory_gib: float
    params: int
    items: list[Item] = field(default_factory=list)
    activations: dict = field(default_factory=dict)   # per micro-batch, with and without checkpointing
    budget_basis: str = "assumed"
    step_time: dict = field(default_factory=dict)     # PREDICTED (step_time.py)

    def moment_total(self, moment: str) -> int:
        return sum(i.bytes for i in self.items if i.phase == "update" and i.moment == moment)

    def total(self, phase: str) -> int:
        """A phase's bytes on top of the resident ones; the update's is its larger moment."""
        if phase == "update":
            return max(self.moment_total(m) for m in MOMENTS)
        return sum(i.bytes for i in self.items if i.phase == phase)

    def rollback_cost(self) -> dict:
        """What optim.rollback_nonfinite costs: its copy's bytes, and how much it raises the peak."""
        copy_bytes = sum(i.bytes for i in self.items if i.name.startswith("rollback copy"))
        without = Plan(**{**self.__dict__, "items": [i for i in self.items if not i.name.startswith("rollback copy")]})
        return {"copy_gib": copy_bytes / GIB, "peak_increase_gib": (self.peak_bytes - without.peak_bytes) / GIB}

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
        return {**asdict(self), "is_a": "plan (not measured on a GPU)",
                "resident_gib": self.total("resident") / GIB,
                "rollout_gib": self.total("rollout") / GIB, "update_gib": self.total("update") / GIB,
                "update_moments_gib": {m: self.moment_total(m) / GIB for m in MOMENTS},
                "peak_phase": self.peak_phase, "peak_gib": self.peak_bytes / GIB, "fits": self.fits,
                "rollback_nonfinite": self.rollback_cost()}

    def overflow_line(self) -> str:
        if self.peak_phase == "update":
            moment = max(MOMENTS, key=self.moment_total)
            counted = [i for i in self.items if i.phase == "resident" or i.moment == moment]
        else:
            counted = [i for i in self.items if i.phase in ("resident", self.peak_phase)]
        big = max(counted, key=lambda i: i.bytes)
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
    return _probe_layer(config.to_json_string(use_diff=False), dtype)[:2]


def layer_prefill_bytes(config, dtype: torch.dtype = torch.bfloat16) -> float:
    """Peak bytes per token one decoder layer of `config` allocates in a no-grad forward (a prefill's
    working set; its input and weights excluded), measured by torch's MemTracker on one real layer."""
    return _probe_layer(config.to_json_string(use_diff=False), dtype)[2]


@functools.lru_cache(maxsize=8)
def _probe_layer(config_json: str, dtype: torch.dtype) -> tuple[float, float, float]:
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
    tracker = MemTracker()
    tracker.track_external(layer)
    with torch.no_grad(), tracker:
        out = run(x.detach())
        del out
    working = tracker.get_tracker_snapshot("peak")[torch.device("cpu")][_MemRefType.ACT]
    return full, ckpt, working / PROBE_TOKENS


def plan(cfg: TrainConfig, world: int, gpu_memory_gib: float = DEFAULT_BUDGET_GIB, arch: str | None = None,
         config_name: str = "", budget_basis: str = "assumed") -> Plan:
    """The per-rank plan of `cfg` at `world` ranks (builds and shards on torch's fake process group).
    `budget_basis`: "assumed" for the default usable HBM, "given" for the user's --gpu-memory-gib."""
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
        # what FSDP2 built on this rank (rank 0 holds the largest padded shard of every parameter)
        shard = sum(local_shard(p).numel() for p in policy.parameters())
        assert shard == sum(_padded_shard(tuple(p.shape), world) for p in policy.parameters())
        layers = decoder_layers(policy)
        layer_params = sum(p.numel() for p in layers[0].parameters())
    finally:
        dist.destroy_process_group()
    n_params = sum(math.prod(s) for _, s in named_shapes)
    root_params = n_params - layer_params * len(layers)
    compute = mixed_precision(cfg.model.precision, info.device).param_dtype or torch.float32
    cb = torch.finfo(compute).bits // 8
    p = Plan(config_name, source, world, gpu_memory_gib, n_params, budget_basis=budget_basis)

    def add(phase, name, nbytes, how, basis, moment=""):
        p.items.append(Item(phase, name, int(nbytes), how, basis, moment))

    # resident
    add("resident", "policy shards (fp32 master)", shard * 4,
        f"{shard / 1e6:.0f}M elements per rank (padded), read from the FSDP2 build", "measured")
    add("resident", "gradient shards (fp32)", shard * 4, "shard elements x 4 (reduce_dtype fp32)", "formula")
    add("resident", "AdamW moments (2 x fp32)", shard * 8, "shard elements x 8 (exp_avg + exp_avg_sq)", "formula")
    if cfg.algo.loss.kl_coef > 0:
        add("resident", f"reference shards ({compute})", shard * cb,
            f"shard elements x {cb} (algo.loss.kl_coef > 0; resharded after each forward)", "formula")
    backend = cfg.rollout.engine.backend
    kv_token = 2 * hf_config.num_hidden_layers * hf_config.num_key_value_heads * head_dim(hf_config) * 2
    rows = min(cfg.rollout.engine.max_batch_size, math.ceil(cfg.rollout.tasks_per_step / world) * cfg.rollout.group_size)
    gen_bytes = 2 if cfg.model.precision != "fp32" else 4
    if backend == "vllm":
        # One engine per rank in the rank's process; slept (level 2: weights and KV freed) through
        # the update and filled again by the weight sync, streamed from the shards one parameter at a
        # time (rollout/backends/vllm_backend.py). No generation copy on the trainer's side.
        frac = cfg.rollout.engine.vllm.gpu_memory_utilization
        add("rollout", "vLLM (weights + KV cache)", frac * gpu_memory_gib * GIB,
            f"rollout.vllm.gpu_memory_utilization={frac} of {gpu_memory_gib:g} GiB; freed through the update "
            f"by sleep mode (designed, not run on CUDA)", "assumed")
        largest = max(math.prod(s) for _, s in named_shapes)
        add("rollout", "weight sync: one gathered parameter", largest * gen_bytes,
            f"largest parameter x {gen_bytes} (serving dtype), streamed into the engine", "formula")
    else:
        add("resident", "generation copy (whole model)", n_params * gen_bytes,
            f"parameters x {gen_bytes}: the HF rollout backend decodes with the whole model", "formula")
        kv = rows * cfg.rollout.engine.max_episode_tokens * kv_token
        add("rollout", "KV cache, every row at max_episode_tokens", kv,
            f"{rows} rows x {cfg.rollout.engine.max_episode_tokens} tokens x {kv_token / 1024:.0f} KiB", "formula")
        add("rollout", "KV cache growth by torch.cat (allocator holes)", (KV_GROWTH_FACTOR - 1) * kv,
            f"assumed bound: holes up to the live cache again ({KV_GROWTH_FACTOR:g}x in all)", "formula")
    add("resident", "CUDA context + NCCL", CUDA_CONTEXT_BYTES, "assumed constant", "assumed")

    # activations (measured per token on one real layer)
    full, ckpt = layer_activation_bytes(hf_config, compute)
    t, n_layers, h = cfg.max_tokens, hf_config.num_hidden_layers, hf_config.hidden_size
    edges = t * h * cb * 2                                  # embedding output, final norm
    act_off = int(full * t * n_layers + edges)
    act_on = int(ckpt * t * n_layers + full * t + edges)   # + one layer recomputed in backward
    p.activations = {"per_token_per_layer_bytes": full, "checkpointed_per_token_per_layer_bytes": ckpt,
                     "max_tokens": t, "without_checkpointing_gib": act_off / GIB, "with_checkpointing_gib": act_on / GIB}
    # a GRPO group's copies share one prefill; at most max_batch_size rows are decoded together
    distinct = min(math.ceil(cfg.rollout.tasks_per_step / world), cfg.rollout.engine.max_batch_size)
    if backend != "vllm":
        working = layer_prefill_bytes(hf_config, compute)
        add("rollout", "prefill working set, one layer (no grad)", working * distinct * cfg.rollout.engine.max_episode_tokens,
            f"{distinct} distinct prompts x {cfg.rollout.engine.max_episode_tokens} tokens x {working / 1024:.0f} KiB "
            f"(one layer's no-grad peak per token, MemTracker)", "measured")

    # update: forward / backward
    fb, st = MOMENTS
    add("update", "gathered params (root + 2 layers)", (root_params + 2 * layer_params) * cb,
        "FSDP2 all-gather in the compute dtype, next layer prefetched", "formula", fb)
    add("update", "unsharded grads (root + 1 layer, fp32)", (root_params + layer_params) * 4,
        "before reduce-scatter", "formula", fb)
    ac = cfg.model.activation_checkpointing
    add("update", f"activations, {t} tokens (checkpointing {'on' if ac else 'off'})", act_on if ac else act_off,
        f"{full / 1024:.0f} KiB/token/layer ({ckpt / 1024:.0f} KiB checkpointed), saved-tensor hooks on one "
        f"layer", "measured", fb)
    add("update", "LM-head kernel workspace", FUSED_WORKSPACE_BYTES_CUDA,
        "the kernel's own budget, kernels._common.FUSED_WORKSPACE_BYTES_CUDA", "formula", fb)
    add("update", "hidden-state gradient (fp32)", t * h * 4, "max_tokens x hidden x 4, returned by the fused loss",
        "formula", fb)
    # update: optimizer step (gradients sharded, activations and gathered params freed)
    if cfg.optim.rollback_nonfinite:
        add("update", "rollback copy (params + moments)", shard * 12,
            "shard elements x 12, optim.rollback_nonfinite: taken before each optimizer.step()", "formula", st)
    add("update", f"AdamW foreach temporaries ({ADAMW_FOREACH_SHARDS} x fp32 shard)", shard * 4 * ADAMW_FOREACH_SHARDS,
        f"shard elements x 4 x {ADAMW_FOREACH_SHARDS} (the factor: torch's foreach AdamW over the DTensor "
        f"shards, MemTracker, smoke model)", "formula", st)
    p.step_time = predict_step_time(cfg, hf_config, world, n_params)
    return p


def print_plan(p: Plan) -> None:
    t = Table(title=f"dry run PLAN (not measured on a GPU): {p.config} at world size {p.world_size}, per rank "
                    f"({p.architecture})")
    for col, just in (("phase", "left"), ("what", "left"), ("GiB", "right"), ("basis", "left"), ("from", "left")):
        t.add_column(col, justify=just)
    for i in p.items:
        t.add_row(i.phase + (f" ({i.moment})" if i.moment else ""), i.name, f"{i.bytes / GIB:.2f}", i.basis, i.how)
    for ph in ("resident", "rollout"):
        t.add_row(f"[b]{ph}[/b]", "total", f"[b]{p.total(ph) / GIB:.2f}[/b]", "", "")
    for m in MOMENTS:
        t.add_row(f"[b]update ({m})[/b]", "total", f"[b]{p.moment_total(m) / GIB:.2f}[/b]", "", "")
    a = p.activations
    t.add_row("", f"(activations without / with checkpointing: {a['without_checkpointing_gib']:.1f} / "
                  f"{a['with_checkpointing_gib']:.1f} GiB)", "", "", "")
    c = Console()
    c.print(t)
    verdict = "fits" if p.fits else "DOES NOT FIT"
    budget = (f"{p.gpu_memory_gib:g} GiB (assumed: the usable HBM of an 80 GB H100, as PyTorch reports it)"
              if p.budget_basis == "assumed" else f"{p.gpu_memory_gib:g} GiB (--gpu-memory-gib)")
    c.print(f"planned peak per rank: {p.peak_bytes / GIB:.1f} GiB (resident {p.total('resident') / GIB:.1f} + "
            f"{p.peak_phase} {p.total(p.peak_phase) / GIB:.1f}) of {budget}: {verdict}; "
            f"{p.params / 1e9:.2f}B parameters")
    rb = p.rollback_cost()
    if rb["copy_gib"]:
        c.print(f"optim.rollback_nonfinite costs {rb['copy_gib']:.2f} GiB per rank in the optimizer step "
                f"(raises the peak by {rb['peak_increase_gib']:.2f} GiB) and a copy of it every step "
                f"(~{p.step_time.get('rollback_copy_ms', 0):.0f} ms predicted)")
    if p.step_time:
        c.print(format_step_time(p.step_time))


def write_json(p: Plan, path: str | Path) -> None:
    Path(path).write_text(json.dumps(p.to_json(), indent=2) + "\n")
