"""Training rewards per role: the task reward (ACT) in three modes and the world-model reward
(REHEARSE), plus the hybrid ACT strata. Pure functions over episodes and trajectories; the trainer
calls `assign_rewards` once per rollout batch, before the advantages (docs/training.md "Rewards");
it returns new episodes and changes none it is given.

Task reward (config `env.reward`), what ACT is trained on:
  real        `env.score` as the engine computed it: the answer checked against the real world's
              value. In rehearse mode a rehearsing policy never sees that value, so this pays only
              for lucky guesses (docs/learning.md).
  consistent  graded inside the episode's own world (`Suite.task_reward(..., "consistent")`; the
              builtin suite: envs/builtin/scoring.py; BFCL: envs/bfcl.py): the answer against the
              values the episode's responses (rehearsed or real) hold, required calls against the
              task's gold calls, nothing executed.
  calls       the calls (and final state) only, no answer check.
An episode with a malformed call scores `rollout.malformed_reward` in every mode (None: scored as
any other). The engine reports the score and the malformed calls; this module alone decides the
reward from them. What `real` would give is kept in `metadata["reward_real"]`, so a run logs both.

World-model reward (config `algo.world_reward`), what REHEARSE is trained on when mode="world":
per rehearsed response to a call (name, arguments),
  format    F = mean of the terms that apply: parses as a JSON object (F = 0 if not); its keys
            against the tool's documented response keys (`Suite.response_spec`: Jaccard of the key
            sets; 0 for an error object); the fields that echo an argument carry its value
            (fraction). Without a spec: parses + top-level keys named like an argument echo it.
  grounded  G = field F1 against the real response for the same call (rollout/engine/fidelity.py), only
            where one exists (hybrid, or rollout.measure_fidelity): never in a pure rehearse run
            unless the config asks for it.
  r = (w_f F + w_g G) / (w_f + w_g) where G exists, else F; the episode's REHEARSE reward is the
  mean over its rehearsed responses (a rehearsal cut by a limit counts 0). With mode="task",
  REHEARSE gets the episode's task reward instead.
Its advantage then uses its own reward and its own baseline (algo/advantages.py: per task group,
over the episodes that rehearsed); AdvantageConfig.gate_rehearse_on_act zeroes it in groups where
ACT has no signal.

Hybrid ACT strata (`algo.hybrid_baseline: strata`): each hybrid episode is tagged
metadata["stratum"] = "real" (some call executed for real) or "rehearsed" (none), and ACT's
baseline is taken within (task, stratum), so the hybrid_p coin flip does not decide the sign of
ACT's advantage (with one baseline over both strata it would: the strata's rewards differ). A stratum
of one episode has no baseline (advantage 0).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Literal, Sequence

from fastrehearse.data import Episode
from fastrehearse.envs.base import Suite, Task, Trajectory
from fastrehearse.envs.replay import Exchange, exchanges_of
from fastrehearse.kernels.roles import Role

TASK_REWARDS = ("real", "consistent", "calls")
WORLD_MODES = ("task", "world")
HYBRID_BASELINES = ("strata", "pooled")


@dataclass
class WorldRewardConfig:
    """The REHEARSE role's reward (module docstring). Weights mix the format and grounded terms."""
    mode: Literal["task", "world"] = "task"
    format_weight: float = 1.0
    grounded_weight: float = 1.0

    def __post_init__(self) -> None:
        self.validate()
        object.__setattr__(self, "_ready", True)

    def __setattr__(self, key: str, value: Any) -> None:
        # `--set algo.world_reward.format_weight=-1` assigns after construction: check then too.
        super().__setattr__(key, value)
        if getattr(self, "_ready", False):
            self.validate()

    def validate(self) -> None:
        if self.mode not in WORLD_MODES:
            raise ValueError(f"world_reward.mode must be one of {list(WORLD_MODES)}, got {self.mode!r}")
        for k in ("format_weight", "grounded_weight"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"world_reward.{k} must be a finite number >= 0, got {v!r}")
        if self.format_weight <= 0:
            raise ValueError(f"world_reward.format_weight must be > 0 (the format term is the one "
                             f"every rehearsed response has), got {self.format_weight}")


def check_task_reward(suite: Suite | type, mode: str) -> None:
    """Refuse a task reward the suite cannot compute, naming both (before any weights load)."""
    if mode not in TASK_REWARDS:
        raise ValueError(f"env.reward = {mode!r} is not one of {list(TASK_REWARDS)}")
    modes = getattr(suite, "reward_modes", ("real",))
    if mode not in modes:
        raise ValueError(f"env.reward = {mode!r}: suite {getattr(suite, 'name', suite)!r} has only "
                         f"{list(modes)}")


# ---- world-model reward ------------------------------------------------------------------------
def _load(text: str | None) -> Any:
    try:
        return json.loads(text) if isinstance(text, str) else None
    except (ValueError, RecursionError):
        return None


def echo_equal(argument: Any, got: Any) -> bool:
    """An echoed field carries the argument as a tool would: strings case- and space-insensitive,
    numbers to the cent."""
    if isinstance(argument, str):
        return isinstance(got, str) and argument.strip().casefold() == got.strip().casefold()
    if isinstance(argument, (int, float)) and not isinstance(argument, bool):
        return isinstance(got, (int, float)) and not isinstance(got, bool) and math.isfinite(got) \
            and round(float(argument), 2) == round(float(got), 2)
    return argument == got


def format_score(arguments: Any, content: str | None, spec: dict | None) -> float:
    """F in [0, 1] for one rehearsed response (module docstring)."""
    obj = _load(content)
    if not isinstance(obj, dict):
        return 0.0
    args = arguments if isinstance(arguments, dict) else {}
    terms = [1.0]                                   # it parses
    if spec is not None:
        error = "error" in obj
        want, have = set(spec.get("keys", ())), set(obj)
        terms.append(0.0 if error else len(want & have) / max(1, len(want | have)))
        pairs = {out: arg for out, arg in (spec.get("echo") or {}).items() if arg in args}
    else:
        error = False
        pairs = {k: k for k in args if k in obj}
    if pairs:
        terms.append(0.0 if error else sum(echo_equal(args[a], obj.get(o)) for o, a in pairs.items()) / len(pairs))
    return sum(terms) / len(terms)


def call_world_reward(f: float, g: float | None, cfg: WorldRewardConfig) -> float:
    if g is None or cfg.grounded_weight == 0:
        return f
    return (cfg.format_weight * f + cfg.grounded_weight * g) / (cfg.format_weight + cfg.grounded_weight)


@dataclass
class RehearsalScore:
    tool: str
    format: float
    grounded: float | None      # field F1 vs the real response, when one was measured
    reward: float


def score_rehearsals(exchanges: Sequence[Exchange], fidelity: Sequence[dict], cut: int,
                     spec_of: Callable[[str], dict | None], cfg: WorldRewardConfig) -> list[RehearsalScore]:
    """One score per rehearsed response of an episode, in order. `fidelity` is the engine's
    metadata["fidelity"] (one entry per measured rehearsal, in the same order); `cut` rehearsals
    ended by a limit before their response closed score 0."""
    rehearsed = [ex for ex in exchanges if ex.rehearsed is True]
    if fidelity and len(fidelity) != len(rehearsed):
        raise ValueError(f"{len(fidelity)} fidelity entries for {len(rehearsed)} rehearsed responses: the "
                         f"episode's metadata and messages disagree")
    out = []
    for i, ex in enumerate(rehearsed):
        g = None
        if fidelity:
            if fidelity[i].get("tool") != ex.name:
                raise ValueError(f"fidelity entry {i} is for {fidelity[i].get('tool')!r}, the rehearsed "
                                 f"response for {ex.name!r}")
            g = float(fidelity[i]["field_f1"])
        f = format_score(ex.arguments, ex.content, spec_of(ex.name))
        out.append(RehearsalScore(ex.name, f, g, call_world_reward(f, g, cfg)))
    out += [RehearsalScore("<cut>", 0.0, None, 0.0) for _ in range(cut)]
    return out


# ---- per episode -------------------------------------------------------------------------------
def stratum_of(call_log: Sequence[dict]) -> str:
    """"real" when some call of the episode was executed for real, else "rehearsed"."""
    return "real" if any(c.get("mode") == "real" for c in call_log) else "rehearsed"


def assign_rewards(episodes: Sequence[Episode], trajectories: Sequence[Trajectory], tasks: Sequence[Task],
                   suite: Suite, *, task_reward: str = "real", world: WorldRewardConfig | None = None,
                   rollout_mode: str = "rehearse", malformed_reward: float | None = 0.0,
                   hybrid_baseline: str = "strata") -> list[Episode]:
    """The episodes with their training rewards (module docstring), as new episodes: the engine's
    are not changed. `episodes[i]` and `trajectories[i]` are one engine row (RolloutResult order,
    reward = the engine's score); metadata["group"] indexes `tasks`.

    Sets: reward (what ACT trains on), metadata["reward_real"] (what env.reward=real would train
    on), role_rewards[REHEARSE] and metadata["world_reward"] (world mode, episodes that rehearsed),
    metadata["stratum"] (hybrid with strata). An episode with metadata["error"] is returned as it
    came: it could not run or be scored, so it has no reward to decide."""
    world = world or WorldRewardConfig()
    check_task_reward(suite, task_reward)
    if hybrid_baseline not in HYBRID_BASELINES:
        raise ValueError(f"hybrid_baseline must be one of {list(HYBRID_BASELINES)}, got {hybrid_baseline!r}")
    if len(episodes) != len(trajectories):
        raise ValueError(f"{len(episodes)} episodes but {len(trajectories)} trajectories")
    out = []
    for ep, traj in zip(episodes, trajectories):
        meta = ep.metadata
        if "error" in meta:
            out.append(ep)
            continue
        malformed = bool(meta.get("malformed")) and malformed_reward is not None
        real = float(malformed_reward) if malformed else float(ep.reward)
        reward = real
        if task_reward != "real" and not malformed:
            reward = float(suite.task_reward(tasks[meta["group"]], traj, task_reward))
        meta = {**meta, "reward_real": real}
        role_rewards = dict(ep.role_rewards)
        if world.mode == "world" and int(Role.REHEARSE) in ep.roles:
            cut = sum(1 for c in meta.get("calls", ()) if c.get("mode") == "rehearse" and c.get("truncated"))
            scores = score_rehearsals(exchanges_of(traj.messages), meta.get("fidelity") or [], cut,
                                      suite.response_spec, world)
            r = sum(s.reward for s in scores) / len(scores) if scores else 0.0
            role_rewards[int(Role.REHEARSE)] = r
            meta["world_reward"] = {"reward": r, "n": len(scores),
                                    "format": _mean([s.format for s in scores]),
                                    "grounded": _mean([s.grounded for s in scores if s.grounded is not None])}
        if rollout_mode == "hybrid" and hybrid_baseline == "strata":
            meta["stratum"] = stratum_of(meta.get("calls", ()))
        out.append(replace(ep, reward=reward, role_rewards=role_rewards, metadata=meta))
    return out


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def reward_row(episodes: Sequence[Episode]) -> dict:
    """Step metrics: the engine's real-world score beside the trained reward, the world-model reward
    and its terms, the share of episodes per hybrid stratum."""
    row: dict[str, float] = {}
    real = [e.metadata["reward_real"] for e in episodes if "reward_real" in e.metadata]
    if real:
        row["reward_real"] = sum(real) / len(real)
    wr = [e.metadata["world_reward"] for e in episodes if "world_reward" in e.metadata]
    for k in ("reward", "format", "grounded"):
        v = [w[k] for w in wr if w.get(k) is not None]
        if v:
            row[f"world_{k}"] = sum(v) / len(v)
    st = [e.metadata["stratum"] for e in episodes if "stratum" in e.metadata]
    if st:
        row["real_stratum_frac"] = st.count("real") / len(st)
    return row
