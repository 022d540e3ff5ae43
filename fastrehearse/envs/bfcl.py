"""BFCL v4 multi-turn (base, miss_func, miss_param, long_context) as a fastrehearse environment.

The real world is BFCL's own executable API classes (GorillaFileSystem, TwitterAPI, TradingBot, ...),
loaded with each entry's `initial_config`; tools are BFCL's function docs; the score is BFCL's own
`multi_turn_checker` (state + response comparison against the ground-truth execution, turn by turn).

Safety. BFCL's executor builds `instance.method(...)` strings and runs them with `eval()`. Model text
never reaches it: `parse_call` maps a ToolCall to a known function (one of the entry's docs, bound to
a public method of an involved class) with JSON-literal arguments whose names the doc declares.
`execute` then calls the bound method directly; `score` rebuilds each call string itself from the
validated name and `repr`'d literal arguments before handing it to the checker.

Turn protocol (BFCL user turns arrive one at a time):
  res = env.reset(task)              # tools + the first user turn
  ... policy acts; env.execute(call) for real calls ...
  msg = env.next_user_message()      # when the policy ends its turn (assistant reply w/o tool call)
  msg is None -> the task is over; otherwise append `msg` (a user message) and continue.
`score` splits the trajectory into turns at its user messages, so the trajectory must contain every
user message that `next_user_message` returned (and nothing else with role "user"). miss_func: at
the held-out turn `next_user_message` also adds the missing functions; the returned message lists
them (BFCL's prompting-mode text) and `env.tools` holds the updated schemas. `task.payload`
carries the same data statically: `user_turns[i]` is the message of turn i+1, `added_tools[i]` the
schemas that turn adds.

Isolation. Every env holds its own class instances (no module globals); `score` runs the checker
under a unique model name and deletes the instances the checker caches in BFCL's module globals.
"""
from __future__ import annotations

import ast
import copy
import importlib
import inspect
import itertools
import json
import math
import os
import re
from typing import Any

from fastrehearse.envs import bfcl_compat
from fastrehearse.envs.base import ResetResult, Suite, Task, ToolCall, ToolEnv, ToolResult, Trajectory

CATEGORY_ALIASES = {c.removeprefix("multi_turn_"): c for c in bfcl_compat.MULTI_TURN_CATEGORIES}
# Closing assistant text of each gold turn (BFCL ships calls only). A turn whose ground truth is
# empty (miss_func / miss_param) is one the agent cannot complete yet.
GOLD_TURN_DONE = "Done."
GOLD_TURN_BLOCKED = "I cannot complete this request with the functions and information I have."
_MAX_DEPTH = 16
# Arguments that make BFCL's MathAPI run unbounded (big-int `base**exponent`, decimal/mpmath
# precision, which it also sets process-wide). BFCL would hang too; a rollout must not. The
# ground truth stays far below (logarithm precision <= 10, no power/square_root calls).
RESOURCE_LIMITS = {("power", "exponent"): 1000, ("square_root", "precision"): 1000,
                   ("logarithm", "precision"): 1000}
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_counter = itertools.count()


class CallError(ValueError):
    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def resolve_category(split: str) -> str:
    cat = CATEGORY_ALIASES.get(split, split)
    if cat not in bfcl_compat.MULTI_TURN_CATEGORIES:
        raise ValueError(f"split: unknown BFCL multi-turn category {split!r}; "
                         f"use one of {list(bfcl_compat.MULTI_TURN_CATEGORIES)}, {list(CATEGORY_ALIASES)} "
                         "or multi_turn (all four)")
    return cat


# ---------------------------------------------------------------------------------------------
# BFCL API instances
# ---------------------------------------------------------------------------------------------
def make_instances(entry: dict) -> dict[str, Any]:
    """Fresh instances of the entry's classes, loaded as BFCL's executor loads them."""
    bfcl = bfcl_compat.import_bfcl()
    cfg = bfcl.backend_config
    long_context = "long_context" in entry["id"] or "composite" in entry["id"]
    out = {}
    for class_name in entry["involved_classes"]:
        cls = getattr(importlib.import_module(cfg.CLASS_FILE_PATH_MAPPING[class_name]), class_name)
        inst = cls()
        if class_name not in cfg.STATELESS_CLASSES:
            inst._load_scenario(copy.deepcopy(entry.get("initial_config", {}).get(class_name, {})),
                                long_context=long_context)
        out[class_name] = inst
    return out


def public_methods(instances: dict[str, Any]) -> dict[str, Any]:
    """name -> bound method, as BFCL's executor maps them (later classes win on a name clash)."""
    out = {}
    for inst in instances.values():
        for name, method in inspect.getmembers(inst, predicate=inspect.ismethod):
            if not name.startswith("_"):
                out[name] = method
    return out


def format_result(value: Any) -> str:
    """The string BFCL's executor records for a call result."""
    if type(value) is str:
        return value
    if type(value) is dict:
        try:
            return json.dumps(value)
        except (TypeError, ValueError):
            return str(value)
    return str(value)


# ---------------------------------------------------------------------------------------------
# The parser: ToolCall -> (known function, literal kwargs of declared parameters)
# ---------------------------------------------------------------------------------------------
def _check_literal(value: Any, path: str, depth: int = 0) -> None:
    """JSON literals only (what `repr` turns back into the same Python value under eval)."""
    if depth > _MAX_DEPTH:
        raise CallError("bad_arguments", f"argument {path} is nested too deeply")
    if value is None or isinstance(value, (bool, int, str)):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise CallError("bad_arguments", f"argument {path} is not a finite number: {value!r}")
        return
    if isinstance(value, list):
        for i, v in enumerate(value):
            _check_literal(v, f"{path}[{i}]", depth + 1)
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise CallError("bad_arguments", f"argument {path} has a non-string key {k!r}")
            _check_literal(v, f"{path}[{k!r}]", depth + 1)
        return
    raise CallError("bad_arguments", f"argument {path} has unsupported type {type(value).__name__}")


def parse_call(call: ToolCall, docs: dict[str, dict], methods: dict[str, Any]) -> tuple[str, dict]:
    """Validate a model call against the function docs. Returns (name, kwargs); raises CallError."""
    name = call.name
    if not isinstance(name, str) or name not in docs or name not in methods:
        raise CallError("unknown_tool", f"unknown function {name!r}; available: {sorted(docs)}")
    args = call.arguments
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except (ValueError, RecursionError) as e:
            raise CallError("bad_arguments", f"arguments of {name} are not valid JSON: {e!r}") from None
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise CallError("bad_arguments", f"arguments of {name} must be a JSON object, got {type(args).__name__}")
    params = (docs[name].get("parameters") or {})
    props = params.get("properties") or {}
    for key, value in args.items():
        if not isinstance(key, str) or not _IDENT.match(key) or key not in props:
            raise CallError("bad_arguments", f"{name} has no parameter {key!r}; parameters: {sorted(props)}")
        _check_literal(value, key)
        # Declared types are not enforced: BFCL's executor does not, and its own ground truth
        # relies on that (multi_turn_base_173 passes ticket_id='ticket_001' to an integer param).
        limit = RESOURCE_LIMITS.get((name, key))
        if limit is not None and isinstance(value, (int, float)) and abs(value) > limit:
            raise CallError("bad_arguments", f"{name}: |{key}| must be <= {limit} in this environment, got {value!r}")
    missing = [p for p in params.get("required") or [] if p not in args]
    if missing:
        raise CallError("bad_arguments", f"{name}: missing required parameter(s) {missing}")
    # A copy: the APIs keep argument objects in their state and mutate them later (post_tweet
    # stores `mentions`, mention() appends to it), which must not rewrite the trajectory's call.
    return name, copy.deepcopy(args)


def call_string(name: str, kwargs: dict) -> str:
    """The call text BFCL's checker evaluates, built only from a validated name and literals."""
    return f"{name}(" + ", ".join(f"{k}={v!r}" for k, v in kwargs.items()) + ")"


def parse_gold_call(text: str, methods: dict[str, Any]) -> tuple[str, dict]:
    """A ground-truth call string ("mv(source='a', destination='b')") -> (name, kwargs).
    Positional arguments are named through the method's signature; values must be literals."""
    node = ast.parse(text.strip(), mode="eval").body
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        raise ValueError(f"not a plain function call: {text!r}")
    name = node.func.id
    sig = inspect.signature(methods[name])
    positional = [p.name for p in sig.parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    kwargs = {positional[i]: ast.literal_eval(a) for i, a in enumerate(node.args)}
    kwargs.update({k.arg: ast.literal_eval(k.value) for k in node.keywords})
    return name, kwargs


def _jsonable(value: Any) -> Any:
    """Tuples -> lists (tool-call arguments travel as JSON)."""
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    return value


def _tool_call_msg(name: str, kwargs: dict) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": _jsonable(kwargs)}}


def _turn_message(turn: list[dict], added_docs: list[dict]) -> dict:
    """One user message for a BFCL turn (a held-out turn has none: BFCL's own text is used)."""
    if not turn:
        # bfcl_eval (optional) only where an item is built: this module imports without it
        from bfcl_eval.constants.default_prompts import DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_PROMPTING
        content = DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_PROMPTING.format(
            functions=json.dumps([bfcl_compat.func_doc_to_tool(d) for d in added_docs]))
        return {"role": "user", "content": content}
    if len(turn) == 1:
        return {"role": turn[0].get("role", "user"), "content": turn[0]["content"]}
    return {"role": "user", "content": "\n\n".join(m["content"] for m in turn)}


# ---------------------------------------------------------------------------------------------
# Environment
# ---------------------------------------------------------------------------------------------
class BfclEnv(ToolEnv):
    """One BFCL multi-turn episode: its own API instances, turn cursor and visible tools.

    Protocol (fastrehearse.envs.base): scripted user turns (`next_user_message`), `tools` kept
    current (miss_func adds the held-out functions at their turn), arguments validated by
    `execute` itself (`validates_calls`: BFCL does not enforce declared types), no stop tool."""

    validates_calls = True

    def __init__(self, system_prompt: str | None = None):
        self.system_prompt = system_prompt
        self.task: Task | None = None
        self.instances: dict[str, Any] = {}
        self.methods: dict[str, Any] = {}
        self.docs: dict[str, dict] = {}       # every function the entry ever exposes, by name
        self.tools: list[dict] = []           # schemas visible now (miss_func adds some later)
        self.turn = 0

    # -- lifecycle ------------------------------------------------------------------------
    def reset(self, task: Task) -> ResetResult:
        entry = task.payload.get("entry") if isinstance(task.payload, dict) else None
        if not entry or "involved_classes" not in entry:
            raise ValueError(f"task: {task.id!r} is not a BFCL multi-turn task (payload has no 'entry')")
        self.close()
        self.task = task
        self.instances = make_instances(entry)
        self.methods = public_methods(self.instances)
        visible = list(entry["function"])
        held_out = [d for docs in entry.get("missed_function", {}).values() for d in docs]
        self.docs = {d["name"]: d for d in visible + held_out}
        self.tools = [bfcl_compat.func_doc_to_tool(d) for d in visible]
        self.turn = 0
        messages = [dict(m) for m in entry["question"][0]]
        if self.system_prompt:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return ResetResult(tools=list(self.tools), messages=messages)

    def next_user_message(self, reply: dict | None = None) -> dict | None:
        """The next BFCL user turn as one user message, or None after the last turn. (`reply`, the
        agent's text reply that ended the turn, is ignored: BFCL's user turns are scripted.)"""
        if self.task is None:
            raise RuntimeError("next_user_message() before reset()")
        payload = self.task.payload
        if self.turn >= len(payload["user_turns"]):
            return None
        msg = dict(payload["user_turns"][self.turn])
        self.tools.extend(payload["added_tools"][self.turn])
        self.turn += 1
        return msg

    def execute(self, call: ToolCall) -> ToolResult:
        if self.task is None:
            return ToolResult("Error: environment not reset", ok=False, error_kind="env_error")
        try:
            name, kwargs = parse_call(call, self.docs, self.methods)
        except CallError as e:
            return ToolResult(f"Error: {e}", ok=False, error_kind=e.kind)
        try:
            return ToolResult(format_result(self.methods[name](**kwargs)))
        except Exception as e:  # the API raised: BFCL records the same text
            return ToolResult(f"Error during execution: {e}", ok=False, error_kind="env_error")

    def close(self) -> None:
        self.instances, self.methods = {}, {}

    # -- scoring --------------------------------------------------------------------------
    def decoded_turns(self, task: Task, trajectory: Trajectory) -> list[list[list[str]]]:
        """Trajectory -> BFCL's `multi_turn_model_result_list_decoded` (turn -> step -> call
        strings). A step is one assistant message; calls that fail `parse_call` are dropped, as
        BFCL drops what it cannot decode."""
        entry = task.payload["entry"]
        methods = public_methods(make_instances(entry)) if not self.methods else self.methods
        docs = self.docs or {d["name"]: d for d in entry["function"] + [
            d for ds in entry.get("missed_function", {}).values() for d in ds]}
        turns: list[list[list[str]]] = [[]]
        for m in trajectory.messages:
            if not isinstance(m, dict):
                continue
            if m.get("role") == "user":
                turns.append([])
            elif m.get("role") == "assistant":
                step = []
                for tc in m.get("tool_calls") or []:
                    fn = tc.get("function", tc) if isinstance(tc, dict) else {}
                    fn = fn if isinstance(fn, dict) else {}
                    try:
                        name, kwargs = parse_call(
                            ToolCall(name=fn.get("name"), arguments=fn.get("arguments", {})), docs, methods)
                    except CallError:
                        continue
                    step.append(call_string(name, kwargs))
                if step:
                    turns[-1].append(step)
        return turns

    def score(self, task: Task, trajectory: Trajectory) -> float:
        return 1.0 if self.check(task, trajectory)["valid"] else 0.0

    def check(self, task: Task, trajectory: Trajectory) -> dict:
        """BFCL's multi_turn_checker result dict for this trajectory ({"valid": bool, ...})."""
        bfcl = bfcl_compat.import_bfcl()
        entry = task.payload["entry"]
        gt = task.payload["ground_truth"]
        decoded = self.decoded_turns(task, trajectory)
        if len(decoded) != len(gt):
            # BFCL fails an entry whose turn count differs (force-terminated inference).
            return {"valid": False, "error_type": "multi_turn:force_terminated",
                    "error_message": f"trajectory has {len(decoded)} turns, the task has {len(gt)}"}
        model_name = f"{bfcl_compat.CHECKER_MODEL_NAME}_{os.getpid()}_{next(_counter)}"
        try:
            return bfcl.multi_turn_checker(decoded, gt, copy.deepcopy(entry),
                                           task.payload["category"], model_name)
        except Exception as e:   # a checker crash on odd input is a failed episode, not a crash
            return {"valid": False, "error_type": "checker_error", "error_message": repr(e)}
        finally:
            _free_checker_instances(model_name)


def _free_checker_instances(model_name: str) -> None:
    """The checker caches instances in multi_turn_utils' globals as `<model>_..._instance`."""
    g = bfcl_compat.import_bfcl().multi_turn_utils.__dict__
    prefix = re.sub(r"[-./:]", "_", model_name) + "_"
    for key in [k for k in g if k.startswith(prefix) and k.endswith("_instance")]:
        del g[key]


# ---------------------------------------------------------------------------------------------
# Suite
# ---------------------------------------------------------------------------------------------
def gold_messages(entry: dict, ground_truth: list[list[str]], user_turns: list[dict]) -> list[dict]:
    """Ground truth as a trajectory: per turn, one assistant message per call followed by its real
    tool response, then a closing assistant message; the next user turn follows."""
    env_instances = make_instances(entry)
    methods = public_methods(env_instances)
    out: list[dict] = []
    for t, calls in enumerate(ground_truth):
        if t > 0:
            out.append(dict(user_turns[t - 1]))
        for text in calls:
            name, kwargs = parse_gold_call(text, methods)
            try:
                content = format_result(methods[name](**copy.deepcopy(kwargs)))
            except Exception as e:
                content = f"Error during execution: {e}"
            out.append({"role": "assistant", "content": "", "tool_calls": [_tool_call_msg(name, kwargs)]})
            out.append({"role": "tool", "name": name, "content": content})
        out.append({"role": "assistant", "content": GOLD_TURN_DONE if calls else GOLD_TURN_BLOCKED})
    return out


HOLDOUT_EVERY = 5   # ":test" holds out entries 4, 9, 14, ... of each category (20%); ":train" the rest
PARTS = ("train", "test")


def parse_split(split: str) -> tuple[list[str], str | None]:
    """`<categories>[:train|:test]` -> (categories, part). Categories: "multi_turn" (all four), a
    category (`multi_turn_base`) or its short name (`base`), or a comma-separated list of those."""
    if not isinstance(split, str) or not split.strip():
        raise ValueError(f"split: expected '<categories>[:train|:test]', got {split!r}")
    cats_text, sep, part = split.partition(":")
    if sep and part not in PARTS:
        raise ValueError(f"split: unknown BFCL part {part!r} in {split!r}; use one of {list(PARTS)} "
                         "(or no part for every entry)")
    cats: list[str] = []
    for name in cats_text.split(","):
        name = name.strip()
        for c in (bfcl_compat.MULTI_TURN_CATEGORIES if name in ("multi_turn", "all") else [resolve_category(name)]):
            if c not in cats:
                cats.append(c)
    return cats, part or None


class BfclSuite(Suite):
    """BFCL v4 multi-turn. `tasks(split)`, split = `<categories>[:train|:test]`:
      categories  a category (`multi_turn_base`, ...), its short name (`base`, `miss_func`,
                  `miss_param`, `long_context`), `multi_turn` (all four), or a comma-separated list
      part        none: every entry; `train` / `test`: a fixed 80/20 hold-out (every 5th entry of
                  each category is test). BFCL ships no training split: this is fastrehearse's.
    Several categories are interleaved round-robin (so `limit` takes from all of them); each keeps
    BFCL's order."""
    name = "bfcl"

    def __init__(self, system_prompt: str | None = None, with_gold: bool = True):
        self.system_prompt = system_prompt
        self.with_gold = with_gold

    def tasks(self, split: str, limit: int | None = None) -> list[Task]:
        cats, part = parse_split(split)
        if limit is not None and (not isinstance(limit, int) or limit < 0):
            raise ValueError(f"limit: must be an int >= 0, got {limit!r}")
        per_cat = []
        for cat in cats:
            entries = bfcl_compat.load_entries(cat)
            if part is not None:
                entries = [e for i, e in enumerate(entries)
                           if (i % HOLDOUT_EVERY == HOLDOUT_EVERY - 1) == (part == "test")]
            per_cat.append((cat, entries))
        chosen = [(cat, es[i]) for i in range(max((len(es) for _, es in per_cat), default=0))
                  for cat, es in per_cat if i < len(es)]
        return [self._task(cat, entry) for cat, entry in chosen[:limit]]

    def _task(self, cat: str, entry: dict) -> Task:
        gt = bfcl_compat.load_answers(cat)[entry["id"]]["ground_truth"]
        missed = entry.get("missed_function", {})
        user_turns, added = [], []
        for t in range(1, len(entry["question"])):
            docs = missed.get(str(t), [])
            user_turns.append(_turn_message(entry["question"][t], docs))
            added.append([bfcl_compat.func_doc_to_tool(d) for d in docs])
        payload = {"entry": entry, "category": cat, "ground_truth": gt,
                   "user_turns": user_turns, "added_tools": added}
        gold = gold_messages(entry, gt, user_turns) if self.with_gold else None
        return Task(id=entry["id"], split=cat, payload=payload, gold=gold)

    def make_env(self) -> BfclEnv:
        return BfclEnv(system_prompt=self.system_prompt)

    # Training reward modes (fastrehearse.algo.rewards): "consistent" = `consistent_score`.
    reward_modes = ("real", "consistent")

    def task_reward(self, task: Task, trajectory: Trajectory, mode: str) -> float:
        if mode != "consistent":
            return super().task_reward(task, trajectory, mode)
        return consistent_score(task, trajectory)


def _visible(value: Any, text: str) -> bool:
    """Every leaf of an argument value is written in `text` (casefolded user turns): a value the
    agent can take from the request rather than from a tool response."""
    if isinstance(value, (list, tuple)):
        return all(_visible(v, text) for v in value)
    if isinstance(value, dict):
        return all(_visible(v, text) for v in value.values())
    if isinstance(value, str):
        return value.strip().casefold() in text
    if isinstance(value, float) and value.is_integer():
        return str(int(value)) in text or str(value) in text
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value) in text
    return True   # True / False / None carry no hidden value


def consistent_score(task: Task, trajectory: Trajectory) -> float:
    """BFCL multi-turn graded on the calls alone (the `consistent` training reward: no call is
    executed, so no response, real or rehearsed, is needed). Per user turn t, with the agent's
    well-formed calls of that turn (all its steps):
      - the trajectory has exactly the task's number of turns (as BFCL's checker requires);
      - a turn whose ground truth is empty (miss_func / miss_param) has no call;
      - every gold call of turn t is matched one to one by an agent call of the same function; when
        all of its argument values are written in the user turns up to t (they need no tool
        response), the arguments must also be equal (JSON values); otherwise (an id or a path the
        ground truth took from a real response) the function name is enough.
    Not graded: BFCL's state and response checks (they execute the calls), extra calls, the order
    of calls within a turn."""
    entry = task.payload["entry"]
    gold = task.payload["ground_truth"]
    methods = public_methods(make_instances(entry))
    turns = BfclEnv().decoded_turns(task, trajectory)
    if len(turns) != len(gold):
        return 0.0
    text = ""
    for t, (steps, gold_calls) in enumerate(zip(turns, gold)):
        text += " ".join(str(m.get("content", "")) for m in entry["question"][t]).casefold() + " "
        made = [parse_gold_call(c, methods) for step in steps for c in step]
        made = [(n, _jsonable(kw)) for n, kw in made]
        if not gold_calls:
            if made:
                return 0.0
            continue
        for g in gold_calls:
            name, kwargs = parse_gold_call(g, methods)
            kwargs = _jsonable(kwargs)
            exact = _visible(kwargs, text)
            hit = next((i for i, (n, kw) in enumerate(made) if n == name and (not exact or kw == kwargs)), None)
            if hit is None:
                return 0.0
            made.pop(hit)
    return 1.0
