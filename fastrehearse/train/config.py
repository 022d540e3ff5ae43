"""Loading the trainer's configuration: YAML (a file or a packaged preset) + `--set key=value`
overrides -> a checked TrainConfig (the schema: fastrehearse/train/schema.py, whose names are
importable from here too).

Every key is checked at start (`load_config` + `preflight`, before any weights load): an unknown key
fails naming the key, the allowed ones and the closest match; a mistyped value (e.g. a string for a
float) fails naming the key, the expected and the given type; a choice is checked against its
Literal annotation as it is read; then `validate` runs every component's own `validate()` and the
trainer's ranges and rules across sections. Nothing is silently ignored, so a typo in a 2-hour GPU
run fails in the first seconds. A key moved to another path (RENAMED_KEYS) is read at its new path
with a one-line notice; a removed key (REMOVED_KEYS) loads only at its old default, with a one-line
notice.
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import inspect
import math
import os
import sys
import types
import typing
from importlib import resources
from pathlib import Path
from typing import Any, Callable

import torch
import yaml

from fastrehearse.algo.rewards import check_task_reward
from fastrehearse.envs import SUITES, is_import_path, suite_class
from fastrehearse.kernels import check_backend
from fastrehearse.model.loader import ModelSpecError, TinyModelOptions, check_spec
from fastrehearse.rollout.backends.vllm_backend import VLLMUnavailable, require_vllm

from .schema import (  # noqa: F401 - the schema's names, imported from here by the trainer and tests
    PRECISIONS,
    AlgoConfig,
    CheckpointConfig,
    DistConfig,
    EnvConfig,
    EvalConfig,
    LogConfig,
    ModelConfig,
    OptimConfig,
    SFTConfig,
    TrainConfig,
    TrainRolloutConfig,
)


class ConfigError(ValueError):
    """A bad configuration key or value (raised before any work starts)."""


# ----------------------------------------------------------------------------------------------
# Types

_SCALARS = (int, float, str, bool, type(None))


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


# ----------------------------------------------------------------------------------------------
# The key space: dotted keys as users write them (an inline component's keys in its section)


@functools.lru_cache(maxsize=None)
def _fields(cls) -> dict[str, tuple[tuple[str, ...], Any]]:
    """key -> (attribute path inside a `cls` instance, annotation) of every key written in a section
    of type `cls`: its own fields, and an inline component's fields in that component's place."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        if f.metadata.get("inline"):
            out.update({k: ((f.name, *path), tp) for k, (path, tp) in _fields(hints[f.name]).items()})
        else:
            out[f.name] = ((f.name,), hints[f.name])
    return out


def _at(obj, path: tuple[str, ...]):
    for name in path:
        obj = getattr(obj, name)
    return obj


def get_key(cfg, dotted: str):
    """The value of a dotted key as users write it (`rollout.max_turns`)."""
    for part in dotted.split("."):
        cfg = _at(cfg, _fields(type(cfg))[part][0])
    return cfg


def _set(cfg, dotted: str, value) -> None:
    *head, name = dotted.split(".")
    obj = get_key(cfg, ".".join(head)) if head else cfg
    path = _fields(type(obj))[name][0]
    setattr(_at(obj, path[:-1]), path[-1], value)


def leaves(obj, prefix: str = ""):
    """(dotted key, value) of every key of a config dataclass, as users write it."""
    for k, (path, _) in _fields(type(obj)).items():
        key = f"{prefix}{k}"
        if key in REMOVED_KEYS:
            continue
        v = _at(obj, path)
        if dataclasses.is_dataclass(v):
            yield from leaves(v, f"{key}.")
        else:
            yield key, v


def sections(obj, prefix: str = ""):
    """(dotted key, component) of every nested config dataclass, inline ones under their section."""
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if dataclasses.is_dataclass(v):
            key = prefix.rstrip(".") if f.metadata.get("inline") else f"{prefix}{f.name}"
            yield key, v
            yield from sections(v, f"{key}." if key else "")


def to_dict(cfg, prefix: str = "") -> dict:
    """The config as the nested dict users write (and config.yaml holds)."""
    out = {}
    for k, (path, _) in _fields(type(cfg)).items():
        if f"{prefix}{k}" in REMOVED_KEYS:
            continue
        v = _at(cfg, path)
        out[k] = to_dict(v, f"{prefix}{k}.") if dataclasses.is_dataclass(v) else copy.deepcopy(v)
    return out


# ----------------------------------------------------------------------------------------------
# Keys at another path, and keys removed

# Keys users wrote at another path: read at the new one (a value map translates the value too),
# with a one-line notice. A saved run's config.yaml in the old layout is mapped the same way before
# --resume compares it key by key (run_dir.resume_changes), so the same run compares equal.
RENAMED_KEYS: dict[str, tuple[str, dict | None]] = {
    "algo.std_normalize": ("algo.advantage.std_normalize", None),
    "algo.leave_one_out": ("algo.advantage.leave_one_out", None),
    "algo.world_reward.gate": ("algo.advantage.gate_rehearse_on_act", {"none": False, "act_signal": True}),
}

_TURN_REWARDS = ("it scaled Episode.metadata['turn_rewards'], which no environment the trainer runs "
                 "produces, so it never changed a run; turn-level rewards were deleted with it")
_SEPARATE = ("'separate' (a fresh simulator prompt per call) is the rollout benchmark's baseline "
             "(benchmarks/bench_rollout.py), not a training setting: training rehearses inline")
# Keys that are gone while their old default is what every run does: a config that sets one to
# that default (e.g. a run_dir's config.yaml reused) loads unchanged, with a one-line notice; any
# other value is refused, saying why, rather than silently ignored. A component field listed here
# is no trainer key.
REMOVED_KEYS = {
    "algo.turn_reward_coef": (1.0, _TURN_REWARDS),
    "algo.advantage.turn_reward_coef": (1.0, _TURN_REWARDS),
    "rollout.rehearsal": ("inline", _SEPARATE),
}


def _removed(key: str, value, notify: Callable[[str], None] | None = None) -> bool:
    """True if `key` is a removed key set to its old default (skip it; `notify` gets a notice);
    refuses any other value."""
    if key not in REMOVED_KEYS:
        return False
    default, why = REMOVED_KEYS[key]
    if value == default:
        if notify is not None:
            notify(f"config key '{key}' was removed; its old default {value!r} is what every run "
                   f"does (ignored: delete it from the config)")
        return True
    raise ConfigError(f"config key '{key}' was removed: {why}; delete it from the config "
                      f"(got {value!r})")


def _notice(line: str) -> None:
    if os.environ.get("RANK", "0") == "0":   # one line per job, not per rank
        print(f"fastrehearse: {line}", file=sys.stderr)


def move_renamed(data: dict, notify: Callable[[str], None] | None = None) -> dict:
    """`data` (a config as nested dicts) with every key of RENAMED_KEYS moved to its new path;
    `notify` gets one line per key moved. Setting a key at both paths is refused."""
    data = copy.deepcopy(data)
    for old, (new, values) in RENAMED_KEYS.items():
        *path, name = old.split(".")
        section = data
        for part in path:
            section = section.get(part) if isinstance(section, dict) else None
        if not isinstance(section, dict) or name not in section:
            continue
        value = section.pop(name)
        shown = f"'{old}'"
        if values is not None:
            if not isinstance(value, str) or value not in values:
                raise ConfigError(f"config key '{old}' = {value!r} is not one of {list(values)}")
            shown, value = f"'{old}: {value}'", values[value]
        *path, name = new.split(".")
        target = data
        for i, part in enumerate(path):
            if target.get(part) is None:     # an empty section, as from_dict reads it
                target[part] = {}
            target = target[part]
            if not isinstance(target, dict):
                raise ConfigError(f"config key '{'.'.join(path[:i + 1])}' must be a mapping (a section), "
                                  f"got {target!r}")
        if name in target:
            raise ConfigError(f"config key '{old}' moved to '{new}', and both are set: keep only '{new}'")
        target[name] = value
        if notify is not None:
            new_shown = f"'{new}: {yaml.safe_dump(value).splitlines()[0]}'" if values else f"'{new}'"
            notify(f"config key {shown} is now {new_shown} (read as that; write the new path)")
    return data


# ----------------------------------------------------------------------------------------------
# Building a config from dicts and `--set` assignments


def from_dict(cls, data: dict, prefix: str = "", seen: set | None = None, base=None,
              notify: Callable[[str], None] | None = None):
    """Build dataclass `cls` from a nested dict, rejecting unknown keys and wrong types; keys not
    given keep their value in `base` (default: `cls()`, so a section's own defaults hold). The
    dotted keys given are added to `seen` (to tell a default from an explicit value); `notify`
    gets the notice of a removed key skipped."""
    if not isinstance(data, dict):
        raise ConfigError(f"config key '{prefix.rstrip('.') or '<root>'}' must be a mapping (a "
                          f"section), got {data!r} ({type(data).__name__})")
    base = cls() if base is None else base
    keys = _fields(cls)
    given = {}
    for k, v in data.items():
        key = f"{prefix}{k}"
        if _removed(key, v, notify):
            continue
        if k not in keys:
            raise _unknown(key, list(keys))
        if seen is not None:
            seen.add(key)
        path, tp = keys[k]
        if dataclasses.is_dataclass(tp):
            given[path] = from_dict(tp, v if v is not None else {}, f"{key}.", seen, _at(base, path), notify)
        else:
            given[path] = _coerce(v, tp, key)
    return _assemble(cls, base, given, prefix)


def _assemble(cls, base, given: dict, prefix: str):
    """cls(...) from `given` (attribute path -> value) and `base` for the rest."""
    kwargs = {}
    for f in dataclasses.fields(cls):
        mine = {path[1:]: v for path, v in given.items() if path[0] == f.name}
        if f.metadata.get("inline") and mine:
            kwargs[f.name] = _assemble(type(getattr(base, f.name)), getattr(base, f.name), mine, prefix)
        else:
            kwargs[f.name] = mine.get((), getattr(base, f.name))
    return _build(cls, kwargs, prefix)


def apply_override(cfg, assignment: str, seen: set | None = None,
                   notify: Callable[[str], None] | None = _notice):
    """Apply one `a.b.c=value` (value parsed as YAML: 1e-5, true, null, [0.9, 0.95], text).

    A mapping given for a section or for a free-form dict (`env.options={level: mixed}`) is merged
    into what is there; `env.options.level=mixed` sets one entry. A renamed key is set at its new path.
    """
    if "=" not in assignment:
        raise ConfigError(f"--set expects key=value, got {assignment!r}")
    dotted, raw = assignment.split("=", 1)
    dotted = dotted.strip()
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"--set {dotted}: cannot parse value {raw!r}: {e}") from None
    if _removed(dotted, value, notify):
        return cfg
    nested = value
    for part in reversed(dotted.split(".")):
        nested = {part: nested}
    notes = []
    moved = move_renamed(nested, notes.append)
    if not notes:
        _assign(cfg, dotted, value, seen, notify)
        return cfg
    for line in notes:
        if notify is not None:
            notify(line)
    for key, v in _dict_leaves(moved):
        _assign(cfg, key, v, seen, notify)
    return cfg


def _dict_leaves(d: dict, prefix: str = ""):
    for k, v in d.items():
        if isinstance(v, dict) and v:
            yield from _dict_leaves(v, f"{prefix}{k}.")
        elif not isinstance(v, dict):
            yield f"{prefix}{k}", v


def _assign(cfg, dotted: str, value, seen: set | None, notify: Callable[[str], None] | None = None):
    parts = dotted.split(".")
    obj = cfg
    for i, part in enumerate(parts):
        keys = _fields(type(obj))
        key = ".".join(parts[: i + 1])
        if part not in keys:
            raise _unknown(key, list(keys))
        path, tp = keys[part]
        holder, name = _at(obj, path[:-1]), path[-1]
        last = i == len(parts) - 1
        if seen is not None:
            seen.add(key)
        if not last and (tp is dict or typing.get_origin(tp) is dict):
            # a.options.k=v: one entry of a free-form mapping
            getattr(holder, name)[".".join(parts[i + 1:])] = value
            if seen is not None:
                seen.add(dotted)
            return
        if last:
            if dataclasses.is_dataclass(tp):
                # a mapping is merged into the section; anything else is refused by from_dict
                setattr(holder, name, from_dict(tp, value, f"{key}.", seen, getattr(holder, name), notify))
            elif isinstance(value, dict) and (tp is dict or typing.get_origin(tp) is dict):
                setattr(holder, name, {**getattr(holder, name), **value})
            else:
                try:
                    setattr(holder, name, _coerce(value, tp, key))
                except (ValueError, TypeError) as e:   # a component checking on assignment
                    if isinstance(e, ConfigError):
                        raise
                    raise ConfigError(f"config key '{key}': {e}") from None
        else:
            if not dataclasses.is_dataclass(tp):
                raise ConfigError(f"config key '{key}' is a {_type_name(tp)}, not a section; "
                                  f"cannot set '{dotted}'")
            obj = getattr(holder, name)


# ----------------------------------------------------------------------------------------------
# Value checks

_FP32_MAX = 3.4028234663852886e38
# The trainer's own ranges (a component's are its validate(); None: a key's "off").
_POSITIVE = ("max_tokens", "max_consecutive_skips", "rollout.group_size", "rollout.tasks_per_step",
             "rollout.temperature", "algo.advantage.eps", "algo.updates_per_batch", "algo.tis_cap",
             "algo.tis_sequence_cap", "optim.lr", "sft.tasks_per_step", "checkpoint.keep", "dist.timeout_s")
_NON_NEGATIVE = ("steps", "env.max_train_tasks", "eval.num_tasks", "eval.temperature", "eval.every",
                 "optim.weight_decay", "optim.eps", "optim.warmup_steps", "optim.min_lr_ratio",
                 "optim.grad_clip", "sft.steps", "sft.lr", "checkpoint.every", "log.plot_every")


def validate(cfg: TrainConfig, explicit: set | frozenset = frozenset()) -> TrainConfig:
    """Value checks beyond types and choices: every component's own `validate()`, then the trainer's
    ranges and rules across sections. `explicit`: the dotted keys the user set (a default
    algo.loss.temperature follows rollout.temperature; a set one must equal it)."""
    for key, v in leaves(cfg):
        if isinstance(v, float) and not (math.isfinite(v) and abs(v) <= _FP32_MAX):
            # beyond float32's range a value is inf for the fp32 weights and optimizer it meets
            raise ConfigError(f"config key '{key}' must be a finite number (within float32 range), got {v}")
    owned = ()     # a component that validates itself checks its own subsections too
    for key, section in sections(cfg):
        if callable(getattr(section, "validate", None)) and not key.startswith(owned):
            owned += (f"{key}.",)
            try:
                section.validate()
            except ValueError as e:
                raise ConfigError(f"config section '{key}': {e}") from None
    for key in _POSITIVE + _NON_NEGATIVE:
        v = get_key(cfg, key)
        if v is not None and (v < 0 or (v == 0 and key in _POSITIVE)):
            raise ConfigError(f"config key '{key}' must be {'> 0' if key in _POSITIVE else '>= 0'}, got {v}")
    if cfg.model.kernel_backend in ("triton", "triton-fused"):
        on_cpu = cfg.device == "cpu" or (cfg.device == "auto" and not torch.cuda.is_available())
        try:   # the kernels' own check (CUDA or TRITON_INTERPRET=1; triton importable), before any work
            check_backend(cfg.model.kernel_backend, torch.device("cpu" if on_cpu else "cuda"))
        except ValueError as e:
            raise ConfigError(f"config key 'model.kernel_backend' = {cfg.model.kernel_backend!r}: {e}"
                              + (" (this run is on the CPU)" if on_cpu else "")) from None
    if cfg.model.options != TinyModelOptions() and not cfg.model.spec.startswith("tiny-"):
        raise ConfigError(f"config key 'model.options' is only used with tiny-* models, got "
                          f"{dataclasses.asdict(cfg.model.options)} for model.spec={cfg.model.spec!r}")
    rollout = cfg.rollout.engine
    if cfg.max_tokens < rollout.max_episode_tokens:
        raise ConfigError(f"config key 'max_tokens' ({cfg.max_tokens}) must be >= "
                          f"'rollout.max_episode_tokens' ({rollout.max_episode_tokens}): a "
                          f"micro-batch must hold the longest episode")
    if "algo.loss.temperature" not in explicit:
        cfg.algo.loss.temperature = rollout.temperature
    elif cfg.algo.loss.temperature != rollout.temperature:
        raise ConfigError(f"config key 'algo.loss.temperature' ({cfg.algo.loss.temperature}) must equal "
                          f"'rollout.temperature' ({rollout.temperature}): the importance ratio "
                          f"compares log-probs of the same tempered distribution")
    if cfg.algo.tis_sequence == "mask" and cfg.algo.tis_sequence_cap <= 1:
        raise ConfigError(f"config key 'algo.tis_sequence_cap' must be > 1 with tis_sequence=mask (episodes "
                          f"with a ratio outside [1/cap, cap] are masked), got {cfg.algo.tis_sequence_cap}")
    if len(cfg.optim.betas) != 2 or not all(0 <= b < 1 for b in cfg.optim.betas):
        raise ConfigError(f"config key 'optim.betas' must be 2 numbers in [0, 1), got {cfg.optim.betas}")
    if cfg.sft.steps > 0 and cfg.sft.lr == 0:
        raise ConfigError(f"config key 'sft.lr' must be > 0 when sft.steps > 0 (got 0 with "
                          f"sft.steps={cfg.sft.steps}): the warm-up would train nothing")
    if cfg.sft.source == "own_rehearsals":   # the kept episodes must be rehearsed ones passing consistent
        if rollout.mode != "rehearse":
            raise ConfigError(f"config key 'rollout.mode' must be 'rehearse' with sft.source=own_rehearsals "
                              f"(got {rollout.mode!r}): the source is the model's own rehearsed episodes")
        if cfg.env.reward != "consistent":
            raise ConfigError(f"config key 'env.reward' must be 'consistent' with sft.source=own_rehearsals "
                              f"(got {cfg.env.reward!r}): episodes are kept when they pass it")
    if cfg.eval.every and not cfg.eval.num_tasks:
        raise ConfigError(f"config key 'eval.every' = {cfg.eval.every} needs held-out tasks: "
                          f"eval.num_tasks is 0")
    return cfg


def warnings_for(cfg: TrainConfig) -> list[str]:
    """Settings that are legal but train less than a user may think (printed at start)."""
    out = []
    if cfg.steps > 0 and cfg.rollout.group_size == 1:
        out.append("rollout.group_size=1: a group of one episode has no baseline, so every GRPO "
                   "advantage is 0 (zero_signal_groups is 1.0); only the entropy / KL / CE terms train")
    return out


# ----------------------------------------------------------------------------------------------
# Checks that look outside the config (before any weights load)


def check_model_path(cfg: TrainConfig) -> None:
    """Fail in the first seconds (not after the imports and rendezvous) when model.spec cannot
    load: a local path that does not exist, a directory without config.json or weights, a
    truncated safetensors file, bad tiny-model sizes. Separate from `validate` so GPU presets that
    point at /models/... still load on machines without those weights."""
    try:
        check_spec(cfg.model.spec, cfg.model.options)
    except ModelSpecError as e:
        raise ConfigError(f"{e} (config key 'model.spec')") from None


def check_env(cfg: TrainConfig) -> None:
    """env.suite exists and env.options are keyword arguments of its constructor (simple types
    checked too), without building the suite (its values are checked when it is built, which the
    trainer also does before loading the model)."""
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
        if not torch.cuda.is_available():
            raise ConfigError("config key 'device' = 'cuda' but CUDA is not available here "
                              "(torch.cuda.is_available() is False); use device=auto or device=cpu")


def check_rollout_backend(cfg: TrainConfig) -> None:
    """rollout.backend=vllm without vLLM installed: refused before the model loads."""
    if cfg.rollout.engine.backend == "vllm":
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


# ----------------------------------------------------------------------------------------------
# Files: presets, loading, config.yaml


def _preset_dirs() -> list[Path]:
    """Where the packaged presets are: the installed `fastrehearse.configs` (package data of a wheel
    or an editable install), else a source checkout's top-level configs/ (run from its root, the
    source folder shadows the installed package and has no `configs` subpackage)."""
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


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = (),
                notify: Callable[[str], None] | None = _notice) -> TrainConfig:
    """YAML file or packaged preset name (or defaults when path is None) + `key=value` overrides,
    checked. `notify` gets the one-line notices (a renamed key read at its new path)."""
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
    cfg = from_dict(TrainConfig, move_renamed(data, notify) if isinstance(data, dict) else data, seen=seen,
                    notify=notify)
    for o in overrides:
        apply_override(cfg, o, seen=seen, notify=notify)
    _env_defaults(cfg, None if path is None else Path(path).resolve().parent, seen)
    return validate(cfg, explicit=seen)


def _env_defaults(cfg: TrainConfig, config_dir: Path | None, explicit: set) -> None:
    """What a suite's options default to from where the config lives. A suite whose constructor
    takes `config_dir` gets the config file's folder (relative paths in its options are relative
    to the config, wherever the command runs; the working directory without a file). A suite
    whose real calls may have side effects (`Suite.costly_calls(options)`: MCP servers unless
    declared free of them) measures no fidelity unless the config asks: fidelity executes every
    rehearsed call for real."""
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
                _set(cfg, key, False)


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
