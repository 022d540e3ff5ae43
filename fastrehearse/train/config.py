"""Trainer configuration: plain dataclasses, loaded from YAML with `--set key=value` overrides.

Every key is checked at start: an unknown key fails naming the key, the allowed ones and the closest
match; a mistyped value (e.g. a string for a float) fails naming the key, the expected and the given
type. Nothing is silently ignored, so a typo in a 2-hour GPU run fails in the first second.
"""
from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROLLOUT_MODES = ("rehearse", "real", "hybrid")
KL_TYPES = ("k1", "k2", "k3", "low_var_kl")
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
    # Keyword arguments for fastrehearse.model.load_model (e.g. tiny-model sizes); free-form.
    options: dict = field(default_factory=dict)


@dataclass
class EnvConfig:
    suite: str = "builtin"
    options: dict = field(default_factory=dict)   # passed to fastrehearse.envs.get_suite
    train_split: str = "train"
    eval_split: str = "test"
    max_train_tasks: int | None = None


@dataclass
class RolloutConfig:
    mode: str = "rehearse"          # rehearse | real | hybrid (see fastrehearse.rollout)
    hybrid_p: float = 0.5           # hybrid: probability that a call is executed for real
    group_size: int = 4             # samples per task (the GRPO group)
    tasks_per_step: int = 4         # tasks per RL step over all ranks (split evenly)
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 128       # per generated turn
    max_turns: int = 6
    max_episode_tokens: int = 2048
    measure_fidelity: bool = True   # also execute rehearsed calls (never shown to the model) to
                                    # score the world model: exact match / JSON field F1
    options: dict = field(default_factory=dict)  # extra fastrehearse.rollout.RolloutConfig fields


@dataclass
class EvalConfig:
    """Held-out evaluation before and after training (the final table)."""
    num_tasks: int = 16             # tasks of env.eval_split
    mode: str = "real"              # how success is measured: tools executed for real
    temperature: float = 0.0        # greedy
    fidelity: bool = True           # extra rehearse-mode pass scoring rehearsed vs real responses
    before: bool = True
    after: bool = True


@dataclass
class LossConfig:
    """Mirrors fastrehearse.kernels.PolicyLossConfig (the kernel owns the math)."""
    w_act: float = 1.0
    w_rehearse: float = 1.0
    w_observed: float = 0.0
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    kl_coef: float = 0.0
    kl_type: str = "k3"
    entropy_coef: float = 0.0
    temperature: float | None = None   # None: rollout.temperature (the ratio needs the same one)


@dataclass
class AlgoConfig:
    std_normalize: bool = False     # off by default, as in the paper's code (and Dr. GRPO)
    leave_one_out: bool = False
    turn_reward_coef: float = 1.0
    aggregation: str = "token-mean"  # token-mean | seq-mean-token-mean | seq-mean-token-sum-norm
    norm_len: float | None = None   # Dr. GRPO constant (default: rollout.max_episode_tokens)
    updates_per_batch: int = 1      # optimizer steps per rollout batch (1 = strictly on-policy)
    loss: LossConfig = field(default_factory=LossConfig)


@dataclass
class OptimConfig:
    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1       # cosine decays to lr * min_lr_ratio at the last step
    grad_clip: float = 1.0          # max global grad norm (0 = off)


@dataclass
class SFTConfig:
    """Optional warm-up on gold trajectories before RL: CE on ACT (and OBSERVED) tokens."""
    steps: int = 0
    tasks_per_step: int = 8
    lr: float = 1e-4
    warmup_steps: int = 0
    w_act: float = 1.0
    w_observed: float = 1.0         # the world model learns tool responses from real ones


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
    tensorboard: bool = False       # used only when installed
    wandb: bool = False             # used only when installed
    wandb_project: str = "fastrehearse"


@dataclass
class TrainConfig:
    run_dir: str = "runs/default"
    seed: int = 0
    steps: int = 10                 # RL steps (rollout batches)
    max_tokens: int = 4096          # token budget of one packed micro-batch
    device: str = "auto"            # auto | cpu | cuda
    max_consecutive_skips: int = 3  # non-finite loss/grad-norm steps in a row before giving up
    model: ModelConfig = field(default_factory=ModelConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)


# ----------------------------------------------------------------------------------------------
# Loading and checking


def _type_name(tp) -> str:
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
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"config key '{key}' must be a list, got {value!r} ({type(value).__name__})")
        (inner,) = typing.get_args(tp) or (Any,)
        return [_coerce(v, inner, f"{key}[{i}]") for i, v in enumerate(value)]
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


def _unknown(key: str, allowed: list[str]) -> ConfigError:
    leaf = key.rsplit(".", 1)[-1]
    close = difflib.get_close_matches(leaf, allowed, n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return ConfigError(f"unknown config key '{key}'{hint}; allowed keys here: {sorted(allowed)}")


def from_dict(cls, data: dict, prefix: str = ""):
    """Build dataclass `cls` from a nested dict, rejecting unknown keys and wrong types."""
    if not isinstance(data, dict):
        raise ConfigError(f"config key '{prefix.rstrip('.') or '<root>'}' must be a mapping (a "
                          f"section), got {data!r} ({type(data).__name__})")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for k, v in data.items():
        key = f"{prefix}{k}"
        if k not in names:
            raise _unknown(key, names)
        tp = hints[k]
        if dataclasses.is_dataclass(tp):
            kwargs[k] = from_dict(tp, v if v is not None else {}, prefix=f"{key}.")
        else:
            kwargs[k] = _coerce(v, tp, key)
    return cls(**kwargs)


def apply_override(cfg, assignment: str):
    """Apply one `a.b.c=value` (value parsed as YAML: 1e-5, true, null, [0.9, 0.95], text)."""
    if "=" not in assignment:
        raise ConfigError(f"--set expects key=value, got {assignment!r}")
    dotted, raw = assignment.split("=", 1)
    dotted = dotted.strip()
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"--set {dotted}: cannot parse value {raw!r}: {e}") from None
    parts = dotted.split(".")
    obj = cfg
    for i, part in enumerate(parts):
        names = [f.name for f in dataclasses.fields(obj)]
        key = ".".join(parts[: i + 1])
        if part not in names:
            raise _unknown(key, names)
        tp = typing.get_type_hints(type(obj))[part]
        if i == len(parts) - 1:
            if dataclasses.is_dataclass(tp):
                merged = {**dataclasses.asdict(getattr(obj, part)), **(value or {})} \
                    if isinstance(value, dict) else value
                setattr(obj, part, from_dict(tp, merged, prefix=f"{key}."))
            else:
                setattr(obj, part, _coerce(value, tp, key))
        else:
            if not dataclasses.is_dataclass(tp):
                raise ConfigError(f"config key '{key}' is a {_type_name(tp)}, not a section; "
                                  f"cannot set '{dotted}'")
            obj = getattr(obj, part)
    return cfg


def validate(cfg: TrainConfig) -> TrainConfig:
    """Value checks beyond types (choices, ranges)."""
    from fastrehearse.algo.aggregation import AGGREGATIONS

    def choice(key, value, allowed):
        if value not in allowed:
            raise ConfigError(f"config key '{key}' = {value!r} is not one of {list(allowed)}")

    def positive(key, value, zero_ok=False):
        if value < 0 or (value == 0 and not zero_ok):
            raise ConfigError(f"config key '{key}' must be {'>= 0' if zero_ok else '> 0'}, got {value}")

    choice("rollout.mode", cfg.rollout.mode, ROLLOUT_MODES)
    choice("eval.mode", cfg.eval.mode, ROLLOUT_MODES)
    choice("algo.aggregation", cfg.algo.aggregation, AGGREGATIONS)
    choice("algo.loss.kl_type", cfg.algo.loss.kl_type, KL_TYPES)
    choice("model.precision", cfg.model.precision, PRECISIONS)
    choice("device", cfg.device, ("auto", "cpu", "cuda"))
    for key in ("rollout.group_size", "rollout.tasks_per_step", "rollout.max_new_tokens",
                "rollout.max_turns", "rollout.max_episode_tokens", "max_tokens",
                "algo.updates_per_batch", "max_consecutive_skips", "sft.tasks_per_step"):
        positive(key, _get(cfg, key))
    for key in ("steps", "sft.steps", "optim.lr", "sft.lr", "optim.grad_clip", "optim.warmup_steps",
                "checkpoint.every", "algo.loss.kl_coef", "algo.loss.clip_low", "algo.loss.clip_high",
                "log.plot_every", "eval.num_tasks", "eval.temperature"):
        positive(key, _get(cfg, key), zero_ok=True)
    positive("checkpoint.keep", cfg.checkpoint.keep)
    if cfg.model.options and not cfg.model.spec.startswith("tiny-"):
        raise ConfigError(f"config key 'model.options' is only used with tiny-* models, got "
                          f"{cfg.model.options} for model.spec={cfg.model.spec!r}")
    positive("rollout.temperature", cfg.rollout.temperature)
    if not 0.0 <= cfg.rollout.hybrid_p <= 1.0:
        raise ConfigError(f"config key 'rollout.hybrid_p' must be in [0, 1], got {cfg.rollout.hybrid_p}")
    if cfg.algo.loss.dual_clip is not None and cfg.algo.loss.dual_clip <= 1.0:
        raise ConfigError(f"config key 'algo.loss.dual_clip' must be > 1 (or null), got "
                          f"{cfg.algo.loss.dual_clip}")
    t = cfg.algo.loss.temperature
    if t is not None and cfg.rollout.temperature > 0 and t != cfg.rollout.temperature:
        raise ConfigError(f"config key 'algo.loss.temperature' ({cfg.algo.loss.temperature}) must equal "
                          f"'rollout.temperature' ({cfg.rollout.temperature}): the importance ratio "
                          f"compares log-probs of the same tempered distribution")
    if len(cfg.optim.betas) != 2:
        raise ConfigError(f"config key 'optim.betas' must have 2 entries, got {cfg.optim.betas}")
    if cfg.max_tokens < cfg.rollout.max_episode_tokens:
        raise ConfigError(f"config key 'max_tokens' ({cfg.max_tokens}) must be >= "
                          f"'rollout.max_episode_tokens' ({cfg.rollout.max_episode_tokens}): a "
                          f"micro-batch must hold the longest episode")
    return cfg


EMBEDDED_MODELS = ("smollm2", "embedded")


def check_model_path(cfg: TrainConfig) -> None:
    """Fail in the first second (not after the imports and rendezvous) when model.spec names a
    local path that does not exist. Separate from `validate` so GPU presets that point at
    /models/... still load on machines without those weights."""
    spec = cfg.model.spec
    if spec in EMBEDDED_MODELS or spec.startswith("tiny-"):
        return
    if not Path(spec).expanduser().exists():
        raise ConfigError(f"model path '{spec}' does not exist (config key 'model.spec' must be an "
                          f"existing HF directory, a .gguf file, one of {list(EMBEDDED_MODELS)}, or "
                          f"tiny-llama / tiny-qwen2 / tiny-qwen3)")


def _get(cfg, dotted: str):
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> TrainConfig:
    """YAML file (or defaults when path is None) + `key=value` overrides, checked."""
    data: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {str(p)!r}")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {str(p)!r} is not valid YAML: {e}") from None
    cfg = from_dict(TrainConfig, data)
    for o in overrides:
        apply_override(cfg, o)
    return validate(cfg)


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def dump_config(cfg: TrainConfig, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
