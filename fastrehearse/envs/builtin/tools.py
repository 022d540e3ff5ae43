"""The builtin suite's tools: JSON schemas, argument checking, and handlers over a world dict.

`execute(world, name, arguments, allowed)` is the only entry point. It never raises: an unknown tool,
arguments that do not match the schema, or a domain error (unknown id, insufficient funds, a calendar
conflict) come back as `ToolResult(ok=False, error_kind=..., content='{"error": ...}')`, which is
what the model sees as the tool response. Responses are compact JSON (no spaces) so the world model
has a short, regular format to learn and field-level F1 is well defined.
"""
from __future__ import annotations

import json
import math
import re
from typing import Any, Callable

from fastrehearse.envs.base import ToolResult
from fastrehearse.envs.builtin.world import TODAY
from fastrehearse.envs.builtin import rules

UNITS = {  # unit -> (dimension, factor to the dimension's base unit)
    "m": ("length", 1.0), "km": ("length", 1000.0), "mi": ("length", 1609.344), "ft": ("length", 0.3048),
    "kg": ("mass", 1.0), "g": ("mass", 0.001), "lb": ("mass", 0.45359237),
    "USD": ("currency", 1.0), "EUR": ("currency", 1.08), "GBP": ("currency", 1.27),
    "C": ("temperature", None), "F": ("temperature", None),
}


class ToolError(Exception):
    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def _domain(msg: str) -> ToolError:
    return ToolError("domain_error", msg)


def dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


# ---- schemas ---------------------------------------------------------------------------------
def _fn(name: str, description: str, /, **props: tuple[str, str] | tuple[str, str, list]) -> dict:
    properties = {}
    for arg, spec in props.items():
        properties[arg] = {"type": spec[0], "description": spec[1]}
        if len(spec) > 2:
            properties[arg]["enum"] = spec[2]
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": properties, "required": list(props),
                       "additionalProperties": False}}}


_S = "string"
SCHEMAS: dict[str, dict] = {s["function"]["name"]: s for s in [
    _fn("find_accounts", "List the bank accounts owned by a person.", owner=(_S, "Full name of the owner")),
    _fn("get_balance", "Get the current balance of a bank account.", account_id=(_S, "Account id, e.g. AC1234")),
    _fn("transfer", "Move money between two accounts (amount in USD, rounded to cents).",
        from_account_id=(_S, "Account to debit"), to_account_id=(_S, "Account to credit"),
        amount=("number", "Amount in USD")),
    _fn("find_customer", "Look up a shop customer by full name.", name=(_S, "Full name of the customer")),
    _fn("search_products", "Search products whose name contains the query.", query=(_S, "Part of a product name")),
    _fn("check_stock", "Get the number of units in stock for a product.", sku=(_S, "Product SKU, e.g. SK1234")),
    _fn("list_orders", "List a customer's orders, oldest first.", customer_id=(_S, "Customer id, e.g. CU1234")),
    _fn("get_order_status", "Get the status of an order.", order_id=(_S, "Order id, e.g. OR1234")),
    _fn("place_order", "Place an order for a customer.", customer_id=(_S, "Customer id"),
        sku=(_S, "Product SKU"), quantity=("integer", "Number of units (>= 1)")),
    _fn("cancel_order", "Cancel an order that has not shipped yet and refund it.", order_id=(_S, "Order id")),
    _fn("list_events", "List calendar events on a date.", date=(_S, "Date as YYYY-MM-DD")),
    _fn("get_event", "Get the details of a calendar event.", event_id=(_S, "Event id, e.g. EV1234")),
    _fn("create_event", "Create a calendar event (times as HH:MM, 24h).", title=(_S, "Event title"),
        date=(_S, "Date as YYYY-MM-DD"), start=(_S, "Start time HH:MM"), end=(_S, "End time HH:MM")),
    _fn("cancel_event", "Delete a calendar event.", event_id=(_S, "Event id")),
    _fn("convert", "Convert a quantity between units of the same kind (length, mass, currency, temperature).",
        value=("number", "The quantity"), from_unit=(_S, "Unit of value", list(UNITS)),
        to_unit=(_S, "Target unit", list(UNITS))),
    # The "ledger" tools: every rule their responses follow is stated in their descriptions, so a
    # world model can predict them from the description and the episode's earlier responses.
    _fn("deposit", "Deposit money into a bank account (amount in USD, rounded to cents). The account's "
        "balance grows by exactly that amount. Returns a new deposit id.",
        account_id=(_S, "Account id, e.g. AC1234"), amount=("number", "Amount in USD (> 0)")),
    _fn("exchange", "Convert money between currencies at fixed rates: " + rules.RATES_TEXT + ". The result "
        "is amount * rate(from_currency) / rate(to_currency), rounded to cents.",
        amount=("number", "Amount of money"), from_currency=(_S, "Currency of amount", list(rules.RATES)),
        to_currency=(_S, "Target currency", list(rules.RATES))),
    _fn("add_days", "Add a whole number of days (may be negative) to a date of the Gregorian calendar; "
        "returns the new date and its weekday (Monday..Sunday).",
        date=(_S, "Date as YYYY-MM-DD"), days=("integer", "Number of days to add")),
    _fn("add_to_list", "Add an item to a named list (a list that does not exist yet starts empty). Returns "
        "the number of items on the list after adding.", list_name=(_S, "Name of the list"),
        item=(_S, "The item to add")),
    _fn("get_list", "Get the items of a named list in the order they were added (a list never added to "
        "is empty).", list_name=(_S, "Name of the list")),
    _fn("create_note", f"Save a note; it is dated today ({TODAY}). Returns the note's new id.",
        title=(_S, "Note title"), text=(_S, "Note text")),
    _fn("get_note", "Get a saved note by its id: its title, text and date.", note_id=(_S, "Note id, e.g. NT9001")),
]}

# What each tool's successful response holds (the handlers below): its top-level keys, and the
# keys that echo an argument (output key -> argument name; compared as the handlers normalize:
# strings case-insensitively, money to the cent). Public interface, not hidden state: the
# world-model reward's format term (fastrehearse.algo.rewards) checks rehearsed responses against it.
RESPONSES: dict[str, dict] = {
    "find_accounts": {"keys": ["owner", "accounts"], "echo": {"owner": "owner"}},
    "get_balance": {"keys": ["account_id", "balance", "currency"], "echo": {"account_id": "account_id"}},
    "transfer": {"keys": ["transfer_id", "amount", "from_balance", "to_balance"], "echo": {"amount": "amount"}},
    "find_customer": {"keys": ["customer_id", "name"], "echo": {"name": "name"}},
    "search_products": {"keys": ["products"], "echo": {}},
    "check_stock": {"keys": ["sku", "in_stock"], "echo": {"sku": "sku"}},
    "list_orders": {"keys": ["customer_id", "orders"], "echo": {"customer_id": "customer_id"}},
    "get_order_status": {"keys": ["order_id", "status"], "echo": {"order_id": "order_id"}},
    "place_order": {"keys": ["order_id", "status", "total"], "echo": {}},
    "cancel_order": {"keys": ["order_id", "status", "refund"], "echo": {"order_id": "order_id"}},
    "list_events": {"keys": ["date", "events"], "echo": {"date": "date"}},
    "get_event": {"keys": ["event_id", "title", "date", "start", "end", "location", "attendees"],
                  "echo": {"event_id": "event_id"}},
    "create_event": {"keys": ["event_id", "date", "start", "end"],
                     "echo": {"date": "date", "start": "start", "end": "end"}},
    "cancel_event": {"keys": ["event_id", "status"], "echo": {"event_id": "event_id"}},
    "convert": {"keys": ["value", "unit"], "echo": {"unit": "to_unit"}},
    "deposit": {"keys": ["deposit_id", "account_id", "amount"],
                "echo": {"account_id": "account_id", "amount": "amount"}},
    "exchange": {"keys": ["converted", "currency"], "echo": {"currency": "to_currency"}},
    "add_days": {"keys": ["date", "weekday"], "echo": {}},
    "add_to_list": {"keys": ["list_name", "item", "count"], "echo": {"list_name": "list_name", "item": "item"}},
    "get_list": {"keys": ["list_name", "items"], "echo": {"list_name": "list_name"}},
    "create_note": {"keys": ["note_id", "title", "created_on"], "echo": {"title": "title"}},
    "get_note": {"keys": ["note_id", "title", "text", "created_on"], "echo": {"note_id": "note_id"}},
}

DOMAINS = {
    "accounts": ["find_accounts", "get_balance", "transfer"],
    "shop": ["find_customer", "search_products", "check_stock", "list_orders", "get_order_status",
             "place_order", "cancel_order"],
    "calendar": ["list_events", "get_event", "create_event", "cancel_event"],
    "convert": ["convert"],
    "ledger": ["deposit", "exchange", "add_days", "add_to_list", "get_list", "create_note", "get_note"],
}


def _finite(x: int | float) -> bool:
    # JSON allows any integer; beyond 1e15 money/quantities are meaningless and float math overflows.
    return abs(x) < 1e15 if isinstance(x, int) else (math.isfinite(x) and abs(x) < 1e15)


def check_arguments(name: str, arguments: Any) -> dict[str, Any]:
    """Arguments -> a clean dict matching SCHEMAS[name], or ToolError('bad_arguments', why)."""
    params = SCHEMAS[name]["function"]["parameters"]
    if not isinstance(arguments, dict):
        raise ToolError("bad_arguments", f"arguments of {name} must be a JSON object, got "
                                         f"{type(arguments).__name__}")
    unknown = sorted(str(k) for k in arguments if k not in params["properties"])
    if unknown:
        raise ToolError("bad_arguments", f"{name} got unknown argument(s) {unknown}; "
                                         f"allowed: {list(params['properties'])}")
    missing = [k for k in params["required"] if k not in arguments]
    if missing:
        raise ToolError("bad_arguments", f"{name} is missing required argument(s) {missing}")
    out = {}
    for key, value in arguments.items():
        spec = params["properties"][key]
        typ = spec["type"]
        if typ == "string":
            ok = isinstance(value, str)
        elif typ == "number":
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and _finite(value)
        else:  # integer: 3.0 is accepted as 3 (JSON has one number type)
            ok = (isinstance(value, int) and not isinstance(value, bool) and _finite(value)) or (
                isinstance(value, float) and _finite(value) and value.is_integer())
            value = int(value) if ok else value
        if not ok:
            raise ToolError("bad_arguments", f"{name}: argument {key!r} must be a finite {typ} "
                                             f"(|x| < 1e15), got {str(value)[:40]}")
        if "enum" in spec and value not in spec["enum"]:
            raise ToolError("bad_arguments", f"{name}: argument {key!r} must be one of {spec['enum']}")
        out[key] = value
    return out


def execute(world: dict, name: Any, arguments: Any, allowed: list[str] | None = None) -> ToolResult:
    """Run one call against `world` (mutating it). Never raises."""
    try:
        if not isinstance(name, str) or name not in SCHEMAS or (allowed is not None and name not in allowed):
            names = allowed if allowed is not None else list(SCHEMAS)
            raise ToolError("unknown_tool", f"unknown tool {str(name)[:80]!r}; available: {names}")
        args = check_arguments(name, arguments)
        return ToolResult(content=dumps(HANDLERS[name](world, **args)))
    except ToolError as e:
        return ToolResult(content=dumps({"error": str(e)}), ok=False, error_kind=e.kind)
    except Exception as e:  # a bug in a handler is still an episode outcome, never a crash
        return ToolResult(content=dumps({"error": f"internal error: {type(e).__name__}"}), ok=False,
                          error_kind="env_error")


# ---- handlers --------------------------------------------------------------------------------
def _get(table: dict, key: str, what: str) -> dict:
    row = table.get(key.strip().upper()) if isinstance(key, str) else None
    if row is None:
        raise _domain(f"{what} {key[:40]!r} not found")
    return row


def _new_id(world: dict, prefix: str) -> str:
    world["next_id"] += 1
    return f"{prefix}{world['next_id']}"


def find_accounts(w, owner):
    rows = [{"account_id": k, "type": a["type"]} for k, a in w["accounts"].items()
            if a["owner"].casefold() == owner.strip().casefold()]
    if not rows:
        raise _domain(f"no accounts for owner {owner[:40]!r}")
    return {"owner": owner.strip(), "accounts": rows}


def get_balance(w, account_id):
    a = _get(w["accounts"], account_id, "account")
    return {"account_id": account_id.strip().upper(), "balance": a["balance"], "currency": a["currency"]}


def transfer(w, from_account_id, to_account_id, amount):
    src = _get(w["accounts"], from_account_id, "account")
    dst = _get(w["accounts"], to_account_id, "account")
    amount = round(amount, 2)
    if src is dst:
        raise _domain("cannot transfer to the same account")
    if amount <= 0:
        raise _domain("amount must be positive")
    if amount > src["balance"]:
        raise _domain(f"insufficient funds: balance is {src['balance']}")
    src["balance"] = round(src["balance"] - amount, 2)
    dst["balance"] = round(dst["balance"] + amount, 2)
    return {"transfer_id": _new_id(w, "TR"), "amount": amount, "from_balance": src["balance"],
            "to_balance": dst["balance"]}


def find_customer(w, name):
    for cid, c in w["customers"].items():
        if c["name"].casefold() == name.strip().casefold():
            return {"customer_id": cid, "name": c["name"]}
    raise _domain(f"customer {name[:40]!r} not found")


def search_products(w, query):
    q = query.strip().casefold()
    if not q:
        raise _domain("query must not be empty")
    return {"products": [{"sku": k, "name": p["name"], "price": p["price"]}
                         for k, p in w["products"].items() if q in p["name"].casefold()]}


def check_stock(w, sku):
    p = _get(w["products"], sku, "product")
    return {"sku": sku.strip().upper(), "in_stock": p["stock"]}


def list_orders(w, customer_id):
    cid = customer_id.strip().upper()
    _get(w["customers"], cid, "customer")
    rows = [{"order_id": k, "sku": o["sku"], "quantity": o["quantity"], "status": o["status"],
             "placed_on": o["placed_on"]} for k, o in w["orders"].items() if o["customer_id"] == cid]
    return {"customer_id": cid, "orders": sorted(rows, key=lambda r: (r["placed_on"], r["order_id"]))}


def get_order_status(w, order_id):
    return {"order_id": order_id.strip().upper(), "status": _get(w["orders"], order_id, "order")["status"]}


def place_order(w, customer_id, sku, quantity):
    _get(w["customers"], customer_id, "customer")
    p = _get(w["products"], sku, "product")
    if quantity < 1:
        raise _domain("quantity must be >= 1")
    if quantity > p["stock"]:
        raise _domain(f"only {p['stock']} units in stock")
    p["stock"] -= quantity
    oid = _new_id(w, "OR")
    w["orders"][oid] = {"customer_id": customer_id.strip().upper(), "sku": sku.strip().upper(),
                        "quantity": quantity, "status": "placed", "placed_on": TODAY}
    return {"order_id": oid, "status": "placed", "total": round(p["price"] * quantity, 2)}


def cancel_order(w, order_id):
    o = _get(w["orders"], order_id, "order")
    if o["status"] != "placed":
        raise _domain(f"order is {o['status']}; only placed orders can be cancelled")
    o["status"] = "cancelled"
    p = w["products"][o["sku"]]
    p["stock"] += o["quantity"]
    return {"order_id": order_id.strip().upper(), "status": "cancelled",
            "refund": round(p["price"] * o["quantity"], 2)}


_DATE = re.compile(r"^2\d{3}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])$")
_TIME = re.compile(r"^([01]\d|2[0-3]):[0-5]\d$")


def _check_date(date: str) -> str:
    if not _DATE.match(date.strip()):
        raise _domain(f"date {date[:20]!r} is not YYYY-MM-DD")
    return date.strip()


def list_events(w, date):
    date = _check_date(date)
    rows = [{"event_id": k, "title": e["title"], "start": e["start"], "end": e["end"]}
            for k, e in w["events"].items() if e["date"] == date]
    return {"date": date, "events": sorted(rows, key=lambda r: (r["start"], r["event_id"]))}


def get_event(w, event_id):
    return {"event_id": event_id.strip().upper(), **_get(w["events"], event_id, "event")}


def create_event(w, title, date, start, end):
    date = _check_date(date)
    start, end, title = start.strip(), end.strip(), title.strip()
    if not (_TIME.match(start) and _TIME.match(end)):
        raise _domain("start and end must be HH:MM")
    if not start < end:
        raise _domain("end must be after start")
    if not title:
        raise _domain("title must not be empty")
    for k, e in w["events"].items():
        if e["date"] == date and e["start"] < end and start < e["end"]:
            raise _domain(f"conflicts with {k} ({e['start']}-{e['end']})")
    eid = _new_id(w, "EV")
    w["events"][eid] = {"title": title, "date": date, "start": start, "end": end, "location": "Online",
                        "attendees": []}
    return {"event_id": eid, "date": date, "start": start, "end": end}


def cancel_event(w, event_id):
    _get(w["events"], event_id, "event")
    del w["events"][event_id.strip().upper()]
    return {"event_id": event_id.strip().upper(), "status": "cancelled"}


def convert(w, value, from_unit, to_unit):
    (dim_a, fa), (dim_b, fb) = UNITS[from_unit], UNITS[to_unit]
    if dim_a != dim_b:
        raise _domain(f"cannot convert {dim_a} ({from_unit}) to {dim_b} ({to_unit})")
    if dim_a == "temperature":
        c = value if from_unit == "C" else (value - 32) * 5 / 9
        out = c if to_unit == "C" else c * 9 / 5 + 32
    else:
        out = value * fa / fb
    if not math.isfinite(out):
        raise _domain("value out of range")
    return {"value": round(out, 4), "unit": to_unit}


# ---- ledger: the rules live in envs/builtin/rules.py, shared with the consistent reward ----------
def deposit(w, account_id, amount):
    a = _get(w["accounts"], account_id, "account")
    amount = round(amount, 2)
    if amount <= 0:
        raise _domain("amount must be positive")
    a["balance"] = rules.balance_after(a["balance"], amount)
    return {"deposit_id": _new_id(w, "DP"), "account_id": account_id.strip().upper(), "amount": amount}


def exchange(w, amount, from_currency, to_currency):
    return {"converted": rules.exchanged(amount, from_currency, to_currency), "currency": to_currency}


def add_days(w, date, days):
    try:
        return rules.days_added(_check_date(date), days)
    except ValueError as e:          # 2026-02-30, or past year 9999
        raise _domain(str(e)) from None


def add_to_list(w, list_name, item):
    key, item = rules.list_key(list_name), item.strip()
    if not key or not item:
        raise _domain("list_name and item must not be empty")
    items = w.setdefault("lists", {}).setdefault(key, [])
    items.append(item)
    return {"list_name": list_name.strip(), "item": item, "count": len(items)}


def get_list(w, list_name):
    return {"list_name": list_name.strip(), "items": list(w.get("lists", {}).get(rules.list_key(list_name), []))}


def create_note(w, title, text):
    title, text = title.strip(), text.strip()
    if not title:
        raise _domain("title must not be empty")
    nid = _new_id(w, "NT")
    w.setdefault("notes", {})[nid] = {"title": title, "text": text, "created_on": TODAY}
    return {"note_id": nid, "title": title, "created_on": TODAY}


def get_note(w, note_id):
    return {"note_id": note_id.strip().upper(), **_get(w.get("notes", {}), note_id, "note")}


HANDLERS: dict[str, Callable[..., dict]] = {n: globals()[n] for n in SCHEMAS}
