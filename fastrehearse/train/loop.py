"""The training loop, top to bottom: (optional) SFT warm-up on gold trajectories, then role-wise GRPO.

One RL step:
  1. rollout   each rank rolls out its share of the step's tasks (group_size samples per task) with
               the rollout mode from the config (rehearse / real / hybrid); failures are counted
  2. gather    every rank gets every episode (small: token ids, roles, log-probs, rewards)
  3. advantages  role-wise GRPO per (task group, role) -- identical on every rank
  4. pack      token-budget rows, the same number of micro-batches on every rank
  5. old log-probs  the rollout's when strictly on-policy (one update per batch), else recomputed;
               reference log-probs when the KL term is on
  6. update    fused policy loss per micro-batch, each role divided by its GLOBAL token count, so
               gradients summed over micro-batches and ranks (FSDP2 SUM reduction) are the full-batch
               gradient at any world size; AdamW, warm-up + cosine, grad-norm clipping; a non-finite
               loss, grad norm or updated weight skips the step (the update is rolled back)
  7. metrics / checkpoint (every K steps and on SIGTERM)

Before any of it, `prepare_run_dir` refuses a run_dir that holds another run (unless --resume or
--overwrite) and, on --resume, a changed setting the checkpoint cannot honour; the suite and its
tasks are built before the model loads, so bad env settings fail in seconds.
"""
from __future__ import annotations

import copy
import math
import os
import random
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import yaml
from torch import nn

from fastrehearse.algo import AdvantageConfig, compute_advantages, local_counts, token_weights
from fastrehearse.data import Episode
from fastrehearse.kernels.roles import NUM_ROLES, Role

from .checkpoint import Checkpointer, full_model_state_dict
from .config import (ConfigError, TrainConfig, dump_config, read_config_dict, resume_changes, to_dict,
                     warnings_for)
from .errors import DiskFullError, TrainingError, disk_full_guard
from .export import export_hf, hf_prefix
from .metrics import MetricsLogger, final_table
from .parallelize import (DistInfo, all_gather_object, all_reduce_sum, broadcast_object,
                          destroy_distributed, init_distributed, parallelize)

__all__ = ["train", "setup", "TrainingError", "DiskFullError", "TrainState", "Run"]

# What a run leaves in run_dir: a run_dir holding any of RUN_FILES holds a run; --overwrite
# removes RUN_OUTPUTS (nothing else).
RUN_FILES = ("config.yaml", "metrics.jsonl", "checkpoints", "export", "summary.json")
RUN_OUTPUTS = RUN_FILES + ("curves.png", "summary.md", "tb", "export.tmp")


@dataclass
class TrainState:
    """Everything besides model/optimizer that a resumed run needs (checkpointed by rank 0)."""
    step: int = 0                  # optimizer steps taken (SFT steps first, then RL steps)
    sft_cursor: int = 0            # gold tasks consumed
    rl_cursor: int = 0             # RL tasks consumed
    consecutive_skips: int = 0
    skipped_steps: int = 0
    rollout_failures: int = 0
    eval_before: dict | None = None
    scheduler: dict = field(default_factory=dict)


@dataclass
class Run:
    """The objects one training run holds (built once by `setup`)."""
    cfg: TrainConfig
    info: DistInfo
    policy: nn.Module              # RehearsalModel (FSDP2-sharded when distributed)
    hf_model: nn.Module            # the transformers model inside `policy`
    gen_model: nn.Module           # what the rollout engine decodes with (unsharded)
    ref: nn.Module | None          # frozen reference for the KL term
    tokenizer: object
    suite: object
    train_tasks: list
    eval_tasks: list
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    state: TrainState
    logger: MetricsLogger
    stop_requested: bool = False
    template: object = None        # ChatTemplate for gold trajectories (built on first use)
    config_text: str = ""          # config.yaml of this run (also stored in each checkpoint)


# ==============================================================================================
# Entry point


def train(cfg: TrainConfig, *, resume: bool = False, overwrite: bool = False) -> dict:
    """Run the whole recipe; returns the summary (also written to run_dir/summary.json).

    resume: continue the latest complete checkpoint in run_dir (docs/training.md says what may
    change); overwrite: replace the run run_dir holds. Without either, a run_dir holding a run is
    refused (ConfigError) before anything is written."""
    info = init_distributed(cfg.device)
    previous = signal.getsignal(signal.SIGTERM)
    try:
        return _train(cfg, info, resume, overwrite)
    finally:
        _restore_sigterm(previous)
        destroy_distributed()


def _train(cfg: TrainConfig, info: DistInfo, resume: bool, overwrite: bool) -> dict:
    t_start = time.perf_counter()
    notes = prepare_run_dir(cfg, info, resume=resume, overwrite=overwrite)
    run = setup(cfg, info)
    if cfg.steps > 0:
        check_prompt_lengths(cfg, run.suite, run.train_tasks, run.tokenizer)
    for n in notes + warnings_for(cfg):
        run.logger.write(n)
    ckpt = Checkpointer(cfg.run_dir, info, keep=cfg.checkpoint.keep)
    resumed_at = None
    if resume:
        had_any = bool(ckpt.complete())
        path, st = ckpt.load_latest(run.policy, run.optimizer, log=run.logger.write)
        if path is None and had_any:
            raise TrainingError(f"--resume: no checkpoint in {ckpt.root} could be loaded (see above); "
                                f"config.yaml and metrics.jsonl were left as they were")
        if path is None:
            run.logger.write(f"--resume: no complete checkpoint in {ckpt.root}; starting from scratch")
        else:
            run.state = TrainState(**st)
            apply_optim_settings(run)
            sync_generation_weights(run)
            resumed_at = run.state.step
            run.logger.write(f"resumed from {path} (step {run.state.step}); lr now "
                             f"{run.scheduler.get_last_lr()[0]:.4g}")
    write_run_config(run, resumed_at)
    _install_sigterm(run)

    if run.state.eval_before is None and cfg.eval.before:
        run.state.eval_before = evaluate(run, tag="before")
    sft_steps, total = cfg.sft.steps, cfg.sft.steps + cfg.steps
    run.logger.set_progress(run.state.step, total=total)

    while run.state.step < total:
        step = run.state.step
        if step < sft_steps:
            row = sft_step(run)
        else:
            if step == sft_steps and sft_steps > 0:
                run.optimizer.state.clear()   # SFT's Adam moments do not describe RL gradients
            row = rl_step(run)
        run.state.step += 1
        run.scheduler.step()
        row.update(step=run.state.step, lr=run.scheduler.get_last_lr()[0])
        run.logger.log(row)
        stop = _agree_to_stop(run)
        every = cfg.checkpoint.every
        if stop or (every and run.state.step >= sft_steps and run.state.step % every == 0):
            save_checkpoint(run, ckpt)
        if stop:
            run.logger.write(f"SIGTERM: checkpoint saved at step {run.state.step}; exiting")
            run.logger.close()
            return {"interrupted": True, "step": run.state.step}

    if cfg.checkpoint.at_end and not (cfg.checkpoint.every and run.state.step % cfg.checkpoint.every == 0
                                      and run.state.step >= sft_steps):
        save_checkpoint(run, ckpt)
    after = evaluate(run, tag="after") if cfg.eval.after else {}
    export_dir = None
    if cfg.checkpoint.export:
        export_dir = export_hf(run.policy, run.hf_model, run.tokenizer, Path(cfg.run_dir) / "export", info)
    summary = _summary(run, after, time.perf_counter() - t_start, export_dir)
    run.logger.close()
    if info.is_main:
        final_table(summary, cfg.run_dir)
    return summary


# ==============================================================================================
# Setup


def prepare_run_dir(cfg: TrainConfig, info: DistInfo, *, resume: bool, overwrite: bool) -> list[str]:
    """Checks on run_dir before anything is written or loaded (rank 0 decides, every rank agrees).

    Without --resume, a run_dir holding a run is refused unless --overwrite (which removes that
    run's outputs). With --resume, the config is compared with the latest checkpoint's: a changed
    key outside config.RESUME_MAY_CHANGE is refused naming it; allowed changes are announced.
    Returns the messages to print."""
    err, notes = None, []
    if info.is_main:
        try:
            notes = _check_run_dir(cfg, resume, overwrite)
        except ConfigError as e:
            err = str(e)
    err, notes = broadcast_object((err, notes), info)
    if err:
        raise ConfigError(err)
    return notes


def _check_run_dir(cfg: TrainConfig, resume: bool, overwrite: bool) -> list[str]:
    run_dir = Path(cfg.run_dir)
    if resume and overwrite:
        raise ConfigError("--resume and --overwrite contradict each other: pick one")
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"run_dir '{run_dir}' exists and is not a directory")
    found = [n for n in RUN_FILES if (run_dir / n).exists()
             and not ((run_dir / n).is_dir() and not any((run_dir / n).iterdir()))]
    if not resume:
        if found and not overwrite:
            raise ConfigError(f"run_dir '{run_dir}' already holds a run ({', '.join(found)}); pass "
                              f"--resume to continue it, --overwrite to replace it, or set another run_dir")
        if found:
            import shutil
            for n in RUN_OUTPUTS:
                q = run_dir / n
                if q.is_dir():
                    shutil.rmtree(q)
                elif q.exists():
                    q.unlink()
            return [f"--overwrite: removed the previous run's {', '.join(found)} from {run_dir}"]
        return []
    latest = Checkpointer(run_dir, DistInfo(0, 1, 0, torch.device("cpu"), None)).latest()
    if latest is None:
        return []
    old = read_config_dict(latest / "config.yaml") or read_config_dict(run_dir / "config.yaml")
    if old is None:
        return [f"--resume: no saved config to compare with in {latest} or {run_dir}; settings not checked"]
    allowed, forbidden = resume_changes(old, to_dict(cfg))
    if forbidden:
        changes = "; ".join(f"'{k}' {a!r} -> {b!r}" for k, a, b in forbidden)
        raise ConfigError(f"--resume cannot change {changes}: {latest.name} was trained with the old "
                          f"value(s). Resume with them, or start a new run_dir (docs/training.md lists "
                          f"what may change on resume)")
    step = int(latest.name.split("_")[1])
    return [f"--resume: '{k}' changed {a!r} -> {b!r} (takes effect from step {step})"
            for k, a, b in allowed]


def write_run_config(run: Run, resumed_at: int | None) -> None:
    """run_dir/config.yaml, written once the run has started (a resume: once the checkpoint loaded).
    A previous config.yaml that differs is kept as config.until_step_XXXXXXXX.yaml."""
    if not run.info.is_main:
        return
    run_dir = Path(run.cfg.run_dir)
    path = run_dir / "config.yaml"
    with disk_full_guard(path):
        if path.exists() and path.read_text() != run.config_text:
            kept = run_dir / f"config.until_step_{resumed_at or 0:08d}.yaml"
            os.replace(path, kept)
            run.logger.write(f"config.yaml changed; the previous one is kept as {kept.name}")
        dump_config(run.cfg, path)


def apply_optim_settings(run: Run) -> None:
    """After a checkpoint loads: the optimizer's hyper-parameters and the LR schedule follow the
    current config from the resumed step on (the checkpoint holds the old ones). With an unchanged
    config this gives the uninterrupted run's lr exactly: LambdaLR computes base_lr * f(step)."""
    o, step = run.cfg.optim, run.state.step
    fn = LRSchedule(run.cfg)
    groups = run.optimizer.param_groups
    for g in groups:
        g.update(initial_lr=o.lr, lr=o.lr * fn(step), betas=tuple(o.betas), eps=o.eps,
                 weight_decay=o.weight_decay)
    run.scheduler.lr_lambdas = [fn] * len(groups)
    run.scheduler.base_lrs = [o.lr] * len(groups)
    run.scheduler.last_epoch = step
    run.scheduler._last_lr = [g["lr"] for g in groups]


def setup(cfg: TrainConfig, info: DistInfo) -> Run:
    _seed_everything(cfg.seed)
    run_dir = Path(cfg.run_dir)
    if info.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
    # The suite and its tasks first: a bad suite option or split fails before the model loads.
    suite, train_tasks, eval_tasks = build_tasks(cfg)
    hf_model, tokenizer = load_policy_model(cfg)
    ref = copy.deepcopy(hf_model).requires_grad_(False) if cfg.algo.loss.kl_coef > 0 else None
    # Rollouts need the whole model on every rank; a sharded model would all-gather per decode
    # step and force every rank to decode in lockstep. So sharded runs keep an unsharded copy for
    # generation (bf16 on GPU) and refresh it after each update (verl does the same with vLLM).
    if info.sharded:
        gen_model = copy.deepcopy(hf_model).requires_grad_(False)
        if info.device.type == "cuda" and cfg.model.precision != "fp32":
            gen_model.to(torch.bfloat16)
        gen_model.to(info.device)
    else:
        gen_model = hf_model

    from fastrehearse.model import RehearsalModel
    check_kernel_backend(cfg, hf_model)
    policy = RehearsalModel(hf_model)
    policy = parallelize(policy, info, precision=cfg.model.precision,
                         activation_checkpointing=cfg.model.activation_checkpointing)
    if ref is not None:
        ref = parallelize(RehearsalModel(ref), info, precision=cfg.model.precision)

    o = cfg.optim
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=o.lr,
                                  betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=LRSchedule(cfg))

    logger = MetricsLogger(run_dir, enabled=info.is_main, total_steps=cfg.sft.steps + cfg.steps,
                           progress=cfg.log.progress, plot_every=cfg.log.plot_every,
                           tensorboard=cfg.log.tensorboard, wandb=cfg.log.wandb,
                           wandb_project=cfg.log.wandb_project, config=to_dict(cfg))
    if info.is_main:
        n_params = sum(p.numel() for p in hf_model.parameters())
        logger.write(f"fastrehearse: {cfg.model.spec} ({n_params / 1e6:.1f}M params) on "
                     f"{cfg.env.suite} | world {info.world_size} ({info.backend or 'single process'}, "
                     f"{info.device}) | {len(train_tasks)} train / {len(eval_tasks)} eval tasks | "
                     f"run_dir {run_dir}")
    return Run(cfg, info, policy, hf_model, gen_model, ref, tokenizer, suite, train_tasks, eval_tasks,
               optimizer, scheduler, TrainState(), logger,
               config_text=yaml.safe_dump(to_dict(cfg), sort_keys=False))


def check_kernel_backend(cfg: TrainConfig, hf_model) -> None:
    """model.kernel_backend 'triton-fused' cannot apply an LM-head bias or soft-cap: refused once
    the model's head is known, before any rollout (a ConfigError naming the key and the head)."""
    if cfg.model.kernel_backend != "triton-fused":
        return
    from fastrehearse.kernels._common import check_fused_forward
    from fastrehearse.kernels._head import build_head
    from fastrehearse.model import head_kwargs
    kw = head_kwargs(hf_model)
    head, _ = build_head(kw.get("bias"), kw.get("logit_softcap"), kw.get("logit_scale"),
                         hf_model.get_output_embeddings().weight, 1.0)
    try:
        check_fused_forward("triton-fused", head)
    except ValueError as e:
        raise ConfigError(f"config key 'model.kernel_backend' = 'triton-fused' with model "
                          f"{cfg.model.spec!r}: {e}") from None


def build_tasks(cfg: TrainConfig):
    """(suite, train tasks, eval tasks); a bad option or split, or an empty split, is a ConfigError
    naming the key."""
    from fastrehearse.envs import get_suite

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
    if not tasks["env.train_split"]:
        raise ConfigError(f"config key 'env.train_split' = {cfg.env.train_split!r}: suite "
                          f"{cfg.env.suite!r} has no tasks in it")
    return suite, tasks["env.train_split"], tasks["env.eval_split"]


def check_prompt_lengths(cfg: TrainConfig, suite, tasks: list, tokenizer, sample: int = 16) -> None:
    """A prompt that fills rollout.max_episode_tokens leaves nothing to generate: refuse when every
    sampled task's prompt does, warn when some do."""
    from fastrehearse.rollout.template import ChatTemplate
    tmpl = ChatTemplate(tokenizer)
    budget = cfg.rollout.max_episode_tokens
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
        return
    msg = (f"{len(over)} of the first {len(lens)} train prompts are {min(over)}-{max(over)} tokens, "
           f">= rollout.max_episode_tokens={budget}: nothing would be generated or trained for them")
    if len(over) == len(lens):
        raise ConfigError(f"config key 'rollout.max_episode_tokens': {msg}; raise it above {max(over)}")
    print(f"[fastrehearse] warning: {msg}", flush=True)


def load_policy_model(cfg: TrainConfig):
    """(model, tokenizer) in fp32 (FSDP2 keeps fp32 master weights; bf16 is a compute cast).

    A spec that cannot load fails with a ConfigError naming the path (files are checked before
    any weights are read); model.options are a tiny-* model's sizes."""
    from fastrehearse import model as fm
    from fastrehearse.model.loader import ModelSpecError
    try:
        return fm.load_model(cfg.model.spec, dtype=torch.float32, seed=cfg.seed, options=cfg.model.options)
    except ModelSpecError as e:
        raise ConfigError(f"{e} (config key 'model.spec')") from None


class LRSchedule:
    """Multiplier of optim.lr at optimizer step s (a class, so the scheduler state pickles).

    SFT steps: linear warm-up to sft.lr then constant. RL steps: linear warm-up over
    optim.warmup_steps, then cosine from optim.lr down to optim.lr * min_lr_ratio.
    """

    def __init__(self, cfg: TrainConfig):
        self.sft_steps, self.sft_warm = cfg.sft.steps, cfg.sft.warmup_steps
        self.sft_scale = cfg.sft.lr / cfg.optim.lr if cfg.optim.lr > 0 else 0.0
        self.steps, self.warm, self.floor = cfg.steps, cfg.optim.warmup_steps, cfg.optim.min_lr_ratio

    def __call__(self, s: int) -> float:
        if s < self.sft_steps:
            return self.sft_scale * min(1.0, (s + 1) / max(1, self.sft_warm))
        s -= self.sft_steps
        if s < self.warm:
            return (s + 1) / self.warm
        span = max(1, self.steps - self.warm)
        progress = min(1.0, (s - self.warm) / span)
        return self.floor + (1 - self.floor) * 0.5 * (1 + math.cos(math.pi * progress))


# ==============================================================================================
# One RL step


def rl_step(run: Run) -> dict:
    cfg, info, st = run.cfg, run.info, run.state
    # 1. rollout: this rank's share of the step's tasks
    tasks = _next_tasks(run.train_tasks, st.rl_cursor, cfg.rollout.tasks_per_step, cfg.seed)
    st.rl_cursor += cfg.rollout.tasks_per_step
    mine = tasks[info.rank::info.world_size]
    t0 = time.perf_counter()
    episodes, rmetrics, failures = rollout(run, mine, mode=cfg.rollout.mode,
                                           temperature=cfg.rollout.temperature,
                                           seed=_step_seed(cfg.seed, st.step, info.rank),
                                           group_size=cfg.rollout.group_size,
                                           measure_fidelity=cfg.rollout.measure_fidelity)
    rollout_s = time.perf_counter() - t0
    # 2. gather: every rank sees every episode (rank order, deterministic)
    gathered = all_gather_object(([_slim(e) for e in episodes], rmetrics, failures), info)
    episodes = [e for eps, _, _ in gathered for e in eps]
    failures = sum(f for _, _, f in gathered)
    st.rollout_failures += failures
    row = {"stage": "rl", "rollout_failures": failures, "rollout_s": round(rollout_s, 3)}
    row.update(_rollout_row(episodes, [m for _, m, _ in gathered], rollout_s))
    if len(episodes) < info.world_size:   # packing needs one episode per rank
        return _skip(run, row, reason=f"only {len(episodes)} episodes for {info.world_size} ranks "
                                      f"({failures} rollout failures)")
    # 3. role-wise GRPO advantages (groups = task ids)
    a = cfg.algo
    adv = compute_advantages(episodes, AdvantageConfig(std_normalize=a.std_normalize,
                                                       leave_one_out=a.leave_one_out,
                                                       turn_reward_coef=a.turn_reward_coef))
    # The algo counts equal-reward groups of 2+; a group of one (group_size 1, or a task whose other
    # samples failed) has no baseline either, so it carries no signal too.
    sizes = {}
    for e in episodes:
        sizes[e.task_id] = sizes.get(e.task_id, 0) + 1
    singles = sum(1 for n in sizes.values() if n == 1) / max(len(sizes), 1)
    row["zero_signal_groups"] = adv.zero_std_frac.get("ACT", 0.0) + singles
    # 4-6. pack, old/ref log-probs, update
    row.update(policy_update(run, episodes, stage="rl"))
    sync_generation_weights(run)
    return row


def policy_update(run: Run, episodes: list[Episode], *, stage: str) -> dict:
    """Pack `episodes` (the same global list on every rank), then `updates_per_batch` optimizer
    steps of the fused role-wise loss (stage "rl") or of masked CE (stage "sft")."""
    cfg, info = run.cfg, run.info
    from fastrehearse.packing import pack
    packed = pack(episodes, cfg.max_tokens, num_ranks=info.world_size, overlong="truncate_right")
    batches = [b.to(info.device) for b in (packed[info.rank] if info.distributed else packed)]
    counts = all_reduce_sum(local_counts(batches), info)            # [2, NUM_ROLES] global
    n_tokens = int(all_reduce_sum(torch.tensor([float(sum(b.num_tokens for b in batches))],
                                                dtype=torch.float64), info).item())
    weights = None
    if stage == "rl" and cfg.algo.aggregation != "token-mean":
        weights = token_weights(batches, cfg.algo.aggregation, counts,
                                norm_len=cfg.algo.norm_len or cfg.rollout.max_episode_tokens)
    if stage == "rl":
        _fill_old_and_ref_logp(run, batches)
        bad = sum(int((~torch.isfinite(b.old_logp)).sum()) for b in batches)
        if run.ref is not None:
            bad += sum(int((~torch.isfinite(b.ref_logp)).sum()) for b in batches)
        if all_reduce_sum(torch.tensor([float(bad)], dtype=torch.float64), info).item() > 0:
            return _skip(run, {"train_tokens": n_tokens}, reason=f"{bad} non-finite old/reference log-probs")

    out = {}
    t0 = time.perf_counter()
    for _ in range(cfg.algo.updates_per_batch if stage == "rl" else 1):
        out = _one_update(run, batches, counts, weights, stage)
    dt = time.perf_counter() - t0
    out.update(train_tokens=n_tokens, train_s=round(dt, 3),
               tokens_per_s=n_tokens * (cfg.algo.updates_per_batch if stage == "rl" else 1) / dt)
    for r in (Role.ACT, Role.REHEARSE, Role.OBSERVED):
        out[f"tokens_{r.name.lower()}"] = int(counts[0, int(r)].item())
    return out


def _one_update(run: Run, batches, counts, weights, stage: str) -> dict:
    cfg, info = run.cfg, run.info
    run.policy.train()
    run.optimizer.zero_grad(set_to_none=True)
    loss_sum = torch.zeros((), dtype=torch.float64)
    stats = _LossStats()
    for i, b in enumerate(batches):
        if stage == "rl":
            head = _rl_head(cfg, b, counts[0], None if weights is None else weights[i])
        else:
            head = _sft_head(cfg, b, counts[0])
        res = run.policy(b, head)
        res.loss.backward()
        loss_sum += res.loss.detach().double().cpu()
        stats.add(res)
    loss = float(all_reduce_sum(loss_sum.reshape(1), info).item())
    grad_norm = _clip_grad_norm(run.policy, cfg.optim.grad_clip)
    row = {"loss": loss, "grad_norm": grad_norm, **stats.summary(info)}
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        run.optimizer.zero_grad(set_to_none=True)
        return _skip(run, row, reason=f"non-finite loss {loss} / grad norm {grad_norm}")
    snap = _snapshot(run) if cfg.optim.rollback_nonfinite else None
    try:
        run.optimizer.step()
        bad = sum(int(not bool(torch.isfinite(_local(p)).all())) for p in run.policy.parameters())
    except RuntimeError as e:   # AdamW's step size beyond float32 ("... without overflow")
        if "overflow" not in str(e):
            raise
        bad = 1
    if all_reduce_sum(torch.tensor([float(bad)], dtype=torch.float64), info).item() > 0:
        run.optimizer.zero_grad(set_to_none=True)
        if snap is None:
            raise TrainingError(f"step {run.state.step + 1}: the update left non-finite weights and "
                                f"optim.rollback_nonfinite is off; stopping (lower optim.lr)")
        _restore(run, snap)
        return _skip(run, row, reason=f"the update left non-finite weights (lr {run.optimizer.param_groups[0]['lr']:.3g}); rolled back")
    run.state.consecutive_skips = 0
    return row


def _local(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t.to_local() if hasattr(t, "to_local") else t


def _snapshot(run: Run):
    """Copies of this rank's parameter shards and optimizer state, to undo one optimizer step."""
    params = [p for g in run.optimizer.param_groups for p in g["params"]]
    saved = []
    for p in params:
        st = run.optimizer.state.get(p)
        saved.append((_local(p).clone(),
                      None if st is None else {k: (_local(v).clone() if torch.is_tensor(v) else copy.deepcopy(v))
                                               for k, v in st.items()}))
    return params, saved


@torch.no_grad()
def _restore(run: Run, snap) -> None:
    params, saved = snap
    for p, (value, st) in zip(params, saved):
        _local(p).copy_(value)
        if st is None:
            run.optimizer.state.pop(p, None)
            continue
        cur = run.optimizer.state[p]
        for k, v in st.items():
            if torch.is_tensor(v) and torch.is_tensor(cur.get(k)):
                _local(cur[k]).copy_(v)
            else:
                cur[k] = v


def _skip(run: Run, row: dict, reason: str) -> dict:
    st = run.state
    st.consecutive_skips += 1
    st.skipped_steps += 1
    run.logger.write(f"step {st.step + 1} skipped ({reason}); {st.consecutive_skips} in a row")
    if st.consecutive_skips >= run.cfg.max_consecutive_skips:
        ckpt = Checkpointer(run.cfg.run_dir, run.info).latest()
        raise TrainingError(f"{st.consecutive_skips} consecutive steps skipped (last: {reason}); "
                            f"stopping (max_consecutive_skips={run.cfg.max_consecutive_skips}). "
                            f"Lower optim.lr or check the data. Last complete checkpoint: {ckpt}")
    return {**row, "skipped": 1}


def _rl_head(cfg: TrainConfig, b, token_counts, w):
    """The loss head run inside the (sharded) module's forward, where the LM-head weight is whole.
    cfg.algo.loss is the kernel's PolicyLossConfig (temperature resolved by config.validate)."""
    from fastrehearse.kernels import linear_policy_loss
    pcfg = cfg.algo.loss

    def head(hidden, weight, **head_kw):   # head_kw: the model's LM-head settings (bias, soft-cap, scale)
        kw = {"ref_logp": b.ref_logp, "backend": cfg.model.kernel_backend, **head_kw}
        if w is None:
            kw["normalizers"] = token_counts.to(hidden.device)
        else:
            kw["token_weights"] = w
        return linear_policy_loss(hidden, weight, b.targets, b.roles, b.advantages, b.old_logp, pcfg, **kw)
    return head


@dataclass
class _CE:
    loss: torch.Tensor
    logp: torch.Tensor
    roles: torch.Tensor
    metrics: dict = field(default_factory=dict)


def _sft_head(cfg: TrainConfig, b, token_counts):
    """Masked CE on ACT (w_act) and OBSERVED (w_observed) tokens, each role divided by its global
    token count: loss = sum_r w_r / N_r * sum_{t in r} -log p(t)."""
    from fastrehearse.kernels import linear_logprobs
    w_role = torch.zeros(NUM_ROLES, dtype=torch.float64)
    w_role[int(Role.ACT)] = cfg.sft.w_act
    w_role[int(Role.OBSERVED)] = cfg.sft.w_observed
    scale = torch.where(token_counts > 0, w_role / token_counts.clamp_min(1), torch.zeros_like(w_role))

    def head(hidden, weight, **head_kw):
        mask = scale.to(b.roles.device)[b.roles] > 0
        logp, _ = linear_logprobs(hidden, weight, b.targets, mask=mask,
                                  backend=cfg.model.kernel_backend, **head_kw)
        c = scale.to(hidden.device, torch.float32)[b.roles]
        return _CE(loss=-(logp * c).sum(), logp=logp.detach(), roles=b.roles)
    return head


def _fill_old_and_ref_logp(run: Run, batches) -> None:
    """old_logp: the rollout's own log-probs when strictly on-policy (one update per batch and every
    sampled token has one), else one no-grad forward of the current policy. ref_logp when KL is on.
    Tokens that were not sampled (OBSERVED, CONTEXT) have no behaviour log-prob (NaN from the
    rollout); they use no ratio, so they get 0."""
    cfg = run.cfg
    for b in batches:
        sampled = (b.roles == int(Role.ACT)) | (b.roles == int(Role.REHEARSE))
        b.old_logp = torch.where(sampled, b.old_logp, torch.zeros_like(b.old_logp))
    reuse = cfg.algo.updates_per_batch == 1 and all(bool(torch.isfinite(b.old_logp).all()) for b in batches)
    if not reuse:
        for b, lp in zip(batches, compute_logprobs(run.policy, batches, cfg)):
            sampled = (b.roles == int(Role.ACT)) | (b.roles == int(Role.REHEARSE))
            b.old_logp = torch.where(sampled, lp, torch.zeros_like(lp))
    if run.ref is not None:
        for b, lp in zip(batches, compute_logprobs(run.ref, batches, cfg)):
            b.ref_logp = lp


@torch.no_grad()
def compute_logprobs(module: nn.Module, batches, cfg: TrainConfig) -> list[torch.Tensor]:
    """[T] log-prob of every loss-bearing target under `module` (0 elsewhere), no grad."""
    from fastrehearse.kernels import linear_logprobs
    temp = cfg.algo.loss.temperature   # == rollout.temperature (1.0 when greedy); config.validate
    module.eval()
    out = []
    for b in batches:
        out.append(module(b, lambda h, w, **head_kw: linear_logprobs(
            h, w, b.targets, mask=b.roles != 0, temperature=temp,
            backend=cfg.model.kernel_backend, **head_kw)[0]).float())
    return out


def _clip_grad_norm(model: nn.Module, max_norm: float) -> float:
    """Global grad norm (DTensor-aware, as torchtitan) and clipping; returns the pre-clip norm."""
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return 0.0
    norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    if max_norm > 0 and torch.isfinite(norm):
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return float(norm)


class _LossStats:
    """The kernel's per-role metrics over micro-batches and ranks: token-weighted means (ratio,
    clip fraction, KL, entropy, NLL) and sums (each role's share of the loss)."""

    def __init__(self):
        self.sums: dict[str, float] = {}

    def _add(self, key: str, v: float) -> None:
        self.sums[key] = self.sums.get(key, 0.0) + v

    def add(self, res) -> None:
        for role, d in (getattr(res, "metrics", None) or {}).items():
            n = float(d.get("tokens", 0) or 0)
            if n <= 0:
                continue
            self._add(f"{role}/n", n)
            for k, v in d.items():
                if k == "tokens" or not isinstance(v, (int, float)) or not math.isfinite(v):
                    continue
                self._add(f"{role}/{k}", float(v) if k == "loss" else float(v) * n)

    def summary(self, info: DistInfo) -> dict:
        keys = sorted(set().union(*all_gather_object(sorted(self.sums), info)))
        if not keys:
            return {}
        vals = all_reduce_sum(torch.tensor([self.sums.get(k, 0.0) for k in keys], dtype=torch.float64), info)
        tot = dict(zip(keys, vals.tolist()))
        out = {}
        for k, v in tot.items():
            role, name = k.split("/", 1)
            if name == "loss":
                out[f"{role}_loss"] = v
            elif name != "n" and tot.get(f"{role}/n", 0) > 0:
                out[f"{role}_{name}"] = v / tot[f"{role}/n"]
        return out


# ==============================================================================================
# SFT warm-up on gold trajectories


def sft_step(run: Run) -> dict:
    """One CE step on gold trajectories (every rank builds the same global list; packing splits
    it). Gold tool responses are real ones: role OBSERVED, the world model's supervised target."""
    cfg = run.cfg
    gold = [t for t in run.train_tasks if t.gold]
    if not gold:
        raise ValueError(f"sft.steps={cfg.sft.steps} but no task of split {cfg.env.train_split!r} has a "
                         f"gold trajectory")
    tasks = _next_tasks(gold, run.state.sft_cursor, cfg.sft.tasks_per_step, cfg.seed + 1)
    run.state.sft_cursor += cfg.sft.tasks_per_step
    episodes = [gold_episode(run, t) for t in tasks]
    row = {"stage": "sft"}
    row.update(policy_update(run, episodes, stage="sft"))
    sync_generation_weights(run)
    return row


def gold_episode(run: Run, task) -> Episode:
    """A gold trajectory rendered as role-tagged tokens (tool responses OBSERVED)."""
    from fastrehearse.rollout.template import ChatTemplate
    if run.template is None:
        run.template = ChatTemplate(run.tokenizer)
    tmpl = run.template
    env = run.suite.make_env()
    try:
        reset = env.reset(task)
    finally:
        env.close()
    r = tmpl.render(list(reset.messages) + list(task.gold), reset.tools, tool_roles=Role.OBSERVED)
    roles = _tag_turn_ends(tmpl, r)
    n = run.cfg.rollout.max_episode_tokens
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


# ==============================================================================================
# Rollout and evaluation


def rollout(run: Run, tasks, *, mode: str, temperature: float, seed: int, group_size: int,
            measure_fidelity: bool) -> tuple[list[Episode], dict, int]:
    """Episodes for `tasks` on this rank. An engine exception on the batch is retried task by task;
    tasks that still fail are counted (not fatal)."""
    if not tasks:
        return [], {}, 0
    from fastrehearse.rollout.engine import RolloutEngine
    ecfg = run.cfg.rollout.engine(mode=mode, measure_fidelity=measure_fidelity, temperature=temperature)
    engine = RolloutEngine(run.gen_model, run.tokenizer, ecfg)
    run.gen_model.eval()
    try:
        res = engine.rollout(tasks, run.suite, group_size=group_size, seed=seed)
        return res.episodes, res.metrics, 0
    except Exception as e:  # noqa: BLE001 - any engine bug: isolate the failing task(s)
        run.logger.write(f"rollout failed on a batch of {len(tasks)} tasks ({type(e).__name__}: {e}); "
                         f"retrying one task at a time")
    episodes, metrics, failures = [], {}, 0
    for i, t in enumerate(tasks):
        try:
            res = engine.rollout([t], run.suite, group_size=group_size, seed=seed * 1000 + i)
            episodes += res.episodes
            metrics = res.metrics
        except Exception as e:  # noqa: BLE001
            failures += 1
            run.logger.write(f"rollout failed for task {t.id}: {type(e).__name__}: {e}")
    return episodes, metrics, failures


def evaluate(run: Run, *, tag: str) -> dict:
    """Held-out success (eval.mode, greedy by default) and world-model fidelity, over all ranks,
    computed by the evaluation code of `fastrehearse eval` (fastrehearse.eval.runner): the same
    checkpoint, items, limits and seed give the same per-item numbers as
    `fastrehearse eval --max-steps <rollout.max_turns> --max-new-tokens <rollout.max_new_tokens>
    --max-episode-tokens <rollout.max_episode_tokens> --seed <seed>`. A task that could not run is
    an error, never a 0; when none could run the eval (and the run) stops with TrainingError."""
    from fastrehearse.eval.runner import EvalSettings, MemoryStore, evaluate_items
    from fastrehearse.rollout.policy import ModelPolicy

    cfg, info = run.cfg, run.info
    if not run.eval_tasks:
        return {}
    mine = run.eval_tasks[info.rank::info.world_size]
    t0 = time.perf_counter()
    rc = cfg.rollout
    settings = EvalSettings(
        max_turns=rc.max_turns, max_new_tokens=rc.max_new_tokens, max_episode_tokens=rc.max_episode_tokens,
        temperature=cfg.eval.temperature, top_p=rc.top_p, mode=cfg.eval.mode, batch_size=rc.max_batch_size,
        seed=cfg.seed, fidelity=cfg.eval.fidelity,
        engine_options={k: getattr(rc, k) for k in ("hybrid_p", "parallel_tool_calls", "on_malformed",
                                                    "max_chunk", "rehearsal")})
    run.gen_model.eval()
    store = MemoryStore()
    evaluate_items([(cfg.env.eval_split, t) for t in mine], lambda c: run.suite.make_env(), run.gen_model,
                   run.tokenizer, ModelPolicy(), store, settings)
    local = [(r.score, r.error, (r.fidelity or {}).get("field_f1"), int((r.fidelity or {}).get("calls", 0)))
             for r in store.items()]
    rows = [x for part in all_gather_object(local, info) for x in part]
    scores = [s for s, e, _, _ in rows if e is None]
    errors = [e for _, e, _, _ in rows if e is not None]
    calls = sum(c for s, e, f, c in rows if e is None and f is not None)
    f1 = sum(f * c for s, e, f, c in rows if e is None and f is not None)
    out = {"success": sum(scores) / len(scores) if scores else float("nan"), "n": len(scores),
           "errors": len(errors), "fidelity": f1 / calls if calls else float("nan"), "fidelity_n": calls,
           "seconds": round(time.perf_counter() - t0, 2)}
    if not scores:
        raise TrainingError(f"eval {tag}: none of the {len(rows)} held-out tasks could run "
                            f"(first error: {errors[0] if errors else 'none'})")
    run.logger.write(f"eval {tag}: success {out['success']:.3f} on {out['n']} held-out tasks, "
                     f"fidelity {out['fidelity']:.3f} ({out['fidelity_n']} rehearsed calls)"
                     + (f"; {len(errors)} task(s) could not run (not scored): {errors[0]}" if errors else ""))
    return out


# ==============================================================================================
# Helpers


def sync_generation_weights(run: Run) -> None:
    """Copy the updated weights into the unsharded generation model (distributed runs only)."""
    if run.gen_model is run.hf_model:
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    sd = get_model_state_dict(run.policy, options=StateDictOptions(full_state_dict=True))
    prefix = hf_prefix(run.policy, run.hf_model)
    sd = {k[len(prefix):].replace("_checkpoint_wrapped_module.", ""): v for k, v in sd.items()
          if k.startswith(prefix)}
    run.gen_model.load_state_dict(sd, strict=False)


def save_checkpoint(run: Run, ckpt: Checkpointer) -> None:
    run.state.scheduler = run.scheduler.state_dict()
    state = {k: getattr(run.state, k) for k in TrainState.__dataclass_fields__}
    path = ckpt.save(run.state.step, run.policy, run.optimizer, state, config_text=run.config_text)
    run.logger.write(f"checkpoint: {path}")


def _next_tasks(tasks: list, cursor: int, n: int, seed: int) -> list:
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


def _step_seed(seed: int, step: int, rank: int) -> int:
    return (seed * 1_000_003 + step * 9_973 + rank * 31) % (2**31)


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def _slim(ep: Episode) -> Episode:
    """Drop heavy metadata (trajectories) before sending episodes to other ranks."""
    keep = {k: ep.metadata[k] for k in ("group", "sample", "stop_reason", "turns", "malformed", "fidelity")
            if k in ep.metadata}
    return Episode(input_ids=ep.input_ids, roles=ep.roles, task_id=ep.task_id, reward=ep.reward,
                   rollout_logprobs=ep.rollout_logprobs, role_rewards=dict(ep.role_rewards), metadata=keep)


def _rollout_row(episodes: list[Episode], metrics: list[dict], rollout_s: float) -> dict:
    row = {"episodes": len(episodes)}
    if episodes:
        row["reward"] = sum(e.reward for e in episodes) / len(episodes)
        row["episode_tokens"] = sum(len(e) for e in episodes) / len(episodes)
        row["malformed_frac"] = sum(1 for e in episodes if e.metadata.get("malformed")) / len(episodes)
    fid = [s["field_f1"] for e in episodes for s in e.metadata.get("fidelity", [])]
    if fid:
        row["fidelity"] = sum(fid) / len(fid)
    tok = sum(m.get("prefill_tokens", 0) + m.get("decode_tokens", 0) for m in metrics if m)
    if rollout_s > 0 and tok:
        row["rollout_tokens_per_s"] = tok / rollout_s
    return row


def _install_sigterm(run: Run) -> None:
    def handler(signum, frame):
        run.stop_requested = True
    try:
        signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread (e.g. called from a worker thread in tests)
        pass


def _restore_sigterm(previous) -> None:
    try:
        signal.signal(signal.SIGTERM, previous)
    except (ValueError, TypeError):
        pass


def _agree_to_stop(run: Run) -> bool:
    """All ranks stop together when any of them got SIGTERM."""
    flag = torch.tensor([1.0 if run.stop_requested else 0.0], dtype=torch.float64)
    return bool(all_reduce_sum(flag, run.info).item() > 0)


def _summary(run: Run, after: dict, wall_s: float, export_dir) -> dict:
    before = run.state.eval_before or {}
    rows = [r for r in run.logger.rows if r.get("stage") == "rl"] if run.info.is_main else []
    tps = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r]
    rtps = [r["rollout_tokens_per_s"] for r in rows if "rollout_tokens_per_s" in r]
    return {
        "model": run.cfg.model.spec, "suite": run.cfg.env.suite,
        "n_eval": after.get("n", before.get("n")),
        "success_before": before.get("success"), "success_after": after.get("success"),
        "fidelity_before": before.get("fidelity"), "fidelity_after": after.get("fidelity"),
        "train_tokens_per_s": float(np.median(tps)) if tps else None,
        "rollout_tokens_per_s": float(np.median(rtps)) if rtps else None,
        "wall_s": wall_s, "steps": run.state.step, "skipped_steps": run.state.skipped_steps,
        "rollout_failures": run.state.rollout_failures, "world_size": run.info.world_size,
        "export_dir": str(export_dir) if export_dir else None,
    }
