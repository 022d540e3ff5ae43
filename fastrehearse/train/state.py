"""What one training run holds: its objects (`Run`, built once by train/build.py `setup`) and the
state a resumed run needs (`TrainState`, checkpointed). Its own module so that every phase module
(tasks, rollouts, update, run_dir) can name them without importing the builder."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from .config import TrainConfig
from .metrics import MetricsLogger
from .parallelize import DistInfo


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
    best: dict | None = None       # eval.every: {"step", "success", "checkpoint"} of the best eval so far
    scheduler: dict = field(default_factory=dict)


@dataclass
class Run:
    """The objects one training run holds (built once by `setup`)."""
    cfg: TrainConfig
    info: DistInfo
    policy: nn.Module              # RehearsalModel (FSDP2-sharded when distributed)
    hf_model: nn.Module            # the transformers model inside `policy`
    gen_model: nn.Module           # what rollouts come from: hf_model itself (vllm, or no group), else an unsharded copy
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
    backend_startup_s: float = 0.0  # the rollout backend's start-up (vLLM), reported in the summary
