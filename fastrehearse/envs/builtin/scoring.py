"""Task success for the builtin suite.

The score re-executes every tool call the trajectory's assistant messages made on a fresh copy of
the task's world, so it is the same whether the calls were executed for real, rehearsed by the model
(rehearse mode), or a mix (hybrid): the world the agent *acted on* is graded, not the world it
imagined. A task succeeds (1.0) when every check in payload["checks"] passes, else 0.0:
  calls   every required gold call (name + arguments) was made and succeeded;
  state   the database after those calls equals the gold final database (exact digest; so an extra
          transfer or a duplicated order fails);
  answer  the final assistant message contains the answer (numbers within tolerance, ids as a whole
          word, a status/location naming exactly the right option).
"""
from __future__ import annotations

import math
import re
from typing import Any

from fastrehearse.envs.base import Trajectory
from fastrehearse.envs.builtin.tools import execute
from fastrehearse.envs.builtin.world import make_world, state_digest
from fastrehearse.envs.replay import final_answer_of, tool_calls_of

MAX_SCORED_CALLS = 64   # a runaway episode cannot make scoring slow
# A number not glued to a word, a decimal point, a time/date separator: "2026-03-04" and "14:00"
# yield nothing, "AC1234" does not yield 1234. Thousands separators allowed: 1,234.50.
_NUM = re.compile(r"(?<![\w.:/-])-?\d+(?:,\d{3})*(?:\.\d+)?(?!\d|[:/.,-]\d)")


def numbers_in(text: str) -> list[float]:
    return [float(m.group().replace(",", "")) for m in _NUM.finditer(text)]


def check_answer(spec: dict | None, text: str) -> bool:
    if spec is None:
        return True
    kind, value = spec["kind"], spec["value"]
    if kind == "number":
        tol = max(spec.get("abs_tol", 0.0), spec.get("rel_tol", 0.0) * abs(value)) + 1e-9
        return any(abs(x - value) <= tol for x in numbers_in(text))
    if kind == "token":
        return re.search(rf"(?<![\w:]){re.escape(value)}(?![\w:])", text, re.IGNORECASE) is not None
    if kind == "choice":
        named = {o for o in spec["options"] if re.search(rf"\b{re.escape(o)}\b", text, re.IGNORECASE)}
        return named == {value}
    raise ValueError(f"unknown answer kind {kind!r}")


def _same(gold: Any, got: Any) -> bool:
    if isinstance(gold, str):
        return isinstance(got, str) and gold.strip().casefold() == got.strip().casefold()
    if isinstance(gold, (int, float)) and not isinstance(gold, bool):
        if not isinstance(got, (int, float)) or isinstance(got, bool) or not math.isfinite(got):
            return False
        # Money is rounded to cents by the tools, so 54.3478 and 54.35 are the same transfer.
        return abs(gold - got) <= 1e-6 * max(1.0, abs(gold)) or round(gold, 2) == round(got, 2)
    return gold == got


def calls_match(required: list[dict], made: list[tuple[str, dict]]) -> bool:
    left = list(made)
    for req in required:
        hit = next((i for i, (name, args) in enumerate(left) if name == req["name"] and isinstance(args, dict)
                    and all(k in args and _same(v, args[k]) for k, v in req["arguments"].items())), None)
        if hit is None:
            return False
        left.pop(hit)
    return True


def score(payload: dict, trajectory: Trajectory) -> float:
    world = make_world(payload["world_seed"])
    calls = tool_calls_of(trajectory.messages) or list(trajectory.real_calls)
    made = []
    for call in calls[:MAX_SCORED_CALLS]:
        if execute(world, call.name, call.arguments, payload["tools"]).ok:
            made.append((call.name, call.arguments))
    checks = payload["checks"]
    if "calls" in checks and not calls_match(payload["required_calls"], made):
        return 0.0
    if "state" in checks and state_digest(world) != payload["state_digest"]:
        return 0.0
    if "answer" in checks and not check_answer(payload["answer"], final_answer_of(trajectory)):
        return 0.0
    return 1.0
