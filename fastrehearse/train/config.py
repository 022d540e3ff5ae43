"""Trainer configuration: plain dataclasses, loaded from YAML with `--set key=value` overrides.

Components own their configs and the train config nests them: `rollout` is the rollout engine's
own RolloutConfig (plus the two keys only the trainer uses), `algo.loss` is the kernel's
PolicyLossConfig, `model.options` the loader's TinyModelOptions; `env.options` are the suite
constructor's keyword arguments, checked against its signature. So every key is checked at start
(`load_config` + `preflight`, before any weights load): an unknown key fails naming the key, the
allowed ones and the closest match; a mistyped value (e.g. a string for a float) fails naming the
key, the expected and the given type. Nothing is silently ignored, so a typo in a 2-hour GPU run
fails in the first seconds.
"""
from __future__ import annotations

import dataclasses
import difflib
import inspect
import math
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from fastrehearse.algo.rewards import WorldRewardConfig, check_task_reward
from fastrehearse.kernels import PolicyLossConfig
from fastrehearse.model.loader import TinyModelOptions
from fastrehearse.rollout.engine import MODES as ROLLOUT_MODES
from fastrehearse.rollout.engine import RolloutConfig as EngineRolloutConfig
from fastrehearse.rollout.vllm_backend import VLLMUnavailable, require_vllm

PRECISIONS = ("auto", "fp32", "bf16")


class ConfigError(ValueError):
    """A bad configuration key or value (raised before any work starts)."""


@dataclass
class ModelConfig:
    # A local HF directory, a .gguf file, "smollm2" (the embedded SmolLM2-135M-Instruct GGUF), or a
    # tiny random config for tests: "tiny-llama" | "tiny-qwen2" | "tiny-qwen3".
    spec: str = "smollm2"
    # auto: bf16 params / fp32 gradient reduction on CUDA, fp32 everywhere on CPU.
    precision: str = "auto"
    activation_checkpointing: bool = False
    # fastrehearse.kernels backend of every LM-head call (RL loss, SFT CE, old / reference
    # log-probs): auto (triton on CUDA, torch on CPU) | torch | triton | triton-fused (the no-grad
    # old / reference log-probs through the tl.dot + log-sum-exp tile kernel; not with an LM-head
    # bias or soft-cap). May change on resume (same math, different kernels).
    kernel_backend: str = "auto"
    # Sizes of a tiny-* model (fastrehearse.model.TinyModelOptions); other specs take none.
    options: TinyModelOptions = field(default_factory=TinyModelOptions)


@dataclass
class EnvConfig:
    # A registry name (builtin | bfcl | tau2 | mcp) or an import path "package.module:Class" naming
    # a fastrehearse.envs.Suite subclass (your own tools; docs/envs.md).
    suite: str = "builtin"
    # Keyword arguments of the suite's constructor (fastrehearse.envs.get_suite): names and simple
    # types are checked against its signature at start; values by the suite, also before the model loads.
    options: dict = field(default_factory=dict)
    train_split: str = "train"
    eval_split: str = "test"
    max_train_tasks: int | None = None
    # Task reward of training rollouts (fastrehearse.algo.rewards; docs/training.md "Rewards"): real
    # (env.score) | consistent (graded inside the episode's own, possibly rehearsed, world) | calls.
    # Evaluation always scores real.
    reward: typing.Literal["real", "consistent", "calls"] = "real"


@dataclass
class RolloutConfig(EngineRolloutConfig):
    """The rollout engine's own config (fastrehearse.rollout.RolloutConfig: every field of it is a
    key here) plus what only the trainer uses. RL rollouts also score the world model by default."""
    measure_fidelity: bool = True   # also execute rehearsed calls (never shown to the model) to
                                    # score the world model: exact match / JSON field F1
    group_size: int = 4             # samples per task (the GRPO group)
    tasks_per_step: int = 4         # tasks per RL step over all ranks (split evenly)

    def engine(self, **changes) -> EngineRolloutConfig:
        """The engine's config (this section minus the trainer-only keys), with `changes`."""
        kw = {f.name: getattr(self, f.name) for f in dataclasses.fields(EngineRolloutConfig)}
        return EngineRolloutConfig(**{**kw, **changes})


@dataclass
class EvalConfig:
    """Held-out evaluation before and after training (the final table)."""
    num_tasks: int = 16             # tasks of env.eval_split
    mode: str = "real"              # how success is measured: tools executed for real
    temperature: float = 0.0        # greedy
    fidelity: bool = True           # extra rehearse-mode pass scoring rehearsed vs real responses
    before: bool = True
    after: bool = True
    # Held-out eval every N optimizer steps (SFT steps count) as metrics rows (stage "eval"); the
    # checkpoint with the best held-out success is kept and named in summary.json. 0: off.
    every: int = 0


@dataclass
class AlgoConfig:
    std_normalize: bool = False     # off by default, as in the paper's code (and Dr. GRPO)
    leave_one_out: bool = False
    aggregation: str = "token-mean"  # token-mean | seq-mean-token-mean | seq-mean-token-sum-norm
    norm_len: float | None = None   # Dr. GRPO constant (default: rollout.max_episode_tokens)
    updates_per_batch: int = 1      # optimizer steps per rollout batch (1 = strictly on-policy)
    # The kernel's own config. loss.temperature follows rollout.temperature unless set (then it
    # must equal it: the importance ratio compares log-probs of the same tempered distribution).
    loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    # The REHEARSE role's reward (fastrehearse.algo.rewards): mode task | world (format + grounded).
    world_reward: WorldRewardConfig = field(default_factory=WorldRewardConfig)
    hybrid_baseline: typing.Literal["strata", "pooled"] = "strata"   # hybrid ACT baseline per stratum
    # Truncated importance sampling for the rollout/trainer mismatch (fastrehearse.algo.tis): each
    # sampled token's policy-gradient term (not KL / entropy) is weighted by
    # min(pi_trainer_old / pi_rollout, tis_cap). Applied with rollout.backend=vllm; null: off.
    tis_cap: float | None = 2.0
    # Sequence-level IS beside the token cap (fastrehearse.algo.tis.sequence_weights): per episode,
    # r = exp(sum over its sampled tokens of (old - rollout)); "truncate": its policy-gradient terms
    # weighted by min(r, tis_sequence_cap); "mask": an episode with r outside
    # [1 / tis_sequence_cap, tis_sequence_cap] trains no policy-gradient term. null: off.
    tis_sequence: typing.Optional[typing.Literal["truncate", "mask"]] = None
    tis_sequence_cap: float = 2.0


@dataclass
class OptimConfig:
    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1       # cosine decays to lr * min_lr_ratio at the last step
    grad_clip: float = 1.0          # max global grad norm (0 = off)
    # Keep a copy of the parameters and Adam moments across each optimizer step, so an update that
    # leaves a non-finite weight is rolled back and counted as a skipped step (costs one extra copy
    # of params + moments per rank; off: such an update stops training with an error instead).
    rollback_nonfinite: bool = True


@dataclass
class SFTConfig:
    """Optional SFT steps before RL: CE on ACT (and OBSERVED / REHEARSE) tokens.
    source gold: the tasks' gold trajectories (the warm-up; tool responses real, OBSERVED).
    source own_rehearsals (the learning experiment's Sr control, docs/training.md): each step
    samples the model's own episodes exactly as an RL step would (rollout.tasks_per_step x
    group_size from the RL task stream, rollout.mode rehearse, the RL step seed), keeps those whose
    env.reward (consistent) is 1, and trains CE on their ACT and REHEARSE tokens."""
    steps: int = 0
    source: typing.Literal["gold", "own_rehearsals"] = "gold"
    tasks_per_step: int = 8         # gold source only (own_rehearsals uses rollout.tasks_per_step)
    lr: float = 1e-4
    warmup_steps: int = 0
    w_act: float = 1.0
    w_observed: float = 1.0         # the world model learns tool responses from real ones
    w_rehearse: float = 1.0         # own_rehearsals: the world model learns its own kept rehearsals


@dataclass
class CheckpointConfig:
    every: int = 0                  # save every K RL steps (0 = only on SIGTERM and at the end)
    keep: int = 2                   # complete checkpoints kept (older ones are deleted)
    at_end: bool = True
    export: bool = True             # HF safetensors + config + tokenizer in run_dir/export


@dataclass
class LogConfig:
    progress: bool = True           # tqdm progress bar (rank 0)
    plot_every: int = 1             # refresh the PNG every K steps (0 = only at the end)
    tensorboard: bool = False       # run_dir/tb via torch.utils.tensorboard (needs `tensorboard`)
    wandb: bool = False             # used only when installed
    wandb_project: str = "fastrehearse"


@dataclass
class DistConfig:
    # Every collective's limit: a rank waiting longer for a peer (alive but stuck, or gone without
    # closing its connection) raises and the job stops. Above the longest normal wait between two
    # collectives -- one rank's rollout while the others wait to gather episodes, vLLM start-up,
    # rank 0's export; raise it for long HF rollouts at large models.
    timeout_s: float = 1800.0


@dataclass
class TrainConfig:
    run_dir: str = "runs/default"
    seed: int = 0
    steps: int = 10                 # RL steps (rollout batches)
    max_tokens: int = 4096          # token budget of one packed micro-batch
    device: str = "auto"            # auto | cpu | cuda
    max_consecutive_skips: int = 3  # non-finite steps in a row before giving up
    model: ModelConfig = field(default_factory=ModelConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    dist: DistConfig = field(default_factory=DistConfig)


# ----------------------------------------------------------------------------------------------
# Loading and checking

_SCALARS = (int, float, str, bool, type(None))
_FP32_MAX = 3.4028234663852886e38


def _type_name(tp) -> str:
    if typing.get_origin(tp) is typing.Literal:
        return "one of " + str(list(typing.get_args(tp)))
    return getattr(tp, "__name__", str(tp)).replace("NoneType", "None")


def _coerce(value: Any, tp, key: str) -> Any:
    """Check `value` against `tp`; the only conversions are int -> float and "1e-5" -> float."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, key)
            except ConfigError:
                pass
        raise ConfigError(f"config key '{key}' must be {' or '.join(_type_name(a) for a in args)}, "
                          f"got {value!r} ({type(value).__name__})")
    if origin is typing.Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"config key '{key}' = {value!r} is not one of {list(typing.get_args(tp))}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"config key '{key}' must be a list, got {value!r} ({type(value).__name__})")
        args = [a for a in typing.get_args(tp) if a is not Ellipsis] or [Any]
        out = [_coerce(v, args[min(i, len(args) - 1)], f"{key}[{i}]") for i, v in enumerate(value)]
        return out if origin is list else tuple(out)
    if tp is Any:
        return value
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"config key '{key}' must be a mapping, got {value!r} "
                              f"({type(value).__name__})")
        return dict(value)
    if tp is float:
        if isinstance(value, str):
            # YAML 1.1 reads 1e-5 (no dot) as a string; accept any text float() takes.
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"config key '{key}' must be float, got {value!r} ({type(value).__name__})")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"config key '{key}' must be int, got {value!r} ({type(value).__name__})")
        return value
    if tp in (bool, str):
        if not isinstance(value, tp):
            raise ConfigError(f"config key '{key}' must be {tp.__name__}, got {value!r} "
                              f"({type(value).__name__})")
        return value
    raise ConfigError(f"config key '{key}': unsupported annotation {tp!r}")  # pragma: no cover


def _unknown(key: str, allowed: list[str], what: str = "config key") -> ConfigError:
    leaf = key.rsplit(".", 1)[-1]
    close = difflib.get_close_matches(leaf, allowed, n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return ConfigError(f"unknown {what} '{key}'{hint}; allowed keys here: {sorted(allowed)}")


def _build(cls, kwargs: dict, prefix: str):
    """cls(**kwargs); a component's own value check (ValueError in __post_init__) names the section."""
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"config section '{prefix.rstrip('.') or '<root>'}': {e}") from None


# Keys that existed and did nothing: a config that sets one to its old default (e.g. a run_dir's
# config.yaml reused) loads unchanged -- the key never affected a run; any other value is refused,
# saying why, rather than silently ignored.
REMOVED_KEYS = {
    "algo.turn_reward_coef": (1.0, "it scaled Episode.metadata['turn_rewards'], which no environment "
                                   "the trainer runs produces (and episodes lose their metadata before "
                                   "advantages), so it never changed a run; turn-level rewards remain "
                                   "in fastrehearse.algo.compute_advantages (AdvantageConfig."
                                   "turn_reward_coef) for episodes you build yourself"),
}


def _removed(key: str, value) -> bool:
    """True if `key` is a removed key set to its old default (skip it); refuses any other value."""
    if key not in REMOVED_KEYS:
        return False
    default, why = REMOVED_KEYS[key]
    if value == default:
        return True
    raise ConfigError(f"config key '{key}' was removed: {why}; delete it from the config "
                      f"(got {value!r})")


def from_dict(cls, data: dict, prefix: str = "", seen: set | None = None):
    """Build dataclass `cls` from a nested dict, rejecting unknown keys and wrong types. The dotted
    keys given are added to `seen` (to tell a default from an explicit value)."""
    if not isinstance(data, dict):
        raise ConfigError(f"config key '{prefix.rstrip('.') or '<root>'}' must be a mapping (a "
                          f"section), got {data!r} ({type(data).__name__})")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for k, v in data.items():
        key = f"{prefix}{k}"
        if k not in names:
            if _removed(key, v):
                continue
            raise _unknown(key, names)
        if seen is not None:
            seen.add(key)
        tp = hints[k]
        if dataclasses.is_dataclass(tp):
            kwargs[k] = from_dict(tp, v if v is not None else {}, prefix=f"{key}.", seen=seen)
        else:
            kwargs[k] = _coerce(v, tp, key)
    return _build(cls, kwargs, prefix)


def apply_override(cfg, assignment: str, seen: set | None = None):
    """Apply one `a.b.c=value` (value parsed as YAML: 1e-5, true, null, [0.9, 0.95], text).

    A mapping given for a section or for a free-form dict (`env.options={level: mixed}`) is merged
    into what is there; `env.options.level=mixed` sets one entry.
    """
    if "=" not in assignment:
        raise ConfigError(f"--set expects key=value, got {assignment!r}")
    dotted, raw = assignment.split("=", 1)
    dotted = dotted.strip()
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"--set {dotted}: cannot parse value {raw!r}: {e}") from None
    if _removed(dotted, value):
        return cfg
    parts = dotted.split(".")
    obj = cfg
    for i, part in enumerate(parts):
        names = [f.name for f in dataclasses.fields(obj)]
        key = ".".join(parts[: i + 1])
        if part not in names:
            raise _unknown(key, names)
        tp = typing.get_type_hints(type(obj))[part]
        last = i == len(parts) - 1
        if seen is not None:
            seen.add(key)
        if not last and (tp is dict or typing.get_origin(tp) is dict):
            # a.options.k=v: one entry of a free-form mapping
            getattr(obj, part)[".".join(parts[i + 1:])] = value
            if seen is not None:
                seen.add(dotted)
            return cfg
        if last:
            if dataclasses.is_dataclass(tp):
                if isinstance(value, dict) and seen is not None:
                    seen.update(f"{key}.{k}" for k in value)
                merged = {**_shallow(getattr(obj, part)), **(value or {})} \
                    if isinstance(value, dict) else value
                setattr(obj, part, from_dict(tp, merged, prefix=f"{key}."))
            elif isinstance(value, dict) and (tp is dict or typing.get_origin(tp) is dict):
                setattr(obj, part, {**getattr(obj, part), **value})
            else:
                try:
                    setattr(obj, part, _coerce(value, tp, key))
                except (ValueError, TypeError) as e:   # a component checking on assignment
                    if isinstance(e, ConfigError):
                        raise
                    raise ConfigError(f"config key '{key}': {e}") from None
        else:
            if not dataclasses.is_dataclass(tp):
                raise ConfigError(f"config key '{key}' is a {_type_name(tp)}, not a section; "
                                  f"cannot set '{dotted}'")
            obj = getattr(obj, part)
    return cfg


def _shallow(obj) -> dict:
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


def _walk(obj, prefix=""):
    """(dotted key, value) of every leaf of a config dataclass."""
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if dataclasses.is_dataclass(v):
            yield from _walk(v, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", v


def validate(cfg: TrainConfig, explicit: set | frozenset = frozenset()) -> TrainConfig:
    """Value checks beyond types (choices, ranges). `explicit`: the dotted keys the user set (a
    default algo.loss.temperature follows rollout.temperature; a set one must equal it)."""
    from fastrehearse.algo.aggregation import AGGREGATIONS

    def choice(key, value, allowed):
        if value not in allowed:
            raise ConfigError(f"config key '{key}' = {value!r} is not one of {list(allowed)}")

    def positive(key, value, zero_ok=False):
        if value < 0 or (value == 0 and not zero_ok):
            raise ConfigError(f"config key '{key}' must be {'>= 0' if zero_ok else '> 0'}, got {value}")

    for key, v in _walk(cfg):
        if isinstance(v, float) and not (math.isfinite(v) and abs(v) <= _FP32_MAX):
            # beyond float32's range a value is inf for the fp32 weights and optimizer it meets
            raise ConfigError(f"config key '{key}' must be a finite number (within float32 range), got {v}")
    choice("rollout.mode", cfg.rollout.mode, ROLLOUT_MODES)
    choice("eval.mode", cfg.eval.mode, ROLLOUT_MODES)
    choice("algo.aggregation", cfg.algo.aggregation, AGGREGATIONS)
    choice("model.precision", cfg.model.precision, PRECISIONS)
    from fastrehearse.kernels import BACKENDS as KERNEL_BACKENDS, check_backend
    choice("model.kernel_backend", cfg.model.kernel_backend, KERNEL_BACKENDS)
    if cfg.model.kernel_backend in ("triton", "triton-fused"):
        import torch

        on_cpu = cfg.device == "cpu" or (cfg.device == "auto" and not torch.cuda.is_available())
        try:   # the kernels' own check (CUDA or TRITON_INTERPRET=1; triton importable), before any work
            check_backend(cfg.model.kernel_backend, torch.device("cpu" if on_cpu else "cuda"))
        except ValueError as e:
            raise ConfigError(f"config key 'model.kernel_backend' = {cfg.model.kernel_backend!r}: {e}"
                              + (" (this run is on the CPU)" if on_cpu else "")) from None
    choice("device", cfg.device, ("auto", "cpu", "cuda"))
    positive("dist.timeout_s", cfg.dist.timeout_s)
    for key in ("rollout.group_size", "rollout.tasks_per_step", "rollout.max_new_tokens",
                "rollout.max_turns", "rollout.max_episode_tokens", "max_tokens",
                "algo.updates_per_batch", "max_consecutive_skips", "sft.tasks_per_step", "optim.lr"):
        positive(key, _get(cfg, key))
    for key in ("steps", "sft.steps", "sft.lr", "optim.grad_clip", "optim.warmup_steps",
                "checkpoint.every", "algo.loss.kl_coef", "algo.loss.clip_low", "algo.loss.clip_high",
                "log.plot_every", "eval.num_tasks", "eval.temperature", "eval.every", "optim.weight_decay",
                "optim.eps", "optim.min_lr_ratio", "env.max_train_tasks"):
        if _get(cfg, key) is not None:
            positive(key, _get(cfg, key), zero_ok=True)
    choice("sft.source", cfg.sft.source, ("gold", "own_rehearsals"))
    if cfg.sft.source == "own_rehearsals":   # the kept episodes must be rehearsed ones passing consistent
        if cfg.rollout.mode != "rehearse":
            raise ConfigError(f"config key 'rollout.mode' must be 'rehearse' with sft.source=own_rehearsals "
                              f"(got {cfg.rollout.mode!r}): the source is the model's own rehearsed episodes")
        if cfg.env.reward != "consistent":
            raise ConfigError(f"config key 'env.reward' must be 'consistent' with sft.source=own_rehearsals "
                              f"(got {cfg.env.reward!r}): episodes are kept when they pass it")
    if cfg.sft.steps > 0 and cfg.sft.lr == 0:
        raise ConfigError(f"config key 'sft.lr' must be > 0 when sft.steps > 0 (got 0 with "
                          f"sft.steps={cfg.sft.steps}): the warm-up would train nothing")
    positive("checkpoint.keep", cfg.checkpoint.keep)
    if cfg.eval.every and not cfg.eval.num_tasks:
        raise ConfigError(f"config key 'eval.every' = {cfg.eval.every} needs held-out tasks: "
                          f"eval.num_tasks is 0")
    if cfg.model.options != TinyModelOptions() and not cfg.model.spec.startswith("tiny-"):
        raise ConfigError(f"config key 'model.options' is only used with tiny-* models, got "
                          f"{dataclasses.asdict(cfg.model.options)} for model.spec={cfg.model.spec!r}")
    positive("rollout.temperature", cfg.rollout.temperature)
    try:
        cfg.rollout.engine().validate()
    except ValueError as e:
        raise ConfigError(f"config section 'rollout': {e}") from None
    if cfg.rollout.rehearsal != "inline":
        raise ConfigError(f"config key 'rollout.rehearsal' = {cfg.rollout.rehearsal!r}: training rehearses "
                          f"inline; 'separate' (a fresh simulator prompt per call) is the rollout "
                          f"benchmark's baseline (benchmarks/bench_rollout.py), not a training setting")
    want = cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0
    if "algo.loss.temperature" in explicit:
        t = cfg.algo.loss.temperature
        if cfg.rollout.temperature > 0 and t != cfg.rollout.temperature:
            raise ConfigError(f"config key 'algo.loss.temperature' ({t}) must equal "
                              f"'rollout.temperature' ({cfg.rollout.temperature}): the importance ratio "
                              f"compares log-probs of the same tempered distribution")
    else:
        cfg.algo.loss.temperature = want
    if len(cfg.optim.betas) != 2 or not all(0 <= b < 1 for b in cfg.optim.betas):
        raise ConfigError(f"config key 'optim.betas' must be 2 numbers in [0, 1), got {cfg.optim.betas}")
    if cfg.algo.tis_cap is not None:
        positive("algo.tis_cap", cfg.algo.tis_cap)
    positive("algo.tis_sequence_cap", cfg.algo.tis_sequence_cap)
    if cfg.algo.tis_sequence == "mask" and cfg.algo.tis_sequence_cap <= 1:
        raise ConfigError(f"config key 'algo.tis_sequence_cap' must be > 1 with tis_sequence=mask (episodes "
                          f"with a ratio outside [1/cap, cap] are masked), got {cfg.algo.tis_sequence_cap}")
    if cfg.max_tokens < cfg.rollout.max_episode_tokens:
        raise ConfigError(f"config key 'max_tokens' ({cfg.max_tokens}) must be >= "
                          f"'rollout.max_episode_tokens' ({cfg.rollout.max_episode_tokens}): a "
                          f"micro-batch must hold the longest episode")
    return cfg


def warnings_for(cfg: TrainConfig) -> list[str]:
    """Settings that are legal but train less than a user may think (printed at start)."""
    out = []
    if cfg.steps > 0 and cfg.rollout.group_size == 1:
        out.append("rollout.group_size=1: a group of one episode has no baseline, so every GRPO "
                   "advantage is 0 (zero_signal_groups is 1.0); only the entropy / KL / CE terms train")
    return out


EMBEDDED_MODELS = ("smollm2", "embedded")


def check_model_path(cfg: TrainConfig) -> None:
    """Fail in the first seconds (not after the imports and rendezvous) when model.spec cannot
    load: a local path that does not exist, a directory without config.json or weights, a
    truncated safetensors file, bad tiny-model sizes. Separate from `validate` so GPU presets that
    point at /models/... still load on machines without those weights."""
    from fastrehearse.model.loader import ModelSpecError, check_spec
    try:
        check_spec(cfg.model.spec, cfg.model.options)
    except ModelSpecError as e:
        raise ConfigError(f"{e} (config key 'model.spec')") from None


def check_env(cfg: TrainConfig) -> None:
    """env.suite exists and env.options are keyword arguments of its constructor (simple types
    checked too), without building the suite (its values are checked when it is built, which the
    trainer also does before loading the model)."""
    from fastrehearse.envs import SUITES, is_import_path, suite_class
    if cfg.env.suite not in SUITES and not is_import_path(cfg.env.suite):
        close = difflib.get_close_matches(cfg.env.suite, list(SUITES), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ConfigError(f"config key 'env.suite' = {cfg.env.suite!r} is not a suite{hint}; "
                          f"available: {sorted(SUITES)} or an import path 'package.module:Class'")
    try:
        cls = suite_class(cfg.env.suite)
    except (ImportError, ValueError) as e:
        raise ConfigError(f"config key 'env.suite': {e}") from None
    try:
        check_task_reward(cls, cfg.env.reward)
    except ValueError as e:
        raise ConfigError(f"config key 'env.reward': {e}") from None
    params = inspect.signature(cls.__init__).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    allowed = [k for k, p in params.items() if k != "self" and p.kind is not p.VAR_POSITIONAL]
    try:
        hints = typing.get_type_hints(cls.__init__)
    except Exception:  # noqa: BLE001 - unresolvable annotations: names are still checked
        hints = {}
    for k, v in cfg.env.options.items():
        key = f"env.options.{k}"
        if k not in allowed:
            raise _unknown(key, allowed)
        tp = hints.get(k)
        simple = tp in _SCALARS or (typing.get_origin(tp) in (typing.Union, types.UnionType)
                                    and all(a in _SCALARS for a in typing.get_args(tp)))
        if tp is not None and simple:
            _coerce(v, tp, key)


def check_device(cfg: TrainConfig) -> None:
    if cfg.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            raise ConfigError("config key 'device' = 'cuda' but CUDA is not available here "
                              "(torch.cuda.is_available() is False); use device=auto or device=cpu")


def check_rollout_backend(cfg: TrainConfig) -> None:
    """rollout.backend=vllm without vLLM installed (ROLLOUT, issue 28): refused before the model loads."""
    if cfg.rollout.backend == "vllm":
        try:
            require_vllm()
        except VLLMUnavailable as e:
            raise ConfigError(f"config key 'rollout.backend' = 'vllm': {e}") from None


def preflight(cfg: TrainConfig) -> None:
    """Every check that needs no weights: model files, suite and its options, device."""
    check_model_path(cfg)
    check_env(cfg)
    check_device(cfg)
    check_rollout_backend(cfg)


def _get(cfg, dotted: str):
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _preset_dirs() -> list[Path]:
    """Where the packaged presets are: the installed `fastrehearse.configs` (package data of a wheel
    or an editable install), else a source checkout's top-level configs/ (run from its root, the
    source folder shadows the installed package and has no `configs` subpackage)."""
    from importlib import resources
    dirs = []
    try:
        dirs.append(Path(str(resources.files("fastrehearse.configs"))))
    except ModuleNotFoundError:
        pass
    src = Path(__file__).resolve().parents[2] / "configs"
    if src.is_dir() and src not in dirs:
        dirs.append(src)
    return dirs


def preset_names() -> list[str]:
    return sorted({p.stem for d in _preset_dirs() for p in d.glob("*.yaml")})


def resolve_config_path(path: str | Path) -> Path:
    """A YAML file, or the name of a packaged preset (`smoke`, `demo.yaml`, ...) when no file of
    that name exists here: `--config smoke` works from any folder and with a wheel install."""
    p = Path(path)
    if p.is_file() or len(p.parts) != 1:
        return p
    name = p.name[:-len(".yaml")] if p.name.endswith(".yaml") else p.name
    for d in _preset_dirs():
        if (d / f"{name}.yaml").is_file():
            return d / f"{name}.yaml"
    return p


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> TrainConfig:
    """YAML file or packaged preset name (or defaults when path is None) + `key=value` overrides, checked."""
    data: dict = {}
    if path is not None:
        p = resolve_config_path(path)
        if not p.is_file():
            hint = (f" (nor a packaged preset: {', '.join(preset_names())})" if len(p.parts) == 1 else "")
            raise ConfigError(f"config file not found: {str(p)!r}{hint}")
        try:
            text = p.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            raise ConfigError(f"config file {str(p)!r} is not a text (YAML) file") from None
        if "\x00" in text:
            raise ConfigError(f"config file {str(p)!r} is not a text (YAML) file")
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {str(p)!r} is not valid YAML: {e}") from None
    seen: set = set()
    cfg = from_dict(TrainConfig, data, seen=seen)
    for o in overrides:
        apply_override(cfg, o, seen=seen)
    _env_defaults(cfg, None if path is None else Path(path).resolve().parent, seen)
    return validate(cfg, explicit=seen)


def _env_defaults(cfg: TrainConfig, config_dir: Path | None, explicit: set) -> None:
    """What a suite's options default to from where the config lives. A suite whose constructor
    takes `config_dir` gets the config file's folder (relative paths in its options are relative
    to the config, wherever the command runs; the working directory without a file). A suite
    whose real calls may have side effects (`Suite.costly_calls(options)`: MCP servers unless
    declared free of them) measures no fidelity unless the config asks: fidelity executes every
    rehearsed call for real."""
    from fastrehearse.envs import suite_class
    try:
        cls = suite_class(cfg.env.suite)
    except (ImportError, ValueError):
        return   # check_env refuses it, naming the key
    params = inspect.signature(cls.__init__).parameters
    if "config_dir" in params and "config_dir" not in cfg.env.options:
        cfg.env.options["config_dir"] = str(config_dir or Path.cwd().resolve())
    if cls.costly_calls(cfg.env.options):
        for key in ("rollout.measure_fidelity", "eval.fidelity"):
            if key not in explicit:
                section, name = key.split(".")
                setattr(getattr(cfg, section), name, False)


# ----------------------------------------------------------------------------------------------
# Resume: which keys may change


# Keys (or sections, ending in ".") a resumed run may change: they take effect from the resumed
# step and are announced. Everything else (model, shapes, seed, data, rollout, loss, SFT layout)
# must match the checkpoint's config, or the resumed run would not be the run it claims to be.
RESUME_MAY_CHANGE = ("steps", "run_dir", "device", "max_tokens", "max_consecutive_skips",
                     "model.activation_checkpointing", "model.kernel_backend", "optim.", "sft.lr", "sft.warmup_steps",
                     "checkpoint.", "log.", "eval.", "dist.")


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and not (prefix + k).endswith("env.options"):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def resume_changes(old: dict, new: dict) -> tuple[list, list]:
    """(allowed, forbidden) lists of (key, old value, new value) between two config dicts. A key
    the old config lacks (added to the code since) counts as unchanged."""
    a, b = flatten(old), flatten(new)
    allowed, forbidden = [], []
    for k in sorted(b):
        if k not in a or a[k] == b[k]:
            continue
        if k == "algo.loss.temperature" and a[k] is None:   # configs written before it was resolved
            continue
        ok = any(k == p or (p.endswith(".") and k.startswith(p)) for p in RESUME_MAY_CHANGE)
        (allowed if ok else forbidden).append((k, a[k], b[k]))
    return allowed, forbidden


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def dump_config(cfg: TrainConfig, path: str | Path) -> None:
    """Write atomically (a kill or a full disk never leaves a half-written config.yaml)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    os.replace(tmp, path)


def read_config_dict(path: str | Path) -> dict | None:
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    return data if isinstance(data, dict) else None
