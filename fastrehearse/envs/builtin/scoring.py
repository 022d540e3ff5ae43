"""Task success for the builtin suite, in three reward modes (`score(payload, trajectory, mode)`).

`real` (the task success every evaluation reports): the score re-executes every tool call the
trajectory's assistant messages made on a fresh copy of the task's world, so it is the same whether
the calls were executed for real, rehearsed by the model (rehearse mode), or a mix (hybrid): the
world the agent *acted on* is graded, not the world it imagined. A task succeeds (1.0) when every
check in payload["checks"] passes, else 0.0:
  calls   every required gold call (name + arguments) was made and succeeded;
  state   the database after those calls equals the gold final database (exact digest; so an extra
          transfer or a duplicated order fails);
  answer  the final assistant message contains the answer (numbers within tolerance, ids as a whole
          word, a status/location naming exactly the right option). A final message that pastes one
          of the episode's tool responses back (its text verbatim, or a JSON object equal to it) is
          not an answer and fails in every mode, whatever the pasted value is: a check that passed a
          word in it (`{"status":"shipped"}`) and failed a number after a colon would reward pasting,
          and a policy learns to (the calls-only control of docs/learning.md did).

`calls`: the same without the answer check (the rehearse-calls reward of docs/learning.md).

`consistent` (a reward a trainer can compute inside a rehearsed world: nothing is executed and no
hidden value of the real world is read; only the task's gold calls, which are annotations):
  calls   every required gold call appears among the calls made whose response in *this episode*
          is not an error object: same name, and each argument equal to the gold's (same matching)
          -- except an argument the gold copied from an earlier response (tasks.py "sources": an id
          found by find_accounts, an amount from exchange), which must instead equal a value under
          that key in an earlier non-error response *in this episode* of that tool called with the
          source call's request-stated arguments (find_accounts of *that* owner), in an object
          whose request-stated fields beside it agree (the account of type "savings");
  state   the write calls (WRITE_TOOLS) whose response in this episode is not an error equal the
          gold's write calls one to one (no missing, no extra: the world-free analogue of the
          state digest);
  answer  the answer spec's value is replaced by the value at its `source` in this episode's own
          responses (the latest response of the source tool that yields one: rehearsed or real),
          then checked with the same kinds and tolerances; no such response -> 0.
  rules   (the "rules" family, payload["rules"]) every non-error response of the episode carries
          the predictable fields the documented rules and the episode's earlier responses give
          (expectations.follows_rules: the balance after a deposit is the earlier balance plus the deposit,
          get_list lists what was added, an exchange uses the stated rate).
An episode whose world model said 2804.47 and whose answer reports 2804.47 scores 1 here and 0
under `real` when the real balance differs. A malformed call scores as in every mode (the engine's
`malformed_reward`, applied by the caller).
"""
from __future__ import annotations

import json
import math
import re
from typing import Any

from fastrehearse.envs.base import Trajectory
from fastrehearse.envs.builtin.expectations import follows_rules
from fastrehearse.envs.builtin.tasks import dicts_in, numbers_in
from fastrehearse.envs.builtin.tools import execute
from fastrehearse.envs.builtin.world import make_world, state_digest
from fastrehearse.envs.replay import Exchange, exchanges_of, final_answer_of, tool_calls_of

MAX_SCORED_CALLS = 64   # a runaway episode cannot make scoring slow
REWARD_MODES = ("real", "calls", "consistent")
WRITE_TOOLS = frozenset({"transfer", "place_order", "cancel_order", "create_event", "cancel_event",
                         "deposit", "add_to_list", "create_note"})
_INT = re.compile(r"-?\d+")
# A number not glued to a word, a decimal point, a time/date separator: "2026-03-04" and "14:00"
# yield nothing, "AC1234" does not yield 1234. Thousands separators allowed: 1,234.50.


def _json_objects(text: str) -> list:
    """Every JSON object that starts at a '{' of `text` and parses (a pasted response may sit inside
    tags or prose)."""
    dec, found = json.JSONDecoder(), []
    for m in re.finditer(r"\{", text):
        try:
            found.append(dec.raw_decode(text, m.start())[0])
        except (ValueError, RecursionError):
            continue
    return found


def pastes_a_response(text: str, trajectory: Trajectory) -> bool:
    """Whether the answer `text` copies one of the episode's tool responses (real or rehearsed):
    its content verbatim, or a JSON object equal to the response's parsed object."""
    responses = [m.get("content") for m in trajectory.messages
                 if isinstance(m, dict) and m.get("role") == "tool" and isinstance(m.get("content"), str)]
    # 8+ characters: a bare "{}" or "[]" response is not a paste an answer could be caught by
    responses = [r.strip() for r in responses if len(r.strip()) >= 8]
    if not responses or not text:
        return False
    if any(r in text for r in responses):
        return True
    parsed = [o for o in (_load(r) for r in responses) if isinstance(o, dict) and o]
    return bool(parsed) and any(o in parsed for o in _json_objects(text))


def answer_of(trajectory: Trajectory) -> str:
    """The final answer the answer check reads: `final_answer_of`, or "" when it pastes a tool
    response (see the module docstring)."""
    text = final_answer_of(trajectory)
    return "" if pastes_a_response(text, trajectory) else text


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


def calls_match(required: list[dict], made: list[tuple[str, dict]], seen: list[list] | None = None) -> bool:
    """Each required call matches a distinct made call. `seen` (consistent mode): for made call i, the
    (tool, parsed response) pairs of the episode before it; then an argument with a gold "source"
    must come from an earlier response as the source says (module docstring), not equal the gold."""
    left = list(range(len(made)))

    def arg_ok(req: dict, k: str, v, args: dict, i: int) -> bool:
        src = (req.get("sources") or {}).get(k) if seen is not None else None
        if src is None:
            return _same(v, args[k])
        return any(_same(d[src["key"]], args[k]) and all(_same(x, d.get(f)) for f, x in src["with"].items())
                   for tool, a, resp in seen[i] if tool == src["tool"] and isinstance(a, dict)
                   and all(f in a and _same(x, a[f]) for f, x in src["args"].items())
                   for d in dicts_in(resp) if src["key"] in d)

    for req in required:
        hit = next((j for j, i in enumerate(left) if made[i][0] == req["name"] and isinstance(made[i][1], dict)
                    and all(k in made[i][1] and arg_ok(req, k, v, made[i][1], i)
                            for k, v in req["arguments"].items())), None)
        if hit is None:
            return False
        left.pop(hit)
    return True


def score(payload: dict, trajectory: Trajectory, mode: str = "real") -> float:
    if mode == "consistent":
        return score_consistent(payload, trajectory)
    if mode not in REWARD_MODES:
        raise ValueError(f"builtin reward mode {mode!r}: expected one of {REWARD_MODES}")
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
    if mode == "real" and "answer" in checks and not check_answer(payload["answer"], answer_of(trajectory)):
        return 0.0
    return 1.0


# ---- consistent: graded inside the episode's own world ----------------------------------------
def _load(text: str | None):
    try:
        return json.loads(text) if isinstance(text, str) else None
    except (ValueError, RecursionError):
        return None


def is_error_response(content: str | None) -> bool:
    """A response that reports a failed call: a JSON object with an "error" key (the builtin tools'
    shape), or no response at all (a cut rehearsal)."""
    obj = _load(content)
    return content is None or (isinstance(obj, dict) and "error" in obj)


def _follow(value, path: list[str]):
    """The value at `path` (tasks.answer_at) inside a parsed response, or None."""
    for step in path:
        if step == "#len":
            value = len(value) if isinstance(value, list) else None
        elif step.startswith("#max_by:"):
            key = step[len("#max_by:"):]
            items = [x for x in value if isinstance(x, dict) and isinstance(x.get(key), (str, int, float))] \
                if isinstance(value, list) else []
            kinds = {type(x[key]) is str for x in items}
            value = max(items, key=lambda x: x[key]) if items and len(kinds) == 1 else None
        elif step == "#int":
            m = _INT.search(value) if isinstance(value, str) else None
            value = int(m.group()) if m else None
        else:
            value = value.get(step) if isinstance(value, dict) else None
        if value is None:
            return None
    return value


def _typed(kind: str, value):
    """`value` as the answer kind needs it, or None (a number may arrive as a numeric string)."""
    if kind == "number":
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value) if math.isfinite(value) else None
        nums = numbers_in(value) if isinstance(value, str) else []
        return nums[0] if len(nums) == 1 else None
    return value.strip() if isinstance(value, str) and value.strip() else None


def episode_answer_spec(spec: dict, exchanges: list[Exchange]) -> dict | None:
    """`spec` with its value taken from the episode's own responses (see the module docstring), or
    None when no response of a source tool yields a value of the answer's kind."""
    for ex in reversed(exchanges):
        for alt in spec.get("source") or []:
            if ex.name != alt["tool"]:
                continue
            v = _typed(spec["kind"], _follow(_load(ex.content), alt["path"]))
            if v is not None and spec["kind"] == "choice":   # "Shipped" names the option "shipped"
                v = next((o for o in spec["options"] if o.casefold() == v.casefold()), v)
            if v is not None:
                return {**spec, "value": v}
    return None


def score_consistent(payload: dict, trajectory: Trajectory, check_rules: bool = True) -> float:
    """The `consistent` score (module docstring); check_rules False: without the rules check (a
    scrambled world, envs/scramble.py, breaks the rules by construction)."""
    exchanges = exchanges_of(trajectory.messages)[:MAX_SCORED_CALLS]
    done = [ex for ex in exchanges if not is_error_response(ex.content)]
    made = [(ex.name, ex.arguments) for ex in done]
    seen = [[(ex.name, ex.arguments, _load(ex.content)) for ex in done[:i]] for i in range(len(done))]
    checks = payload["checks"]
    if "calls" in checks and not calls_match(payload["required_calls"], made, seen):
        return 0.0
    if "state" in checks:
        gold_writes = [c for c in payload["required_calls"] if c["name"] in WRITE_TOOLS]
        idx = [i for i, (n, _) in enumerate(made) if n in WRITE_TOOLS]
        if len(idx) != len(gold_writes) or not calls_match(gold_writes, [made[i] for i in idx], [seen[i] for i in idx]):
            return 0.0
    if check_rules and payload.get("rules") and not follows_rules(exchanges):
        return 0.0
    if "answer" in checks and payload["answer"] is not None:
        spec = episode_answer_spec(payload["answer"], exchanges_of(trajectory.messages))
        if spec is None or not check_answer(spec, answer_of(trajectory)):
            return 0.0
    return 1.0
