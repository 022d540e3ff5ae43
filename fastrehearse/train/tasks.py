"""Tasks for a run: the suite and its splits, the endless seeded task stream (resumable by cursor),
per-step seeds, and gold trajectories rendered as role-tagged episodes for the SFT warm-up."""
from __future__ import annotations

import torch

from fastrehearse.data import Episode
from fastrehearse.envs import get_suite
from fastrehearse.kernels.roles import Role
from fastrehearse.rollout.text.gold import render_gold
from fastrehearse.rollout.text.template import ChatTemplate

from .config import ConfigError, TrainConfig
from .state import Run


def build_tasks(cfg: TrainConfig):
    """(suite, train tasks, eval tasks); a bad option or split, or an empty split, is a ConfigError
    naming the key."""

    def msg(e):
        return e.args[0] if isinstance(e, KeyError) and e.args else e
    try:
        suite = get_suite(cfg.env.suite, **cfg.env.options)
    except (ValueError, TypeError, KeyError, ImportError) as e:
        raise ConfigError(f"config key 'env.options' (suite {cfg.env.suite!r}): {msg(e)}") from None
    tasks = {}
    for key, split, limit in (("env.train_split", cfg.env.train_split, cfg.env.max_train_tasks),
                              ("env.eval_split", cfg.env.eval_split, cfg.eval.num_tasks)):
        if key == "env.eval_split" and not cfg.eval.num_tasks:
            tasks[key] = []
            continue
        try:
            tasks[key] = suite.tasks(split, limit=limit)
        except (ValueError, KeyError) as e:
            raise ConfigError(f"config key '{key}' = {split!r}: {msg(e)}") from None
    try:
        suite.check_reward(cfg.env.reward, tasks["env.train_split"])
    except ValueError as e:
        raise ConfigError(f"config key 'env.reward' = {cfg.env.reward!r}: {e}") from None
    if not tasks["env.train_split"]:
        raise ConfigError(f"config key 'env.train_split' = {cfg.env.train_split!r}: suite "
                          f"{cfg.env.suite!r} has no tasks in it")
    if cfg.sft.steps > 0 and cfg.sft.source == "gold" and not any(t.gold for t in tasks["env.train_split"]):
        raise ConfigError(f"config key 'sft.steps' = {cfg.sft.steps}: no task of env.train_split "
                          f"{cfg.env.train_split!r} has a gold trajectory to warm up on (set sft.steps=0)")
    return suite, tasks["env.train_split"], tasks["env.eval_split"]


def check_prompt_lengths(cfg: TrainConfig, suite, tasks: list, tokenizer, sample: int = 16) -> list[str]:
    """A prompt that fills rollout.max_episode_tokens leaves nothing to generate: refuse when every
    sampled task's prompt does; returns the warning to log when some do."""
    tmpl = ChatTemplate(tokenizer)
    budget = cfg.rollout.engine.max_episode_tokens
    lens = []
    for t in tasks[:sample]:
        env = suite.make_env()
        try:
            reset = env.reset(t)
        finally:
            env.close()
        lens.append(len(tmpl.render(list(reset.messages), reset.tools, add_generation_prompt=True).input_ids))
    over = [n for n in lens if n >= budget]
    if not over:
        return []
    msg = (f"{len(over)} of the first {len(lens)} train prompts are {min(over)}-{max(over)} tokens, "
           f">= rollout.max_episode_tokens={budget}: nothing would be generated or trained for them")
    if len(over) == len(lens):
        raise ConfigError(f"config key 'rollout.max_episode_tokens': {msg}; raise it above {max(over)}")
    return [f"warning: {msg}"]



def gold_episode(run: Run, task) -> Episode:
    """A gold trajectory rendered as role-tagged tokens (tool responses OBSERVED; each turn's end
    marker trained with its turn)."""
    if run.template is None:
        run.template = ChatTemplate(run.tokenizer)
    tmpl = run.template
    r = render_gold(tmpl, run.suite, task).rendered
    roles = _tag_turn_ends(tmpl, r)
    n = run.cfg.rollout.engine.max_episode_tokens
    return Episode(input_ids=r.input_ids[:n], roles=roles[:n], task_id=task.id, reward=1.0)


def _tag_turn_ends(tmpl, rendered) -> list[int]:
    """Give each turn's end marker the role of the turn.

    The template renders `<|im_end|>` (or `</tool_response>`) as scaffolding (CONTEXT), but in a
    rollout the model itself samples it to end its turn: it is an ACT (or REHEARSE) token there.
    Supervising gold trajectories without it would never teach the model to stop. So the
    scaffolding prefix up to and including the end marker after an ACT / OBSERVED content span
    takes that span's role.
    """
    roles = list(rendered.roles)
    ids, spans = rendered.input_ids, rendered.spans
    dec = tmpl.tokenizer.decode
    for (s0, e0, role, _), (s1, e1, role1, mi1) in zip(spans, spans[1:]):
        if role not in (int(Role.ACT), int(Role.OBSERVED)) or role1 != int(Role.CONTEXT) or mi1 != -1:
            continue
        markers = tmpl.assistant_end_markers if role == int(Role.ACT) else tmpl.tool_end_markers
        for k in range(1, e1 - s1 + 1):
            if any(m in dec(ids[s1:s1 + k]) for m in markers):
                roles[s1:s1 + k] = [role] * k
                break
    return roles



def next_tasks(tasks: list, cursor: int, n: int, seed: int) -> list:
    """Tasks [cursor, cursor + n) of an endless stream: one seeded permutation per epoch."""
    out = []
    for k in range(cursor, cursor + n):
        epoch, i = divmod(k, len(tasks))
        perm = _perm(len(tasks), seed, epoch)
        out.append(tasks[perm[i]])
    return out


_PERMS: dict = {}


def _perm(n: int, seed: int, epoch: int) -> list[int]:
    key = (n, seed, epoch)
    if key not in _PERMS:
        g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        _PERMS[key] = torch.randperm(n, generator=g).tolist()
    return _PERMS[key]


def step_seed(seed: int, step: int, rank: int) -> int:
    return (seed * 1_000_003 + step * 9_973 + rank * 31) % (2**31)


