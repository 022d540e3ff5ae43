"""Decode backends: what the rollout engine needs from a model, as a small protocol.

The engine drives a batch of sequences step by step; every step each live row appends one or more
known tokens (the token it just sampled, or forced scaffolding / observed text) and gets the logits
of the next token. `HFGenerator` implements this over a Hugging Face causal LM with one
`DynamicCache` for the whole batch:

  * rows are left-padded at `start`; `position_ids` count each row's real tokens, so padding never
    shifts positions;
  * a step may feed a different number of tokens per row: rows are right-padded inside the step and
    the padded slots get attention-mask 0, leaving masked "holes" in the cache that no later query
    attends to (transformers turns the 2-D mask into causal-by-slot AND not-masked);
  * finished rows are dropped from the cache (`batch_select_indices`), so they cost nothing.

A server backend (vLLM / SGLang with prefix caching) would implement the same three calls by
sending each row's full token list (prefix-cache hits make that cheap); nothing in the engine
depends on torch modules.
"""
from __future__ import annotations

from typing import Protocol

import torch


class Generator(Protocol):
    def start(self, prompts: list[list[int]]) -> torch.Tensor:
        """Prefill `prompts` (one per row); return next-token logits [B, V] (fp32)."""

    def step(self, tokens: list[list[int]]) -> torch.Tensor:
        """Append tokens[r] (>= 1 token) to row r; return next-token logits [B, V] (fp32)."""

    def keep(self, rows: list[int]) -> None:
        """Keep only these rows (in this order); the others are finished."""


class HFGenerator:
    """Batched KV-cache decoding over a transformers causal LM (see the module docstring)."""

    def __init__(self, model, *, pad_id: int = 0):
        self.model = model
        self.pad_id = pad_id
        self.device = next(model.parameters()).device
        self.cache = None
        self.mask: torch.Tensor | None = None     # [B, S] long: 1 real, 0 padding / hole
        self.next_pos: torch.Tensor | None = None  # [B] long: position id of each row's next token

    @torch.no_grad()
    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        """Run one chunk; return logits at column last[r] for each row r."""
        from transformers import DynamicCache
        if self.cache is None:
            self.cache = DynamicCache()
        cols = torch.unique(last)
        out = self.model(input_ids=ids, attention_mask=self.mask, position_ids=pos,
                         past_key_values=self.cache, use_cache=True,
                         logits_to_keep=cols if len(cols) > 1 else 1)
        logits = out.logits  # [B, len(cols), V]
        if len(cols) == 1:  # every row ends at the last column (k = the longest row's count)
            return logits[:, -1].float()
        which = torch.searchsorted(cols, last)
        return logits[torch.arange(ids.shape[0], device=ids.device), which].float()

    def start(self, prompts: list[list[int]]) -> torch.Tensor:
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("prompts must be a non-empty list of non-empty token lists")
        self.cache = None
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for r, p in enumerate(prompts):  # left padding
            ids[r, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[r, width - len(p):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        self.mask = mask
        self.next_pos = mask.sum(-1)
        last = torch.full((len(prompts),), width - 1, dtype=torch.long, device=self.device)
        return self._forward(ids, pos, last)

    def step(self, tokens: list[list[int]]) -> torch.Tensor:
        b = len(tokens)
        if self.mask is None or b != self.mask.shape[0]:
            raise ValueError(f"step got {b} rows, the batch has "
                             f"{None if self.mask is None else self.mask.shape[0]}")
        k = max(len(t) for t in tokens)
        if k == 0 or any(len(t) == 0 for t in tokens):
            raise ValueError("every row must append at least one token per step")
        ids = torch.full((b, k), self.pad_id, dtype=torch.long)
        new_mask = torch.zeros((b, k), dtype=torch.long)
        n = torch.tensor([len(t) for t in tokens], dtype=torch.long)
        for r, t in enumerate(tokens):  # right padding inside the step: holes after real tokens
            ids[r, :len(t)] = torch.tensor(t, dtype=torch.long)
            new_mask[r, :len(t)] = 1
        ids, new_mask, n = ids.to(self.device), new_mask.to(self.device), n.to(self.device)
        offs = torch.arange(k, device=self.device).unsqueeze(0)
        pos = self.next_pos.unsqueeze(1) + torch.minimum(offs, (n - 1).unsqueeze(1))
        self.mask = torch.cat([self.mask, new_mask], dim=1)
        self.next_pos = self.next_pos + n
        return self._forward(ids, pos, n - 1)

    def keep(self, rows: list[int]) -> None:
        if self.mask is None or rows == list(range(self.mask.shape[0])):
            return
        idx = torch.tensor(rows, dtype=torch.long, device=self.device)
        self.cache.batch_select_indices(idx)
        self.mask = self.mask[idx]
        self.next_pos = self.next_pos[idx]
