"""What an episode's earlier responses reveal, and a rehearsed world graded against the ledger rules.

A response field is *predictable* when its value follows from the tool's description (rules.py) and
the episode's own earlier responses, and *hidden* otherwise (a seeded balance never read before, a
new id). `EpisodeState` walks an episode's exchanges in order: `expect(name, args)` gives the
predictable fields of the next response with their values, `observe(...)` records what a response
reveals. `follows_rules` is the `consistent` reward's check for the "rules" task family
(scoring.py); `field_labels` / `fidelity_by_label` split world-model fidelity into predictable and
hidden fields.
"""
from __future__ import annotations

import json
from typing import Any

from fastrehearse.envs.builtin.rules import _num, balance_after, days_added, exchanged, list_key, same
from fastrehearse.envs.builtin.tools import RESPONSES, ToolError, check_arguments
from fastrehearse.envs.builtin.world import TODAY


class EpisodeState:
    """What an episode's own responses revealed so far (see the module docstring)."""

    def __init__(self) -> None:
        self.balances: dict[str, float] = {}
        self.lists: dict[str, list[str]] = {}
        self.notes: dict[str, dict] = {}

    def expect(self, name: str, args: Any) -> dict[str, Any]:
        """The predictable top-level fields of `name`'s successful response to `args`, with their
        values; every other field of the response is hidden. {} for a call with bad arguments."""
        if name not in RESPONSES:
            return {}
        try:
            a = check_arguments(name, args)
        except ToolError:
            return {}
        out: dict[str, Any] = {}
        for key, arg in RESPONSES[name]["echo"].items():
            v = a[arg]
            out[key] = round(v, 2) if name in ("transfer", "deposit") and key == "amount" else (
                v.strip() if isinstance(v, str) else v)
        acct = lambda k: a[k].strip().upper()   # noqa: E731
        if name == "get_balance" and acct("account_id") in self.balances:
            out["balance"] = self.balances[acct("account_id")]
        elif name == "transfer":
            amt = round(a["amount"], 2)
            if acct("from_account_id") in self.balances:
                out["from_balance"] = balance_after(self.balances[acct("from_account_id")], -amt)
            if acct("to_account_id") in self.balances:
                out["to_balance"] = balance_after(self.balances[acct("to_account_id")], amt)
        elif name == "exchange":
            out["converted"] = exchanged(a["amount"], a["from_currency"], a["to_currency"])
        elif name == "add_days":
            try:
                out.update(days_added(a["date"].strip(), a["days"]))
            except ValueError:
                return {}
        elif name == "add_to_list":
            out["count"] = len(self.lists.get(list_key(a["list_name"]), [])) + 1
        elif name == "get_list":
            out["items"] = list(self.lists.get(list_key(a["list_name"]), []))
        elif name == "create_note":
            out["created_on"] = TODAY
        elif name == "get_note" and acct("note_id") in self.notes:
            out.update(self.notes[acct("note_id")])
        return out

    def observe(self, name: str, args: Any, response: Any) -> None:
        """Record what a successful response (parsed JSON) reveals; anything malformed is ignored."""
        if not isinstance(response, dict) or "error" in response or not isinstance(args, dict):
            return
        sid = lambda v: v.strip().upper() if isinstance(v, str) else None   # noqa: E731
        if name == "get_balance" and sid(args.get("account_id")) and _num(response.get("balance")) is not None:
            self.balances[sid(args["account_id"])] = _num(response["balance"])
        elif name == "transfer":
            for arg, key in (("from_account_id", "from_balance"), ("to_account_id", "to_balance")):
                if sid(args.get(arg)) and _num(response.get(key)) is not None:
                    self.balances[sid(args[arg])] = _num(response[key])
        elif name == "deposit" and sid(args.get("account_id")) in self.balances and _num(args.get("amount")) is not None:
            k = sid(args["account_id"])
            self.balances[k] = balance_after(self.balances[k], _num(args["amount"]))
        elif name == "add_to_list" and isinstance(args.get("list_name"), str) and isinstance(args.get("item"), str):
            self.lists.setdefault(list_key(args["list_name"]), []).append(args["item"].strip())
        elif name == "create_note" and sid(response.get("note_id")) and isinstance(args.get("title"), str) \
                and isinstance(args.get("text"), str):
            self.notes[sid(response["note_id"])] = {"title": args["title"].strip(), "text": args["text"].strip(),
                                                    "created_on": TODAY}


def _load(text: Any) -> Any:
    try:
        return json.loads(text) if isinstance(text, str) else None
    except (ValueError, RecursionError):
        return None


def _is_error(obj: Any, text: Any) -> bool:
    return text is None or (isinstance(obj, dict) and "error" in obj)


def follows_rules(exchanges) -> bool:
    """Whether every successful response of the episode (`replay.Exchange`s, in order) carries the
    predictable fields its tool's rules and the earlier responses give. An error response is not
    graded (nothing was revealed); a response that is not a JSON object breaks the rules."""
    state = EpisodeState()
    for ex in exchanges:
        obj = _load(ex.content)
        if _is_error(obj, ex.content):
            continue
        want = state.expect(ex.name, ex.arguments)
        if want and not isinstance(obj, dict):
            return False
        if any(k not in obj or not same(v, obj[k]) for k, v in want.items()):
            return False
        state.observe(ex.name, ex.arguments, obj)
    return True


def field_labels(history, name: str, args: Any, real: str) -> dict[str, str]:
    """Each top-level field of the real response `real` to (name, args) after the exchanges
    `history`: "predictable" or "hidden"."""
    state = EpisodeState()
    for ex in history:
        state.observe(ex.name, ex.arguments, _load(ex.content))
    want = state.expect(name, args)
    obj = _load(real)
    return {k: ("predictable" if k in want else "hidden") for k in obj} if isinstance(obj, dict) else {}


def fidelity_by_label(history, name: str, args: Any, rehearsed: str | None, real: str) -> dict:
    """{"predictable": share, "hidden": share} of the real response's top-level fields of each label
    that the rehearsal reproduces (rule equality); None for a label with no field."""
    labels = field_labels(history, name, args, real)
    got, want = _load(rehearsed), _load(real)
    out: dict[str, float | None] = {}
    for lab in ("predictable", "hidden"):
        keys = [k for k, v in labels.items() if v == lab]
        out[lab] = (sum(isinstance(got, dict) and k in got and same(want[k], got[k]) for k in keys) / len(keys)
                    if keys else None)
    return out
