"""The engine's hook for a separate response simulator (`RolloutEngine(..., simulator=...)`).

Without a simulator the model writes each rehearsed tool response inline: the engine forces the
"close assistant + open tool turn" scaffolding into the episode and the same sequence keeps
decoding. A `ResponseSimulator` instead writes every rehearsed response outside the episode and
the engine copies its tokens in as REHEARSE. The rollout benchmark uses this to measure inline
rehearsal against the separate-simulator style (benchmarks/_simulator.py,
benchmarks/bench_rollout.py); training and evaluation always rehearse inline, so this is set by
code only, never by a config key.

The simulator decodes on the engine's own backend and sampling through `generate` (one plain
assistant turn per prompt), so its tokens count in the rollout's metrics like any other.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from typing import Callable, Protocol

from fastrehearse.rollout.backends.segments import Sampling, SegmentBackend
from fastrehearse.rollout.config import Prompt
from fastrehearse.rollout.engine.decode import decode
from fastrehearse.rollout.engine.row import Row, RowSettings


@dataclass
class SimulatorCall:
    """A rehearsed call waiting for its response."""
    messages: list[dict]      # the conversation before the call (the prompt's messages + trajectory)
    tools: list[dict]         # the tools visible now
    call: str                 # the call as the model wrote it (inside its <tool_call> block), stripped
    seed: int                 # drawn from the row's generator: a simulator prompt's row seed


@dataclass
class SimulatedResponse:
    tokens: list[int]         # copied into the episode as REHEARSE (cut at max_episode_tokens)
    logprobs: list[float]     # one per token: the sampling log-prob (NaN where not sampled)
    text: str                 # the response's text (the trajectory records it stripped)


# prompts -> per prompt, the (tokens, log-probs) the model wrote after it in one assistant turn
GenerateTurns = Callable[[list[Prompt]], list[tuple[list[int], list[float]]]]


class ResponseSimulator(Protocol):
    def respond(self, calls: list[SimulatorCall], generate: GenerateTurns) -> list[SimulatedResponse]:
        """One response per call, in order; `generate` decodes on the engine's backend."""


def simulate(rows: list[Row], simulator: ResponseSimulator, settings: RowSettings, backend: SegmentBackend,
             sampling: Sampling, stats: Counter) -> None:
    """Write the response of every row's waiting call (`row.waiting_sim`) with `simulator`."""
    calls = [SimulatorCall(r.p.messages + r.traj.messages, list(r.tools), r.waiting_sim.raw.strip(),
                           r.rng.randrange(2**31)) for r in rows]
    # A simulator prompt is one plain assistant turn: no policy, no simulator of its own.
    sub = replace(settings, has_policy=False, simulated=False,
                  config=replace(settings.config, max_turns=1, parallel_tool_calls=True))

    def generate(prompts: list[Prompt]) -> list[tuple[list[int], list[float]]]:
        sim_rows = [Row(sub, i, p) for i, p in enumerate(prompts)]
        decode(sim_rows, backend, sampling, stats)
        return [(s.ids[len(s.p.input_ids):], s.logps[len(s.p.input_ids):]) for s in sim_rows]

    out = simulator.respond(calls, generate)
    if len(out) != len(rows):
        raise ValueError(f"simulator.respond returned {len(out)} responses for {len(rows)} calls")
    for r, resp in zip(rows, out):
        r.on_simulated(resp.tokens, resp.logprobs, resp.text)
