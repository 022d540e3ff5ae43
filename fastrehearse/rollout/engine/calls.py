"""Call routing and execution: what happens to each tool call an agent turn made.

  route_calls   per parsed call: "error" (malformed: its error message is fed back), "real" (the
                environment executes it) or "rehearse" (the model writes the response), by the
                rollout mode, the env's control tools (always real) and the hybrid coin
  execute_call  env.execute with the engine's contract: a buggy env never kills the batch
"""
from __future__ import annotations

import json
import random
from collections import Counter
from typing import Callable

from fastrehearse.envs.base import ToolCall, ToolEnv, Trajectory
from fastrehearse.rollout.text.toolcall import ParsedCall


def route_calls(calls: list[ParsedCall], env: ToolEnv | None, mode: str, hybrid_p: float,
                rng: random.Random) -> list[tuple[ParsedCall, str]]:
    """(call, "error" | "real" | "rehearse") in order. Without an env every call is rehearsed
    (private rehearsal); the hybrid coin is drawn from the row's `rng`, one per well-formed call
    that is not a control tool."""
    out = []
    for c in calls:
        if not c.ok:
            out.append((c, "error"))
        elif env is None or (mode == "rehearse" and c.call.name not in env.control_tools):
            out.append((c, "rehearse"))
        elif mode == "real" or c.call.name in env.control_tools:
            out.append((c, "real"))
        else:
            out.append((c, "real" if rng.random() < hybrid_p else "rehearse"))
    return out


def execute_call(env: ToolEnv, call: ToolCall, traj: Trajectory, malformed: Counter,
                 count_env_error: Callable[[str], None]) -> str:
    """Run `call` in `env` (recorded in traj.real_calls); the response text."""
    traj.real_calls.append(call)
    try:
        res = env.execute(call)
    except Exception as e:  # env contract says never raise; a buggy env must not kill a batch
        malformed["env_error"] += 1
        return json.dumps({"error": "env_error", "message": f"{type(e).__name__}: {e}"})
    if not res.ok and res.error_kind:
        count_env_error(res.error_kind)
    return res.content
