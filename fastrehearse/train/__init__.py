"""The trainer: config dataclasses, FSDP2 parallelization, the loop, DCP checkpoints, HF export.

    fastrehearse train --config configs/demo.yaml            # one process (CPU or one GPU)
    torchrun --nproc_per_node=8 -m fastrehearse.train --config configs/qwen3_1p7b_builtin.yaml
"""
from .config import ConfigError, TrainConfig, load_config

__all__ = ["ConfigError", "TrainConfig", "load_config"]
