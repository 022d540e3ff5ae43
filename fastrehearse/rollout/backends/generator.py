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
  * finished rows are dropped from the cache (`batch_select_indices`), so they cost nothing;
  * rows with identical prompts (a GRPO group, the drafts of one rehearsal) are prefilled once and
    their cache rows copied;
  * with a `PrefixCache` (prefix_cache.py), a prompt that repeats or extends a recently prefilled
    one loads that prefix's KV and prefills only the rest.

A server backend (vLLM / SGLang with prefix caching) would implement the same three calls by
sending each row's full token list (prefix-cache hits make that cheap); nothing in the engine
depends on torch modules.
"""
from __future__ import annotations

from typing import Protocol

import torch

from fastrehearse.rollout.backends.prefix_cache import PrefixCache


class Generator(Protocol):
    def start(self, prompts: list[list[int]]) -> torch.Tensor:
        """Prefill `prompts` (one per row); return next-token logits [B, V] (fp32)."""

    def step(self, tokens: list[list[int]]) -> torch.Tensor:
        """Append tokens[r] (>= 1 token) to row r; return next-token logits [B, V] (fp32)."""

    def keep(self, rows: list[int]) -> None:
        """Keep only these rows (in this order); the others are finished."""


class HFGenerator:
    """Batched KV-cache decoding over a transformers causal LM (see the module docstring)."""

    def __init__(self, model, *, pad_id: int = 0, prefix_cache: PrefixCache | None = None,
                 cache_writes: bool = True, dedupe: bool = True):
        """`prefix_cache`: reuse (and, with `cache_writes`, store) prompt KV across starts; ignored
        for models `PrefixCache.supports` refuses (they prefill every prompt, as without one).
        `dedupe=False` prefills duplicate prompts once per row (benchmarks measure what dedupe saves)."""
        self.model = model
        self.pad_id = pad_id
        self.device = next(model.parameters()).device
        self.prefix_cache = (prefix_cache if prefix_cache is not None and PrefixCache.supports(model)
                             else None)
        self.cache_writes = cache_writes
        self.dedupe = dedupe
        self.cache = None
        self.mask: torch.Tensor | None = None     # [B, S] long: 1 real, 0 padding / hole
        self.next_pos: torch.Tensor | None = None  # [B] long: position id of each row's next token
        self.reused_tokens = 0    # last start: prompt tokens not prefilled (duplicate rows, cached KV)

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
        if self.dedupe:
            rows_of: dict[tuple[int, ...], int] = {}
            which = [rows_of.setdefault(tuple(p), len(rows_of)) for p in prompts]
            distinct = [list(p) for p in rows_of]
        else:
            which, distinct = list(range(len(prompts))), [list(p) for p in prompts]
        if self.prefix_cache is None:
            logits = self._prefill(distinct)
            fed = sum(map(len, distinct))
        else:
            logits, fed = self._start_from_cache(distinct)
        self.reused_tokens = sum(map(len, prompts)) - fed
        if len(distinct) < len(prompts):   # copy each duplicate's cache row
            idx = torch.tensor(which, dtype=torch.long, device=self.device)
            self.cache.batch_select_indices(idx)
            self.mask, self.next_pos, logits = self.mask[idx], self.next_pos[idx], logits[idx]
        return logits

    def _prefill(self, prompts: list[list[int]]) -> torch.Tensor:
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

    def _start_from_cache(self, prompts: list[list[int]]) -> tuple[torch.Tensor, int]:
        """Load each prompt's longest cached prefix (at most all but its last token: a step needs
        one new token per row for its logits), prefill the rest as one step, store the prompts.
        Returns (logits, tokens prefilled)."""
        from transformers import DynamicCache
        pc = self.prefix_cache
        hits = [pc.match(p) for p in prompts]
        n = [min(m, len(p) - 1) for (m, _), p in zip(hits, prompts)]
        if max(n) == 0:
            logits = self._prefill(prompts)
        else:
            width, b = max(n), len(prompts)
            ref = next(kv for (_, kv), m in zip(hits, n) if m > 0)
            layers = []
            for li, (k0, v0) in enumerate(ref):
                keys = k0.new_zeros((b, k0.shape[1], width, k0.shape[3]))
                values = v0.new_zeros((b, v0.shape[1], width, v0.shape[3]))
                for r, ((_, kv), m) in enumerate(zip(hits, n)):
                    if m:   # left padding: the prefix ends at the last column
                        keys[r, :, width - m:] = kv[li][0][0, :, :m]
                        values[r, :, width - m:] = kv[li][1][0, :, :m]
                layers.append((keys, values))
            self.cache = DynamicCache(ddp_cache_data=layers)
            cols = torch.arange(width, device=self.device).unsqueeze(0)
            nt = torch.tensor(n, dtype=torch.long, device=self.device)
            self.mask = (cols >= (width - nt).unsqueeze(1)).long()
            self.next_pos = nt.clone()
            logits = self.step([p[m:] for p, m in zip(prompts, n)])
        fed = sum(len(p) - m for p, m in zip(prompts, n))
        pc.reused_tokens += sum(n)
        pc.computed_tokens += fed
        if self.cache_writes:
            for r, p in enumerate(prompts):
                real = self.mask[r].nonzero().squeeze(1)   # this row's tokens, in order
                pc.put(p, [(layer.keys[r:r + 1, :, real], layer.values[r:r + 1, :, real])
                           for layer in self.cache.layers])
        return logits, fed

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
