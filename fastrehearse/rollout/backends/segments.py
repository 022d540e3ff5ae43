"""The segment-level generation protocol: what the rollout engine asks of a generation backend.

An episode is one growing token sequence. Between model-written parts the engine appends known
tokens itself (chat scaffolding, real tool responses, user turns, policy-forced turns); what it
needs from a backend is the next *segment*: the tokens the model writes from the end of a row's
sequence until a stop (a policy turn up to its end-of-turn / call-close marker, a rehearsed tool
response up to the tool-turn end), with the log-prob of each sampled token and the stop reason.

    session = backend.session(sampling, stats)     # one batch of rows
    session.add([SegmentRequest, ...])              # token in: each row's whole sequence so far
    for key, seg in session.step(): ...             # completed segments (maybe none this step)
    session.drop([keys])                            # rows that are finished
    session.close()

Requests are continuous: `step` advances every in-flight segment and returns those that ended, so a
row whose segment ended is given its forced tokens and its next segment while the others keep
decoding (no batch-wide barrier per turn). Token in, token out: a request carries token ids, a
segment returns token ids; generated text is never re-tokenized.

Backends: `HFBackend` (hf_segments.py: the engine's own sampler, per-row seeds and logits processor
over a KV-cache `Generator`) and `VLLMBackend` (vllm_backend.py: vLLM `SamplingParams` over
`prompt_token_ids`, prefix caching on).

The stop rule is one definition (`StopMatcher`): a segment ends at the first token that is a stop
token id (end-of-sequence ids) or whose decoded text completes one of the stop strings.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Protocol

from fastrehearse.kernels.roles import Role


@dataclass(frozen=True)
class Sampling:
    """How a session samples: temperature 0 = greedy; top_p as in sampling.py."""
    temperature: float = 1.0
    top_p: float = 1.0


@dataclass
class SegmentRequest:
    key: int                          # the caller's row id (unique within a session)
    tokens: list[int]                 # the row's whole sequence so far (prompt, forced, earlier segments)
    roles: list[int]                  # its roles (a logits processor reads them)
    role: Role                        # role of the tokens this segment samples (ACT or REHEARSE)
    max_tokens: int                   # the segment ends after this many tokens at the latest (>= 1)
    stop_strings: tuple[str, ...]     # ... or at the token whose text completes one of these
    stop_ids: frozenset[int]          # ... or at one of these token ids (end of sequence)
    seed: int = 0                     # the row's seed (HF: its generator; vLLM: see vllm_backend)


@dataclass
class Segment:
    tokens: list[int]                 # sampled token ids (>= 1)
    logprobs: list[float]             # log-prob of each under the sampling distribution
    stop: str | None                  # the stop string / stop token's text that ended it; None: max_tokens


class SegmentSession(Protocol):
    def add(self, requests: list[SegmentRequest]) -> None: ...
    def step(self) -> list[tuple[int, Segment]]: ...
    def drop(self, keys: Iterable[int]) -> None: ...
    def close(self) -> None: ...


class SegmentBackend(Protocol):
    name: str

    def session(self, sampling: Sampling, stats: Counter) -> SegmentSession: ...


class StopMatcher:
    """The stop rule of a segment: a stop token id, or a stop string completed by the last token
    (string match on the decoded tail: a marker may span several tokens, or end inside one)."""

    def __init__(self, tokenizer, window: int):
        self.tokenizer = tokenizer
        self.window = window          # tokens decoded per check: enough to spell the longest marker

    def __call__(self, seg: list[int], stop_strings: Iterable[str], stop_ids: frozenset[int]) -> str | None:
        if seg[-1] in stop_ids:
            return self.tokenizer.decode(seg[-1:])
        tail = seg[-self.window:]
        now, before = self.tokenizer.decode(tail), self.tokenizer.decode(tail[:-1])
        for m in stop_strings:
            if m in now and m not in before:
                return m
        return None
