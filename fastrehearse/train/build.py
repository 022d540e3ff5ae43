"""Building a run: the model (policy, reference, generation copy), its checks, the optimizer and the
LR schedule, the logger -- everything `setup` returns as a `Run`."""
from __future__ import annotations

import math
import random
from pathlib import Path

import numpy as np
import torch
import yaml

from fastrehearse.kernels import check_backend
from fastrehearse.model import head_kwargs

from .config import ConfigError, TrainConfig, to_dict
from .metrics import MetricsLogger
from .model_init import build_generation_model, build_policy, build_reference
from .parallelize import DistInfo
from .state import Run, TrainState
from .tasks import build_tasks


def apply_optim_settings(run: Run) -> None:
    """After a checkpoint loads: the optimizer's hyper-parameters and the LR schedule follow the
    current config from the resumed step on (the checkpoint holds the old ones). With an unchanged
    config this gives the uninterrupted run's lr exactly: LambdaLR computes base_lr * f(step)."""
    o, step = run.cfg.optim, run.state.step
    fn = LRSchedule(run.cfg)
    groups = run.optimizer.param_groups
    for g in groups:
        g.update(initial_lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
    # A scheduler resumed at `step` (LambdaLR's own resume path: last_epoch = step - 1, then its
    # initial step sets every group's lr to initial_lr * fn(step)).
    run.scheduler = torch.optim.lr_scheduler.LambdaLR(run.optimizer, lr_lambda=fn, last_epoch=step - 1)


def setup(cfg: TrainConfig, info: DistInfo) -> Run:
    seed_everything(cfg.seed)
    run_dir = Path(cfg.run_dir)
    if info.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
    # The suite and its tasks first: a bad suite option or split fails before the model loads.
    suite, train_tasks, eval_tasks = build_tasks(cfg)
    # On meta, sharded, then loaded into the shards (model_init.py): no rank holds a whole copy.
    policy, hf_model, tokenizer = build_policy(cfg, info)
    check_kernel_backend(cfg, hf_model)
    ref = build_reference(cfg, info, policy, hf_model) if cfg.algo.loss.kl_coef > 0 else None
    gen_model = build_generation_model(cfg, info, policy, hf_model)

    o = cfg.optim
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=o.lr,
                                  betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=LRSchedule(cfg))

    logger = MetricsLogger(run_dir, enabled=info.is_main, total_steps=cfg.sft.steps + cfg.steps,
                           progress=cfg.log.progress, plot_every=cfg.log.plot_every,
                           tensorboard=cfg.log.tensorboard, wandb=cfg.log.wandb,
                           wandb_project=cfg.log.wandb_project, config=to_dict(cfg))
    if info.is_main:
        n_params = sum(p.numel() for p in hf_model.parameters())   # global sizes (DTensor .numel)
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
    weight = hf_model.get_output_embeddings().weight
    try:
        check_backend("triton-fused", weight.device, weight=weight, **head_kwargs(hf_model))
    except ValueError as e:
        raise ConfigError(f"config key 'model.kernel_backend' = 'triton-fused' with model "
                          f"{cfg.model.spec!r}: {e}") from None



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



def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)

