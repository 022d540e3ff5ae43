"""PackedBatch: many episodes in one row for one varlen forward pass."""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch


@dataclass
class PackedBatch:
    """One micro-batch: episodes concatenated into a single row of T token slots.

    Position t predicts token t+1 of the *same* episode; the last position of every episode has
    role CONTEXT (no label crosses a boundary).
    """
    input_ids: torch.Tensor      # [1, T] int64
    position_ids: torch.Tensor   # [1, T] int64, restarting at 0 for every episode
    cu_seqlens: torch.Tensor     # [B + 1] int32, episode boundaries (B episodes)
    max_seqlen: int
    targets: torch.Tensor        # [T] int64: next token within the same episode (0 at ends)
    roles: torch.Tensor          # [T] int64: role of the target token (CONTEXT at episode ends)
    advantages: torch.Tensor     # [T] float32 (0 where not loss-bearing)
    old_logp: torch.Tensor       # [T] float32 rollout log-prob of the target (NaN if unknown);
                                 # the trainer's update runs on a copy holding its own
    seq_ids: torch.Tensor        # [T] int64: index of the episode in the list given to pack()
    episode_indices: list[int]   # the episodes of this batch, in row order
    ref_logp: torch.Tensor | None = None  # [T] float32, the reference's when KL is on (on the trainer's copy)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    def to(self, device: torch.device | str) -> "PackedBatch":
        kw = {}
        for f in fields(self):
            v = getattr(self, f.name)
            kw[f.name] = v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
        return PackedBatch(**kw)
