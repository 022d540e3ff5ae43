"""The Cv control of the learning experiment: a world with the right schema and random content.

`ScrambleEnv` wraps any `ToolEnv` (as eval/drift.py's `DriftEnv` does): the real tool executes, then
every value of its JSON response that does not echo an argument of the call -- derived fields
included (a balance after a deposit, a count) -- is replaced by a random value of the same type
and shape: an id `AC4245` by another `AC` + 4 digits, a date by another valid date, a time by
another valid time, other strings letter for letter (case kept, punctuation kept), an int by one
with as many digits, a float by one with as many decimals, a bool by a random bool. Keys, nesting,
list lengths and echoes are kept, so the response is schema-perfect and its content carries no
information about the real world.

So that an episode stays playable, a scrambled value is a stable alias within the episode: the
same real value always shows as the same stand-in, and a stand-in the agent passes back as an
argument is mapped to its real value before the real tool runs (a scrambled account id still
names the account). `score` grades the trajectory with the stand-ins mapped back. Error responses
pass through unchanged. The scramble is seeded by (seed, task id), so reruns see the same world.
"""
from __future__ import annotations

import copy
import hashlib
import json
import random
import re
import string
from typing import Any

from fastrehearse.envs.base import ResetResult, Task, ToolCall, ToolEnv, ToolResult, Trajectory, WrappedEnv

_DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")
_TIME = re.compile(r"^\d{2}:\d{2}$")
_ID = re.compile(r"^([A-Z]{2})(\d+)$")


def _key(v: Any) -> tuple[str, Any] | None:
    """How a value is looked up in the alias tables (strings case-insensitively), or None for a
    value that is never aliased (containers, None)."""
    if isinstance(v, bool):
        return ("b", v)
    if isinstance(v, str):
        return ("s", v.strip().casefold())
    if isinstance(v, (int, float)):
        return ("n", round(float(v), 6))
    return None


def scramble_value(v: Any, rng: random.Random) -> Any:
    """A random value of the same type and shape as `v` (module docstring)."""
    if isinstance(v, bool):
        return rng.random() < 0.5
    if isinstance(v, int):
        digits = len(str(abs(v)))
        lo = 0 if digits == 1 else 10 ** (digits - 1)
        return (-1 if v < 0 else 1) * rng.randint(lo, 10 ** digits - 1)
    if isinstance(v, float):
        text = repr(abs(v))
        decimals = len(text.split(".")[1]) if "." in text and "e" not in text else 2
        whole = len(text.split(".")[0]) if "e" not in text else 1
        out = round(rng.uniform(0, 10 ** whole), min(decimals, 6))
        return -out if v < 0 else out
    if isinstance(v, str):
        if _DATE.match(v):
            return f"{rng.randint(2000, 2039)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
        if (m := _ID.match(v)):        # an id keeps its kind (AC, SK, OR, ...)
            return m.group(1) + "".join(rng.choice(string.digits) for _ in m.group(2))
        if _TIME.match(v):
            return f"{rng.randint(0, 23):02d}:{rng.choice([0, 15, 30, 45]):02d}"
        return "".join(rng.choice(string.ascii_uppercase) if c.isupper() else rng.choice(string.ascii_lowercase)
                       if c.islower() else rng.choice(string.digits) if c.isdigit() else c for c in v)
    return v


def _load(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError, TypeError):
        return None


class ScrambleEnv(WrappedEnv):
    """Wraps a real `ToolEnv`; the agent sees schema-perfect responses with random content."""

    def __init__(self, inner: ToolEnv, seed: int = 0):
        super().__init__(inner)
        self.seed = seed
        self.rng = random.Random(seed)
        self.fake_of: dict[tuple, Any] = {}     # real value key -> stand-in shown
        self.real_of: dict[tuple, Any] = {}     # stand-in key -> real value
        self.stats = {"responses": 0, "scrambled_values": 0}

    def reset(self, task: Task) -> ResetResult:
        h = hashlib.sha256(f"scramble|{self.seed}|{task.id}".encode()).digest()
        self.rng = random.Random(int.from_bytes(h[:8], "little"))
        self.fake_of, self.real_of = {}, {}
        self.stats = {"responses": 0, "scrambled_values": 0}
        return self.inner.reset(task)

    def unmap(self, value: Any) -> Any:
        """An argument as the real tool must see it: stand-ins replaced by their real values."""
        if isinstance(value, dict):
            return {k: self.unmap(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self.unmap(v) for v in value]
        k = _key(value)
        return self.real_of.get(k, value) if k is not None else value

    def execute(self, call: ToolCall) -> ToolResult:
        args = call.arguments if isinstance(call.arguments, dict) else None
        real_args = self.unmap(args) if args is not None else call.arguments
        real = self.inner.execute(ToolCall(name=call.name, arguments=real_args, raw=getattr(call, "raw", "")))
        self.stats["responses"] += 1
        obj = _load(real.content)
        if not real.ok or obj is None or (isinstance(obj, dict) and "error" in obj):
            return real
        # echoes: a response value equal to a (real) argument shows as the agent wrote that argument
        echo: dict[tuple, Any] = {}
        for shown, actual in zip(_leaves(args), _leaves(real_args)):
            if _key(actual) is not None:
                echo[_key(actual)] = shown
        return ToolResult(json.dumps(self._scramble(obj, echo), separators=(",", ":"), ensure_ascii=False),
                          real.ok, real.error_kind)

    def _scramble(self, obj: Any, echo: dict) -> Any:
        if isinstance(obj, dict):
            return {k: self._scramble(v, echo) for k, v in obj.items()}
        if isinstance(obj, list):
            return [self._scramble(v, echo) for v in obj]
        k = _key(obj)
        if k is None:
            return obj
        if k in echo:
            return echo[k]
        if k not in self.fake_of:
            for _ in range(100):   # a stand-in must not collide with another value's stand-in
                fake = scramble_value(obj, self.rng)
                if _key(fake) not in self.real_of and _key(fake) != k:
                    break
            self.fake_of[k], self.real_of[_key(fake)] = fake, obj
        self.stats["scrambled_values"] += 1
        return self.fake_of[k]

    def score(self, task: Task, trajectory: Trajectory) -> float:
        msgs = copy.deepcopy(trajectory.messages)
        for m in msgs:
            for tc in (m.get("tool_calls") or []) if isinstance(m, dict) else []:
                fn = tc.get("function", tc)
                if isinstance(fn.get("arguments"), dict):
                    fn["arguments"] = self.unmap(fn["arguments"])
        return self.inner.score(task, Trajectory(messages=msgs, final_answer=trajectory.final_answer,
                                                 real_calls=list(trajectory.real_calls)))

    def scramble_stats(self) -> dict[str, int]:
        return dict(self.stats)



def _leaves(value: Any) -> list:
    if isinstance(value, dict):
        return [x for v in value.values() for x in _leaves(v)]
    if isinstance(value, list):
        return [x for v in value for x in _leaves(v)]
    return [value]
