"""Packing: episodes -> token-budget rows (PackedBatch) for one varlen forward each."""
from .batch import PackedBatch
from .pack import (DEFAULT_QUADRATIC_COEF, OVERLONG_POLICIES, assign_bins, build_packed_batch,
                   episode_cost, pack, packing_efficiency, truncate_episode)

__all__ = ["PackedBatch", "pack", "packing_efficiency", "assign_bins", "build_packed_batch",
           "episode_cost", "truncate_episode", "OVERLONG_POLICIES", "DEFAULT_QUADRATIC_COEF"]
