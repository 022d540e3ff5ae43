"""API drift: a wrapper that perturbs a real environment's responses after training.

A trained agent has internalized an environment (its world model). Real APIs change: fields get
renamed, error messages get reworded, units and formats change, tools disappear. `DriftEnv` wraps
any `ToolEnv` and applies such changes to what the agent *sees*, while the wrapped environment's
state and its own checker stay untouched -- so task success is still graded by the benchmark, and
world-model fidelity (rehearsed vs real response) measures how far the internal model has drifted.

SPEC: comma-separated perturbations, each `name` or `name:arg`:
  rename            every JSON field renamed: snake_case -> camelCase, one-word keys get "_v2"
  rename:a=b;c=d    only the listed fields renamed (a -> b, c -> d)
  errors            failed calls (ok=False, or a JSON "error"/"message" field on failure) reworded
                    into a structured error: {"error": {"code": "E_<KIND>", "detail": <lowercased>}}
  units             money-like numeric fields (amount, price, balance, cost, total, fee) in cents
                    (x100, int) under a key that names the unit (balance -> balance_cents);
                    distance-like fields (distance, km) in metres (x1000; distance_km -> distance_m).
                    Solvable both ways: the unit is visible in the response, and `score` also
                    accepts the answer stated in the returned unit (a number of the final answer
                    equal to a value this episode's responses returned scaled is read back in the
                    original unit before the wrapped env grades it). Both are needed: under an
                    unchanged key with the answer graded in dollars, nothing would tell the agent
                    the unit had changed and the item could not be solved.
  formats           ISO dates YYYY-MM-DD -> DD/MM/YYYY, booleans -> "yes"/"no", floats -> strings
                    with two decimals
  remove:TOOL       the tool disappears: dropped from the schemas, and calling it fails as unknown
  remove            one tool per task, chosen by a seeded hash of the task id, disappears
  seed:N            seed for `remove` (default 0)
  all               rename,errors,units,formats

Responses that are not JSON (or a Python literal dict/list) pass through rename/units/formats
unchanged; `errors` still applies to them.
"""
from __future__ import annotations

import ast
import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

from fastrehearse.envs.base import ResetResult, Task, ToolCall, ToolEnv, ToolResult, Trajectory, WrappedEnv
from fastrehearse.rollout.text.toolcall import parse_tool_calls

KINDS = ("rename", "errors", "units", "formats", "remove", "seed", "all")
_MONEY = re.compile(r"(amount|price|balance|cost|total|fee)", re.I)
_DISTANCE = re.compile(r"(distance|_km$|^km$)", re.I)
_ISO_DATE = re.compile(r"^(\d{4})-(\d{2})-(\d{2})")


@dataclass
class DriftSpec:
    rename: bool = False
    rename_map: dict[str, str] = field(default_factory=dict)   # empty = the default rule
    errors: bool = False
    units: bool = False
    formats: bool = False
    remove: bool = False
    remove_tool: str | None = None    # None with remove=True: a seeded per-task choice
    seed: int = 0

    @classmethod
    def parse(cls, spec: str | None) -> "DriftSpec | None":
        if spec is None or not spec.strip() or spec.strip() == "none":
            return None
        s = cls()
        for part in spec.split(","):
            part = part.strip()
            if not part:
                continue
            name, _, arg = part.partition(":")
            name = name.strip().lower()
            if name not in KINDS:
                raise ValueError(f"--drift: unknown perturbation {name!r} in {spec!r} (allowed: {KINDS})")
            if name == "all":
                s.rename = s.errors = s.units = s.formats = True
            elif name == "rename":
                s.rename = True
                for pair in filter(None, arg.split(";")):
                    old, eq, new = pair.partition("=")
                    if not eq or not old.strip() or not new.strip():
                        raise ValueError(f"--drift: rename expects old=new pairs, got {pair!r}")
                    s.rename_map[old.strip()] = new.strip()
            elif name == "remove":
                s.remove = True
                s.remove_tool = arg.strip() or None
            elif name == "seed":
                try:
                    s.seed = int(arg)
                except ValueError:
                    raise ValueError(f"--drift: seed expects an integer, got {arg!r}") from None
            else:
                if arg:
                    raise ValueError(f"--drift: {name} takes no argument, got {part!r}")
                setattr(s, name, True)
        return s

    def describe(self) -> str:
        parts = []
        if self.rename:
            parts.append("rename" + (":" + ";".join(f"{a}={b}" for a, b in self.rename_map.items())
                                     if self.rename_map else ""))
        parts += [k for k in ("errors", "units", "formats") if getattr(self, k)]
        if self.remove:
            parts.append("remove" + (f":{self.remove_tool}" if self.remove_tool else ""))
        if self.seed:
            parts.append(f"seed:{self.seed}")
        return ",".join(parts) or "none"


_ANSWER_NUM = re.compile(r"(?<![\w.])-?\d{1,3}(?:,\d{3})+(?:\.\d+)?(?![\w.]\d)|(?<![\w.])-?\d+(?:\.\d+)?(?![\w]|\.\d)")


def answer_in_original_units(trajectory: Trajectory, scaled: list[tuple[int, float]]) -> Trajectory | None:
    """The trajectory with each number of its final answer that equals a value the `units` drift
    returned (e.g. 280447 cents) replaced by the original value (2804.47), or None when there is
    none. Only those numbers change, so a count or an id is never rescaled."""
    back = {float(new): old for new, old in scaled}
    idx = next((i for i in range(len(trajectory.messages) - 1, -1, -1)
                if trajectory.messages[i].get("role") == "assistant"), None)
    text = trajectory.final_answer
    if text is None and idx is not None and not trajectory.messages[idx].get("tool_calls"):
        text = trajectory.messages[idx].get("content")
    if not isinstance(text, str):
        return None

    def sub(m: re.Match) -> str:
        v = float(m.group().replace(",", ""))
        return repr(back[v]) if v in back else m.group()
    new = _ANSWER_NUM.sub(sub, text)
    if new == text:
        return None
    msgs = list(trajectory.messages)
    if idx is not None and not msgs[idx].get("tool_calls") and msgs[idx].get("content") == text:
        msgs[idx] = {**msgs[idx], "content": new}
    return Trajectory(messages=msgs, real_calls=list(trajectory.real_calls),
                      final_answer=new if trajectory.final_answer is not None else None)


# ----------------------------------------------------------------------------- value transforms
def rename_key(key: str, mapping: dict[str, str]) -> str:
    if mapping:
        return mapping.get(key, key)
    if "_" in key.strip("_"):
        head, *rest = key.split("_")
        return head + "".join(w[:1].upper() + w[1:] for w in rest if w)
    return key + "_v2"


def _walk(obj: Any, fn_pair) -> Any:
    """Apply fn_pair(key, value) -> (key, value) to every dict item, recursively."""
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            v = _walk(v, fn_pair)
            k2, v2 = fn_pair(k, v)
            out[k2] = v2
        return out
    if isinstance(obj, list):
        return [_walk(v, fn_pair) for v in obj]
    return obj


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def unit_key(key: str, unit: str) -> str:
    """The key renamed to name its new unit: balance -> balance_cents, distance_km -> distance_m."""
    if unit == "m" and (key.lower().endswith("_km") or key.lower() == "km"):
        return key[:-2] + "m"
    return f"{key}_{unit}"


def convert_units(key: Any, value: Any, scaled: list | None = None) -> tuple[Any, Any]:
    """(key, value) in the drifted unit; each conversion is appended to `scaled` as
    (new value, original value) so `DriftEnv.score` can read an answer given in the new unit."""
    if isinstance(key, str) and _is_number(value):
        for pattern, factor, unit in ((_MONEY, 100, "cents"), (_DISTANCE, 1000, "m")):
            if pattern.search(key):
                new = int(round(value * factor))
                if scaled is not None:
                    scaled.append((new, value))
                return unit_key(key, unit), new
    return key, value


def convert_format(value: Any) -> Any:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.2f}"
    if isinstance(value, str):
        m = _ISO_DATE.match(value)
        if m:
            return f"{m.group(3)}/{m.group(2)}/{m.group(1)}" + value[m.end():]
    return value


def _format_all(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _format_all(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_format_all(v) for v in obj]
    return convert_format(obj)


def parse_structured(text: str) -> Any | None:
    """JSON, or a Python literal (BFCL's classes return dicts that are often str()-ed)."""
    try:
        obj = json.loads(text)
    except (json.JSONDecodeError, TypeError):
        try:
            obj = ast.literal_eval(text)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            return None
    return obj if isinstance(obj, (dict, list)) else None


def reword_error(text: str, kind: str | None) -> str:
    detail = re.sub(r"\s+", " ", text).strip().rstrip(".").lower()
    detail = re.sub(r"^error[:\s]*", "", detail)
    code = "E_" + re.sub(r"[^A-Z0-9]+", "_", (kind or "failed").upper()).strip("_")
    return json.dumps({"error": {"code": code, "detail": detail}})


def _call_names(message: dict) -> list[str]:
    """Tool names an assistant message called, valid or not (syntax-only parse of its raw text)."""
    raw = message.get("raw_text")
    if isinstance(raw, str):
        return [c.call.name for c in parse_tool_calls(raw, None).calls if c.ok]
    return [tc.get("function", tc).get("name") for tc in message.get("tool_calls") or []]


class DriftEnv(WrappedEnv):
    """Wraps a real `ToolEnv`; the agent sees drifted schemas and responses."""

    def __init__(self, inner: ToolEnv, spec: DriftSpec):
        super().__init__(inner)
        self.spec = spec
        self.removed: str | None = None
        self.stats = {"responses": 0, "changed": 0, "removed_tool_calls": 0}
        self.scaled: list[tuple[int, float]] = []   # (value shown, original value): `units` this episode

    # The protocol is forwarded by WrappedEnv; the tool list loses a removed tool.
    @property
    def tools(self) -> list[dict] | None:
        """The wrapped env's current tools (None: unchanged since reset), minus a removed tool."""
        t = self.inner.tools
        if t is None or self.removed is None:
            return t
        return [x for x in t if x.get("function", {}).get("name") != self.removed]

    def reset(self, task: Task) -> ResetResult:
        res = self.inner.reset(task)
        self.removed = None
        self.scaled = []
        if self.spec.remove:
            names = [t["function"]["name"] for t in res.tools]
            if self.spec.remove_tool is not None:
                self.removed = self.spec.remove_tool if self.spec.remove_tool in names else None
            elif names:
                h = hashlib.sha256(f"{self.spec.seed}:{task.id}".encode()).digest()
                self.removed = sorted(names)[int.from_bytes(h[:4], "little") % len(names)]
            tools = [t for t in res.tools if t["function"]["name"] != self.removed]
            res = ResetResult(tools=tools, messages=res.messages)
        return res

    def execute(self, call: ToolCall) -> ToolResult:
        if self.removed is not None and call.name == self.removed:
            return ToolResult(content=f"Error: unknown tool '{call.name}'", ok=False,
                              error_kind="unknown_tool")
        real = self.inner.execute(call)
        drifted = self.perturb(real)
        self.stats["responses"] += 1
        self.stats["changed"] += int(drifted.content != real.content)
        return drifted

    def drift_stats(self) -> dict[str, int]:
        """What the drift did in this episode: real responses, how many it changed, calls that hit
        the removed tool (the harness stores this per item; results.json sums it per category)."""
        return dict(self.stats)

    def perturb(self, result: ToolResult) -> ToolResult:
        s = self.spec
        text = result.content
        obj = parse_structured(text)
        failed = not result.ok or (isinstance(obj, dict) and "error" in obj and len(obj) <= 2)
        if s.errors and failed:
            msg = text
            if isinstance(obj, dict):
                msg = str(obj.get("error") or obj.get("message") or text)
            return ToolResult(reword_error(msg, result.error_kind), result.ok, result.error_kind)
        if obj is None:
            return result
        if s.units:
            obj = _walk(obj, lambda k, v: convert_units(k, v, self.scaled))
        if s.formats:
            obj = _format_all(obj)
        if s.rename:
            obj = _walk(obj, lambda k, v: (rename_key(k, s.rename_map) if isinstance(k, str) else k, v))
        new = json.dumps(obj)
        if new == json.dumps(parse_structured(text)):
            return result          # nothing drifted: keep the original text byte for byte
        return ToolResult(new, result.ok, result.error_kind)

    def score(self, task: Task, trajectory: Trajectory) -> float:
        score = self._score(task, trajectory)
        if score < 1.0 and self.scaled:   # the answer may be stated in the unit the agent was shown
            back = answer_in_original_units(trajectory, self.scaled)
            if back is not None:
                score = max(score, self._score(task, back))
        return score

    def _score(self, task: Task, trajectory: Trajectory) -> float:
        if self.removed is None:
            return self.inner.score(task, trajectory)
        # Calls the agent made to the removed tool: the driver refuses them as unknown tools before
        # execute, so they are counted here, from what the agent wrote (the engine scores an
        # episode before it reads drift_stats).
        self.stats["removed_tool_calls"] = sum(
            name == self.removed for m in trajectory.messages if m.get("role") == "assistant"
            for name in _call_names(m))
        # A call to the removed tool never happened: checkers that replay the trajectory's calls
        # (the builtin suite's does) must not see it.
        msgs = []
        for m in trajectory.messages:
            if m.get("role") == "assistant" and m.get("tool_calls"):
                m = dict(m)
                m["tool_calls"] = [tc for tc in m["tool_calls"]
                                   if tc.get("function", tc).get("name") != self.removed]
                if not m["tool_calls"]:
                    m.pop("tool_calls")
            msgs.append(m)
        kept = Trajectory(messages=msgs, final_answer=trajectory.final_answer,
                          real_calls=[c for c in trajectory.real_calls if c.name != self.removed])
        return self.inner.score(task, kept)
