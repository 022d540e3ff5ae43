"""Prefix KV reuse across `HFGenerator.start` calls: the KV of recently prefilled prompts, one row
each, so that a prompt repeating or extending one of them prefills only its new tokens.

Why: test-time rehearsal runs its private drafts on fresh engines, and every one of them starts
from the committed episode's whole context. On BFCL multi-turn (~7.4k-token prompts: the tool
docs) re-prefilling that context for each draft, the select-mode greedy candidate and every
turn was all of the rehearsal's cost on CPU (py-spy: 100% of samples in `HFGenerator.start`).
With this cache a turn prefills the context once, and the next turn only the tokens added since
(the committed turn, the tool response, the next user turn) -- what vLLM/SGLang prefix caching
gives a server backend.

Exactness: the reused keys/values are the ones a full prefill computes for those tokens at those
positions (position ids count each row's real tokens, so left padding never moves them); only the
float rounding of a differently-batched GEMM differs (tests: logits within 1e-4 of a fresh prefill,
greedy text identical). Only models whose cache is all full-attention `DynamicLayer`s take part
(`supports`): a sliding-window or linear-attention layer keeps a truncated/recurrent state that a
prefix slice does not describe, so such models prefill every prompt whole.

Memory: entries are per-layer [1, kv_heads, L, head_dim] copies on the model's device, bounded by
`max_bytes` (least recently used evicted first). An entry that is a prefix of a newer one is
dropped (the newer one holds its KV), so a rehearsed episode keeps one entry per live context.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

KV = list[tuple[torch.Tensor, torch.Tensor]]   # per layer: keys, values [1, kv_heads, L, head_dim]


@dataclass
class _Entry:
    ids: torch.Tensor      # [L] long, CPU
    kv: KV
    nbytes: int


class PrefixCache:
    """Least-recently-used store of (token ids -> per-layer KV) bounded by `max_bytes`.
    Shared by every generator of one model (e.g. a rehearsal policy's private engines)."""

    def __init__(self, max_bytes: int):
        if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 0:
            raise ValueError(f"prefix cache max_bytes must be an int >= 0, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._next = 0
        self.nbytes = 0
        # counters (over all starts that consulted the cache)
        self.reused_tokens = 0      # prompt tokens whose KV came from the cache
        self.computed_tokens = 0    # prompt tokens prefilled
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    def supports(model) -> bool:
        """True when every layer of the model's dynamic cache is a plain full-attention layer."""
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer
        cfg = getattr(model, "config", None)
        if cfg is None:
            return False
        try:
            layers = DynamicCache(config=cfg).layers
        except Exception:   # a config transformers cannot map to layer types: do not guess
            return False
        return len(layers) > 0 and all(type(layer) is DynamicLayer for layer in layers)

    def match(self, ids: Sequence[int]) -> tuple[int, KV | None]:
        """(n, kv): the longest stored prefix of `ids` (n tokens; kv tensors hold >= n positions,
        use [..., :n, :]); (0, None) when nothing matches."""
        if not self._entries or len(ids) == 0:
            return 0, None
        q = torch.as_tensor(list(ids), dtype=torch.long)
        best, best_key = 0, None
        for key, e in self._entries.items():
            n = min(len(q), len(e.ids))
            diff = (e.ids[:n] != q[:n]).nonzero()
            common = int(diff[0]) if len(diff) else n
            if common > best:
                best, best_key = common, key
        if best_key is None:
            return 0, None
        self._entries.move_to_end(best_key)
        return best, self._entries[best_key].kv

    def put(self, ids: Sequence[int], kv: KV) -> bool:
        """Store `ids`' KV (tensors of exactly len(ids) positions). False when it alone exceeds
        the budget. Entries that are prefixes of `ids` are dropped; if `ids` is a prefix of a stored
        entry, that entry is only marked as recently used."""
        q = torch.as_tensor(list(ids), dtype=torch.long)
        nbytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)
        for key, e in list(self._entries.items()):
            n = min(len(q), len(e.ids))
            if torch.equal(e.ids[:n], q[:n]):
                if len(e.ids) >= len(q):
                    self._entries.move_to_end(key)
                    return True
                self._drop(key)
        if nbytes > self.max_bytes:
            return False
        while self._entries and self.nbytes + nbytes > self.max_bytes:
            self._drop(next(iter(self._entries)))
            self.evicted += 1
        self._entries[self._next] = _Entry(q, kv, nbytes)
        self._next += 1
        self.nbytes += nbytes
        return True

    def _drop(self, key: int) -> None:
        self.nbytes -= self._entries.pop(key).nbytes

    def stats(self) -> dict:
        total = self.reused_tokens + self.computed_tokens
        return {"entries": len(self._entries), "bytes": self.nbytes, "reused_tokens": self.reused_tokens,
                "computed_tokens": self.computed_tokens, "evicted": self.evicted,
                "reused_fraction": self.reused_tokens / total if total else 0.0}
