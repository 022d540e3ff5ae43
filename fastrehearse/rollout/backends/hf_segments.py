"""The segment protocol (segments.py) over a token-level KV-cache `Generator` (generator.py:
`HFGenerator` over a transformers model).

One session = one `Generator` batch: every row added before the first step is prefilled together
(`start`); then each step feeds every live row its pending tokens (the token it just sampled, or the
forced tokens the engine appended since, several per step when that keeps the batch busy) and
samples the rows whose pending tokens are all fed. Sampling is the engine's own (`sampling.sample`,
one `torch.Generator` per row seeded by the row's seed, so an episode's samples do not depend on
its batch-mates), after the optional logits processor.
"""
from __future__ import annotations

from collections import Counter, deque
from typing import Callable, Iterable

import torch

from fastrehearse.kernels.roles import Role
from fastrehearse.rollout.backends.generator import Generator
from fastrehearse.rollout.backends.sampling import sample
from fastrehearse.rollout.backends.segments import Sampling, Segment, SegmentRequest, StopMatcher

# logits_processor(contexts, context_roles, sample_roles, logits) -> logits: contexts[i] / context_roles[i]
# are row i's tokens and roles so far, sample_roles[i] the role of the token about to be sampled (ACT
# or REHEARSE). It must be a pure function of its inputs (the recorded log-probs are of the processed
# distribution, so a trainer re-forward has to apply it too). Constrained decoding and tests use it.
LogitsProcessor = Callable[[list[list[int]], list[list[int]], list[Role], torch.Tensor], torch.Tensor]


class HFBackend:
    """Segments from a `Generator` factory (read at each session start, so a caller may swap the
    factory, e.g. for one that shares a PrefixCache)."""
    name = "hf"

    def __init__(self, generators: Callable[[], Callable[[], Generator]], stops: StopMatcher, *,
                 max_chunk: int, logits_processor: Callable[[], LogitsProcessor | None] = lambda: None):
        self.generators, self.stops, self.max_chunk = generators, stops, max_chunk
        self.logits_processor = logits_processor

    def session(self, sampling: Sampling, stats: Counter) -> "HFSession":
        return HFSession(self.generators(), self.stops, sampling, stats, max_chunk=self.max_chunk,
                         logits_processor=self.logits_processor())


class _Slot:
    """A row of the generator's batch."""

    def __init__(self, seed: int):
        self.ctx: list[int] = []          # the row's tokens known here (fed or pending): one list object
        self.ctx_roles: list[int] = []    # for the whole session (a logits processor may key on it)
        self.pending: deque[int] = deque()
        self.head_sampled = False         # is pending[0] a token this session sampled?
        self.gen = torch.Generator().manual_seed(seed)
        self.req: SegmentRequest | None = None
        self.seg: list[int] = []
        self.seg_lp: list[float] = []


class HFSession:
    def __init__(self, factory: Callable[[], Generator], stops: StopMatcher, sampling: Sampling,
                 stats: Counter, *, max_chunk: int, logits_processor: LogitsProcessor | None):
        self.factory, self.stops, self.sampling, self.stats = factory, stops, sampling, stats
        self.max_chunk, self.logits_processor = max_chunk, logits_processor
        self.gen: Generator | None = None
        self.slots: dict[int, _Slot] = {}
        self.order: list[int] = []        # keys in the generator's row order

    def add(self, requests: list[SegmentRequest]) -> None:
        for req in requests:
            if req.max_tokens < 1:
                raise ValueError(f"segment request for row {req.key}: max_tokens must be >= 1")
            s = self.slots.get(req.key)
            if s is None:
                if self.gen is not None:
                    raise ValueError(f"row {req.key} was not in this session's batch when it started")
                s = self.slots[req.key] = _Slot(req.seed)
                self.order.append(req.key)
            elif s.req is not None:
                raise ValueError(f"row {req.key} already has a segment in flight")
            n = len(s.ctx)
            if req.tokens[:n] != s.ctx:    # token in: the row only ever grows
                raise ValueError(f"row {req.key}: its tokens do not extend what this session holds")
            s.ctx += req.tokens[n:]
            s.ctx_roles += req.roles[n:]
            s.pending.extend(req.tokens[n:])
            s.req, s.seg, s.seg_lp = req, [], []

    def drop(self, keys: Iterable[int]) -> None:
        gone = set(keys) & set(self.order)
        if not gone:
            return
        keep = [i for i, k in enumerate(self.order) if k not in gone]
        if self.gen is not None:
            self.gen.keep(keep)
        self.order = [self.order[i] for i in keep]
        for k in gone:
            del self.slots[k]

    def close(self) -> None:
        self.gen, self.slots, self.order = None, {}, []

    def step(self) -> list[tuple[int, Segment]]:
        if not self.order:
            return []
        slots = [self.slots[k] for k in self.order]
        if any(s.req is None for s in slots):
            raise ValueError("every row of the batch needs a segment in flight at each step")
        st = self.stats
        if self.gen is None:
            self.gen = self.factory()
            prompts = [list(s.pending) for s in slots]
            for s in slots:
                s.pending.clear()
            st["prefill_tokens"] += sum(map(len, prompts))
            st["forward_calls"] += 1
            logits = self.gen.start(prompts)
            st["prefill_reused_tokens"] += getattr(self.gen, "reused_tokens", 0)
            return self._sample(list(range(len(slots))), slots, logits)
        k = self._chunk(slots)
        feed = []
        for s in slots:  # every row has pending tokens: it just sampled, or the engine appended some
            f = [s.pending.popleft() for _ in range(min(k, len(s.pending)))]
            st["prefill_tokens"] += len(f) - int(s.head_sampled)
            st["decode_fed"] += int(s.head_sampled)
            s.head_sampled = False
            feed.append(f)
        st["forward_calls"] += 1
        st["token_slots"] += k * len(slots)
        st["fed_tokens"] += sum(map(len, feed))
        logits = self.gen.step(feed)
        ready = [i for i, s in enumerate(slots) if not s.pending]
        return self._sample(ready, slots, logits[ready]) if ready else []

    def _chunk(self, slots: list[_Slot]) -> int:
        """Tokens per row this step: several when forced tokens are waiting and at least half of the
        step's token slots are real (padding slots become masked cache holes)."""
        k = min(self.max_chunk, max(len(s.pending) for s in slots))
        while k > 1 and sum(min(k, len(s.pending)) for s in slots) * 2 < k * len(slots):
            k //= 2
        return max(k, 1)

    def _sample(self, idx: list[int], slots: list[_Slot], logits: torch.Tensor) -> list[tuple[int, Segment]]:
        rows = [slots[i] for i in idx]
        if self.logits_processor is not None:
            logits = self.logits_processor([s.ctx for s in rows], [s.ctx_roles for s in rows],
                                           [s.req.role for s in rows], logits)
        u = torch.stack([torch.rand((), generator=s.gen) for s in rows])
        tok, logp = sample(logits, self.sampling.temperature, self.sampling.top_p, u)
        self.stats["decode_tokens"] += len(rows)
        done = []
        for i, s, t, lp in zip(idx, rows, tok.tolist(), logp.tolist()):
            req = s.req
            s.ctx.append(t)
            s.ctx_roles.append(int(req.role))
            s.pending.append(t)
            s.head_sampled = True
            s.seg.append(t)
            s.seg_lp.append(lp)
            stop = self.stops(s.seg, req.stop_strings, req.stop_ids)
            if stop is not None or len(s.seg) >= req.max_tokens:
                done.append((self.order[i], Segment(s.seg, s.seg_lp, stop)))
                s.req = None
        return done
