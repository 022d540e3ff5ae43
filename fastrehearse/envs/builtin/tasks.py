"""Task templates of the builtin suite, by difficulty level, and the seeded task generator.

Each template is a scripted agent: it reads the world to phrase a request, then solves it through
the real tools (`Script.call`), so gold trajectories are real executions by construction, and the
answer and final state are whatever those calls produced.

Levels
  0 "easy": one tool call whose name and argument are spelled out in the request.
  1: one lookup, then answer (the model must pick the tool and argument itself).
  2: two or three dependent calls (look up an id, then use it), then answer.
  3: three to five calls with a state change (transfer, order, cancel, reschedule), then answer.
  4 "rules": two to four calls whose later responses follow from earlier ones and from rules the tool
     descriptions state (create -> get, deposit -> balance, add -> list, exchange rates, date
     arithmetic: envs/builtin/rules.py), then answer. A rehearsed world can be right or wrong here.

Argument provenance: a required call's argument that the request does not state but an earlier gold
response returned (an account id from find_accounts, a converted amount) is recorded with where it
came from (`required_calls[i]["sources"][arg] = {"tool", "key", "args", "with"}`: the tool, the
response key, the source call's arguments that the request states, and the fields beside the value
whose gold values the request states, e.g. `"type": "savings"`), so the `consistent` reward checks
it against the episode's own earlier responses instead of the real world's hidden id.

Splits are disjoint twice over: train worlds use even seeds and test worlds odd seeds, and each task's
entity combination (template + the entities the request names, e.g. an owner name and an account
type) is hashed into a bucket that belongs to exactly one split.

Tool families: `generate(..., families=...)` keeps only tasks whose exposed and called tools all lie in
the given families (DOMAINS keys). That makes a held-out tool family: train on every family but one
(e.g. all but "calendar") and test on that family alone -- tools the policy never saw in training.
"""
from __future__ import annotations

import hashlib
import json
import random
import re
from dataclasses import dataclass
from typing import Any, Callable

from fastrehearse.envs.builtin import rules
from fastrehearse.envs.builtin.tools import DOMAINS, execute
from fastrehearse.envs.builtin.world import LOCATIONS, ORDER_STATUSES, make_world, state_digest

TEST_BUCKETS = 5          # one combo bucket in five is test-only
WORLD_REUSE = 8           # template draws per generated world (a world costs ~2 ms, a copy ~0.1 ms)
UNIT_WORDS = {"m": "meters", "km": "kilometers", "mi": "miles", "ft": "feet", "kg": "kilograms",
              "g": "grams", "lb": "pounds", "USD": "US dollars", "EUR": "euros", "GBP": "British pounds",
              "C": "degrees Celsius", "F": "degrees Fahrenheit"}
UNIT_PAIRS = [("mi", "km"), ("km", "mi"), ("ft", "m"), ("m", "ft"), ("lb", "kg"), ("kg", "lb"),
              ("lb", "g"), ("EUR", "USD"), ("USD", "EUR"), ("GBP", "USD"), ("C", "F"), ("F", "C")]


# ---- answer specs (checked by fastrehearse.envs.builtin.scoring) ------------------------------
# Every spec also says where its value comes from in the episode's own tool responses ("source":
# alternatives made by `answer_at`), so the `consistent` reward can grade the answer against the world
# the episode saw (rehearsed or real) instead of the real world's hidden value.
def answer_at(tool: str, *path: str) -> dict:
    """The answer's value is in the latest response of `tool` that yields one, at `path`: keys, or
    "#len" (length of a list), "#max_by:KEY" (the list item with the largest KEY), "#int" (the first
    integer in a string, e.g. an error message)."""
    return {"tool": tool, "path": list(path)}


def number(value: float, *source: dict, abs_tol: float = 0.0, rel_tol: float = 0.0) -> dict:
    return {"kind": "number", "value": value, "abs_tol": abs_tol, "rel_tol": rel_tol, "source": list(source)}


def money(value: float, *source: dict) -> dict:
    return number(value, *source, abs_tol=0.01)


def token(value: str, *source: dict) -> dict:
    """An exact id / time that must appear as a whole word (case-insensitive)."""
    return {"kind": "token", "value": value, "source": list(source)}


def choice(value: str, options: list[str], *source: dict) -> dict:
    """Exactly one of `options` may be named, and it must be `value` (naming all of them fails)."""
    return {"kind": "choice", "value": value, "options": options, "source": list(source)}


class GoldError(RuntimeError):
    """A template's own call failed: a bug in the template, never a property of the model."""


class Script:
    """Runs a template's calls against the world and records the gold messages."""

    def __init__(self, world: dict):
        self.world = world
        self.messages: list[dict] = []
        self.required: list[dict] = []
        self.exchanges: list[tuple[str, dict, Any]] = []   # (tool, arguments, parsed response)
        self.n_calls = 0

    def call(self, tool: str, /, required: bool = True, **args: Any) -> dict:
        return self.parallel((tool, args), required=required)[0]

    def parallel(self, *calls: tuple[str, dict], required: bool = True) -> list[dict]:
        self.messages.append({"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": n, "arguments": dict(a)}} for n, a in calls]})
        outs = []
        earlier = list(self.exchanges)
        for name, args in calls:
            res = execute(self.world, name, args)
            if not res.ok:
                raise GoldError(f"gold call {name}({args}) failed: {res.content}")
            self.messages.append({"role": "tool", "name": name, "content": res.content})
            self.exchanges.append((name, dict(args), json.loads(res.content)))
            if required:
                req = {"name": name, "arguments": dict(args)}
                cands = {k: src for k, v in args.items() if (src := _source_of(v, earlier)) is not None}
                if cands:
                    req["sources"] = cands   # pruned by `generate` to those the request does not state
                self.required.append(req)
            self.n_calls += 1
            outs.append(json.loads(res.content))
        return outs

    def answer(self, text: str) -> None:
        self.messages.append({"role": "assistant", "content": text})


_ID_OR_DATE = re.compile(r"^(?:[A-Z]{2}\d+|\d{4}-\d{2}-\d{2})$")


def _leaves(value: Any, key: str | None = None):
    """(key, leaf) pairs of a parsed response, at any depth."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _leaves(v, k)
    elif isinstance(value, list):
        for v in value:
            yield from _leaves(v, key)
    elif key is not None:
        yield key, value


NUMBER = re.compile(r"(?<![\w.:/-])-?\d+(?:,\d{3})*(?:\.\d+)?(?!\d|[:/.,-]\d)")


def numbers_in(text: str) -> list[float]:
    """Every number written in `text` (thousands separators allowed; not inside ids, dates, times)."""
    return [float(m.group().replace(",", "")) for m in NUMBER.finditer(text)]


def dicts_in(value: Any):
    """Every JSON object inside a parsed response, the response itself included."""
    if isinstance(value, dict):
        yield value
        for v in value.values():
            yield from dicts_in(v)
    elif isinstance(value, list):
        for v in value:
            yield from dicts_in(v)


def _source_of(value: Any, earlier: list[tuple[str, dict, Any]]) -> dict | None:
    """Where an argument value came from: the first exchange whose response holds it (its origin,
    not a later echo of it such as an optional check_stock), as
    {"tool", "key", "args" (that call's arguments), "with" (the scalar fields beside the value)};
    `generate` keeps of args / with only what the request states. Only ids, dates and non-integer
    numbers are traced (a time or a small count equal to some response leaf is a coincidence more
    often than a copy)."""
    if isinstance(value, str):
        if not _ID_OR_DATE.match(value):
            return None
    elif not (isinstance(value, float) and not value.is_integer()):
        return None
    for tool, args, resp in earlier:
        for d in dicts_in(resp):
            for key, leaf in d.items():
                if type(leaf) is type(value) and rules.same(value, leaf):
                    beside = {k: v for k, v in d.items() if k != key and isinstance(v, str)}
                    return {"tool": tool, "key": key, "args": args, "with": beside}
    return None


def _stated_in(value: Any, prompt: str) -> bool:
    if isinstance(value, str):
        return re.search(rf"(?<![\w-]){re.escape(value)}(?![\w-])", prompt, re.IGNORECASE) is not None
    return any(rules.same(value, x) for x in numbers_in(prompt))


@dataclass
class Draft:
    prompt: str
    answer: dict | None
    combo: tuple             # decides the split bucket
    tools: list[str]         # tools exposed to the model


def _domains(*names: str) -> list[str]:
    return [t for d in names for t in DOMAINS[d]]


def _money(x: float) -> str:
    return f"{x:.2f}"


# ---- level 0: spelled-out single call ---------------------------------------------------------
def easy(w, rng, s):
    tool = rng.choice(["get_balance", "check_stock", "get_order_status", "list_events", "find_customer"])
    if tool == "get_balance":
        arg, val = "account_id", rng.choice(sorted(w["accounts"]))
    elif tool == "check_stock":
        arg, val = "sku", rng.choice(sorted(w["products"]))
    elif tool == "get_order_status":
        arg, val = "order_id", rng.choice(sorted(w["orders"]))
    elif tool == "list_events":
        arg, val = "date", rng.choice(sorted({e["date"] for e in w["events"].values()}))
    else:
        arg, val = "name", rng.choice(sorted(c["name"] for c in w["customers"].values()))
    phrase = rng.choice(['Call the tool {t} with {a}="{v}" and tell me the result.',
                         'Use {t} with {a}="{v}", then report what it returns.',
                         'Please run {t}({a}="{v}") and tell me the answer.'])
    r = s.call(tool, **{arg: val})
    if tool == "get_balance":
        s.answer(f"The balance of {val} is {_money(r['balance'])} USD.")
        ans = money(r["balance"], answer_at(tool, "balance"))
    elif tool == "check_stock":
        s.answer(f"{val} has {r['in_stock']} units in stock.")
        ans = number(r["in_stock"], answer_at(tool, "in_stock"))
    elif tool == "get_order_status":
        s.answer(f"Order {val} is {r['status']}.")
        ans = choice(r["status"], ORDER_STATUSES, answer_at(tool, "status"))
    elif tool == "list_events":
        titles = ", ".join(e["title"] for e in r["events"])
        s.answer(f"There are {len(r['events'])} events on {val}: {titles}.")
        ans = number(len(r["events"]), answer_at(tool, "events", "#len"))
    else:
        s.answer(f"The customer id of {val} is {r['customer_id']}.")
        ans = token(r["customer_id"], answer_at(tool, "customer_id"))
    return Draft(phrase.format(t=tool, a=arg, v=val), ans, ("easy", tool, val), [tool])


# ---- level 1: one lookup ----------------------------------------------------------------------
def balance_by_id(w, rng, s):
    aid = rng.choice(sorted(w["accounts"]))
    prompt = rng.choice(["What is the balance of account {a}?", "How much money is in account {a}?"])
    r = s.call("get_balance", account_id=aid)
    s.answer(f"Account {aid} has a balance of {_money(r['balance'])} USD.")
    return Draft(prompt.format(a=aid), money(r["balance"], answer_at("get_balance", "balance")),
                 ("balance_by_id", aid), _domains("accounts"))


def stock_by_sku(w, rng, s):
    sku = rng.choice(sorted(w["products"]))
    r = s.call("check_stock", sku=sku)
    s.answer(f"There are {r['in_stock']} units of {sku} in stock.")
    return Draft(f"How many units of product {sku} are in stock?",
                 number(r["in_stock"], answer_at("check_stock", "in_stock")),
                 ("stock_by_sku", sku), _domains("shop"))


def order_status_by_id(w, rng, s):
    oid = rng.choice(sorted(w["orders"]))
    r = s.call("get_order_status", order_id=oid)
    s.answer(f"Order {oid} is {r['status']}.")
    return Draft(f"What is the status of order {oid}?",
                 choice(r["status"], ORDER_STATUSES, answer_at("get_order_status", "status")),
                 ("order_status_by_id", oid), _domains("shop"))


def convert_units(w, rng, s):
    src_unit, dst = rng.choice(UNIT_PAIRS)
    value = rng.choice([rng.randint(1, 500), rng.randint(1, 200) + 0.5])
    r = s.call("convert", value=value, from_unit=src_unit, to_unit=dst)
    s.answer(f"{value} {UNIT_WORDS[src_unit]} is {r['value']:.2f} {UNIT_WORDS[dst]}.")
    return Draft(f"How many {UNIT_WORDS[dst]} is {value} {UNIT_WORDS[src_unit]}?",
                 number(r["value"], answer_at("convert", "value"), abs_tol=0.01, rel_tol=0.005),
                 ("convert", src_unit, dst, value),
                 _domains("convert"))


def events_count(w, rng, s):
    date = rng.choice(sorted({e["date"] for e in w["events"].values()}))
    r = s.call("list_events", date=date)
    s.answer(f"You have {len(r['events'])} events on {date}.")
    return Draft(f"How many events are on my calendar on {date}?",
                 number(len(r["events"]), answer_at("list_events", "events", "#len")),
                 ("events_count", date), _domains("calendar"))


# ---- level 2: dependent lookups ---------------------------------------------------------------
def balance_by_owner(w, rng, s):
    aid = rng.choice(sorted(w["accounts"]))
    owner, typ = w["accounts"][aid]["owner"], w["accounts"][aid]["type"]
    r = s.call("find_accounts", owner=owner)
    found = next(a["account_id"] for a in r["accounts"] if a["type"] == typ)
    b = s.call("get_balance", account_id=found)
    s.answer(f"{owner}'s {typ} account ({found}) has {_money(b['balance'])} USD.")
    return Draft(f"What is the balance of {owner}'s {typ} account?",
                 money(b["balance"], answer_at("get_balance", "balance")),
                 ("balance_by_owner", owner, typ), _domains("accounts"))


def stock_by_name(w, rng, s):
    name = w["products"][rng.choice(sorted(w["products"]))]["name"]
    r = s.call("search_products", query=name)
    sku = next(p["sku"] for p in r["products"] if p["name"] == name)
    st = s.call("check_stock", sku=sku)
    s.answer(f"There are {st['in_stock']} units of the {name} ({sku}) in stock.")
    return Draft(f"How many units of the {name} are in stock?",
                 number(st["in_stock"], answer_at("check_stock", "in_stock")),
                 ("stock_by_name", name), _domains("shop"))


def latest_order_status(w, rng, s):
    name = w["customers"][rng.choice(sorted(w["customers"]))]["name"]
    c = s.call("find_customer", name=name)
    orders = s.call("list_orders", customer_id=c["customer_id"])["orders"]
    last = max(orders, key=lambda o: o["placed_on"])
    s.answer(f"{name}'s most recent order {last['order_id']} is {last['status']}.")
    return Draft(f"What is the status of {name}'s most recent order?",
                 choice(last["status"], ORDER_STATUSES,
                        answer_at("list_orders", "orders", "#max_by:placed_on", "status")),
                 ("latest_order_status", name), _domains("shop"))


def event_location(w, rng, s):
    eid = rng.choice(sorted(w["events"]))
    date, title = w["events"][eid]["date"], w["events"][eid]["title"]
    evs = s.call("list_events", date=date)["events"]
    found = next(e["event_id"] for e in evs if e["title"] == title)
    d = s.call("get_event", event_id=found)
    s.answer(f"'{title}' on {date} is at {d['location']}.")
    return Draft(f"Where is the '{title}' event on {date} taking place?",
                 choice(d["location"], LOCATIONS, answer_at("get_event", "location")),
                 ("event_location", title, date), _domains("calendar"))


def price_in_currency(w, rng, s):
    name = w["products"][rng.choice(sorted(w["products"]))]["name"]
    cur = rng.choice(["EUR", "GBP"])
    r = s.call("search_products", query=name)
    price = next(p["price"] for p in r["products"] if p["name"] == name)
    c = s.call("convert", value=price, from_unit="USD", to_unit=cur)
    s.answer(f"The {name} costs {price} USD, which is {c['value']:.2f} {cur}.")
    return Draft(f"How much does the {name} cost in {UNIT_WORDS[cur]}?",
                 number(c["value"], answer_at("convert", "value"), abs_tol=0.01, rel_tol=0.005),
                 ("price_in_currency", name, cur),
                 _domains("shop", "convert"))


# ---- level 3: state changes -------------------------------------------------------------------
def _two_owners(w, rng, min_balance):
    rich = sorted(k for k, a in w["accounts"].items() if a["balance"] >= min_balance)
    if not rich:
        return None
    src = rng.choice(rich)
    others = sorted(k for k, a in w["accounts"].items() if a["owner"] != w["accounts"][src]["owner"])
    return src, rng.choice(others)


def transfer_between_owners(w, rng, s):
    pair = _two_owners(w, rng, 100)
    if pair is None:
        return None
    src, dst = (w["accounts"][k] for k in pair)
    amount = round(rng.randint(10, int(min(500, src["balance"] / 2))) + rng.choice([0, 0.5, 0.25]), 2)
    a, b = src["owner"], dst["owner"]
    ra, rb = s.parallel(("find_accounts", {"owner": a}), ("find_accounts", {"owner": b}))
    ida = next(x["account_id"] for x in ra["accounts"] if x["type"] == src["type"])
    idb = next(x["account_id"] for x in rb["accounts"] if x["type"] == dst["type"])
    t = s.call("transfer", from_account_id=ida, to_account_id=idb, amount=amount)
    s.answer(f"Done: transferred {_money(amount)} USD ({t['transfer_id']}). {a}'s {src['type']} account "
             f"now has {_money(t['from_balance'])} USD.")
    return Draft(f"Transfer {_money(amount)} USD from {a}'s {src['type']} account to {b}'s {dst['type']} "
                 f"account, then tell me the new balance of {a}'s {src['type']} account.",
                 money(t["from_balance"], answer_at("transfer", "from_balance")),
                 ("transfer", a, src["type"], b, dst["type"]),
                 _domains("accounts"))


def pay_in_currency(w, rng, s):
    pair = _two_owners(w, rng, 200)
    if pair is None:
        return None
    src, dst = (w["accounts"][k] for k in pair)
    cur = rng.choice(["EUR", "GBP"])
    value = rng.randint(5, int(min(300, src["balance"] / 2 / 1.27)))
    a, b = src["owner"], dst["owner"]
    usd = s.call("convert", value=value, from_unit=cur, to_unit="USD")["value"]
    ra, rb = s.parallel(("find_accounts", {"owner": a}), ("find_accounts", {"owner": b}))
    ida = next(x["account_id"] for x in ra["accounts"] if x["type"] == src["type"])
    idb = next(x["account_id"] for x in rb["accounts"] if x["type"] == dst["type"])
    t = s.call("transfer", from_account_id=ida, to_account_id=idb, amount=usd)
    s.answer(f"{value} {cur} is {_money(t['amount'])} USD; I sent {_money(t['amount'])} USD from {a}'s "
             f"{src['type']} account to {b}'s {dst['type']} account.")
    return Draft(f"Send the equivalent of {value} {UNIT_WORDS[cur]} in US dollars from {a}'s {src['type']} "
                 f"account to {b}'s {dst['type']} account, and tell me how many US dollars were sent.",
                 money(t["amount"], answer_at("transfer", "amount")), ("pay_in_currency", a, b, cur),
                 _domains("accounts", "convert"))


def order_product(w, rng, s):
    name = w["customers"][rng.choice(sorted(w["customers"]))]["name"]
    sku0 = rng.choice(sorted(w["products"]))
    product, stock = w["products"][sku0]["name"], w["products"][sku0]["stock"]
    enough = stock > 0 and rng.random() < 0.6
    qty = rng.randint(1, min(stock, 5)) if enough else stock + rng.randint(1, 5)
    cid = s.call("find_customer", name=name)["customer_id"]
    sku = next(p["sku"] for p in s.call("search_products", query=product)["products"] if p["name"] == product)
    # check_stock is one way to learn the stock; a failed place_order reports it too.
    st = s.call("check_stock", required=False, sku=sku)["in_stock"]
    prompt = (f"{name} wants {qty} units of the {product}. If enough are in stock, place the order and tell "
              f"me the order id; otherwise tell me how many units are in stock.")
    if st >= qty:
        o = s.call("place_order", customer_id=cid, sku=sku, quantity=qty)
        s.answer(f"Order placed for {name}: {o['order_id']} ({qty} x {product}, total {_money(o['total'])} USD).")
        ans = token(o["order_id"], answer_at("place_order", "order_id"))
    else:
        s.answer(f"Not enough stock: only {st} units of the {product} are available, so no order was placed.")
        ans = number(st, answer_at("check_stock", "in_stock"), answer_at("place_order", "error", "#int"))
    return Draft(prompt, ans, ("order_product", name, product), _domains("shop"))


def cancel_latest_open_order(w, rng, s):
    open_by = sorted({o["customer_id"] for o in w["orders"].values() if o["status"] == "placed"})
    if not open_by:
        return None
    name = w["customers"][rng.choice(open_by)]["name"]
    cid = s.call("find_customer", name=name)["customer_id"]
    orders = s.call("list_orders", customer_id=cid)["orders"]
    last = max((o for o in orders if o["status"] == "placed"), key=lambda o: o["placed_on"])
    r = s.call("cancel_order", order_id=last["order_id"])
    s.answer(f"Cancelled {name}'s order {last['order_id']}; the refund is {_money(r['refund'])} USD.")
    return Draft(f"Cancel {name}'s most recent order that has not shipped yet, and tell me the refund amount.",
                 money(r["refund"], answer_at("cancel_order", "refund")), ("cancel_latest_open_order", name),
                 _domains("shop"))


def reschedule(w, rng, s):
    dates = sorted({e["date"] for e in w["events"].values()})
    d1, d2 = rng.sample(dates, 2)
    busy2 = [(e["start"], e["end"]) for e in w["events"].values() if e["date"] == d2]
    free = [h for h in range(9, 17) if all(not (a < f"{h + 1:02d}:00" and f"{h:02d}:00" < b) for a, b in busy2)]
    if not free:
        return None
    title = rng.choice(sorted(e["title"] for e in w["events"].values() if e["date"] == d1))
    evs1 = s.call("list_events", date=d1)["events"]
    old = next(e["event_id"] for e in evs1 if e["title"] == title)
    s.call("list_events", date=d2)
    start, end = f"{free[0]:02d}:00", f"{free[0] + 1:02d}:00"
    new = s.call("create_event", title=title, date=d2, start=start, end=end)
    s.call("cancel_event", event_id=old)
    s.answer(f"Moved '{title}' from {d1} to {d2} at {start}-{end} (new id {new['event_id']}).")
    return Draft(f"Move the '{title}' event from {d1} to the earliest free one-hour slot between 09:00 and "
                 f"17:00 on {d2}, and tell me its new start time.", token(start, answer_at("create_event", "start")),
                 ("reschedule", title, d1, d2), _domains("calendar"))


# ---- level 4 "rules": later responses follow from earlier ones and the documented rules --------
LIST_NAMES = ["groceries", "packing", "reading", "todo", "gifts"]
LIST_ITEMS = ["milk", "eggs", "rice", "apples", "tea", "soap", "charger", "socks", "map", "batteries"]
NOTE_TITLES = ["Call the bank", "Book flights", "Renew passport", "Pay rent", "Water plants", "Team lunch"]
NOTE_TEXTS = ["before Friday", "ask about fees", "check the deadline", "bring the receipt", "twice a week"]


def _amount(rng) -> float:
    return rng.randint(10, 500) + rng.choice([0, 0.5, 0.25])


def deposit_and_confirm(w, rng, s):
    aid, amount = rng.choice(sorted(w["accounts"])), _amount(rng)
    s.call("get_balance", account_id=aid)
    s.call("deposit", account_id=aid, amount=amount)
    b = s.call("get_balance", account_id=aid)
    s.answer(f"After the deposit of {_money(amount)} USD, account {aid} has {_money(b['balance'])} USD.")
    return Draft(f"Check the balance of account {aid}, deposit {_money(amount)} USD into it, then check the "
                 f"balance again and tell me the new balance.",
                 money(b["balance"], answer_at("get_balance", "balance")),
                 ("deposit_and_confirm", aid), _domains("accounts", "ledger"))


def foreign_deposit(w, rng, s):
    aid, cur = rng.choice(sorted(w["accounts"])), rng.choice(["EUR", "GBP", "JPY"])
    value = rng.randint(5, 300) * (100 if cur == "JPY" else 1)
    s.call("get_balance", account_id=aid)
    usd = s.call("exchange", amount=value, from_currency=cur, to_currency="USD")["converted"]
    s.call("deposit", account_id=aid, amount=usd)
    b = s.call("get_balance", account_id=aid)
    s.answer(f"{value} {cur} is {_money(usd)} USD; after depositing it, account {aid} has {_money(b['balance'])} USD.")
    return Draft(f"Account {aid} holds US dollars. Check its balance, convert {value} {cur} to USD with the "
                 f"exchange tool, deposit the result into the account, and tell me its new balance.",
                 money(b["balance"], answer_at("get_balance", "balance")),
                 ("foreign_deposit", aid, cur), _domains("accounts", "ledger"))


def list_then_count(w, rng, s):
    name, items = rng.choice(LIST_NAMES), rng.sample(LIST_ITEMS, rng.randint(2, 3))
    for item in items:
        s.call("add_to_list", list_name=name, item=item)
    r = s.call("get_list", list_name=name)
    s.answer(f"Your '{name}' list now has {len(r['items'])} items: {', '.join(r['items'])}.")
    return Draft(f"Add {', '.join(items[:-1])} and {items[-1]} to my '{name}' list in this order, one item per call, then "
                 f"read the list back and tell me how many items it has.",
                 number(len(r["items"]), answer_at("get_list", "items", "#len"), answer_at("add_to_list", "count")),
                 ("list_then_count", name, tuple(sorted(items))), _domains("ledger"))


def note_roundtrip(w, rng, s):
    title, text = rng.choice(NOTE_TITLES), rng.choice(NOTE_TEXTS)
    c = s.call("create_note", title=title, text=text)
    s.call("get_note", note_id=c["note_id"])
    s.answer(f"Saved the note '{title}' as {c['note_id']}.")
    return Draft(f"Save a note titled '{title}' with the text '{text}', then open it by its id to check it "
                 f"was saved, and tell me the note's id.",
                 token(c["note_id"], answer_at("get_note", "note_id"), answer_at("create_note", "note_id")),
                 ("note_roundtrip", title, text), _domains("ledger"))


def due_date_note(w, rng, s):
    start = rules.days_added("2026-01-01", rng.randint(0, 330))["date"]
    days = rng.choice([14, 30, 45, 60, 90])
    due = s.call("add_days", date=start, days=days)
    s.call("create_note", title="Invoice due", text=due["date"])
    s.answer(f"The invoice is due on {due['date']} ({due['weekday']}); I saved a note.")
    return Draft(f"An invoice dated {start} is due {days} days later. Compute the due date with add_days, save "
                 f"a note titled 'Invoice due' whose text is the due date, and tell me the due date.",
                 token(due["date"], answer_at("add_days", "date")),
                 ("due_date_note", start, days), _domains("ledger"))


TEMPLATES: dict[int, list[Callable]] = {
    0: [easy],
    1: [balance_by_id, stock_by_sku, order_status_by_id, convert_units, events_count],
    2: [balance_by_owner, stock_by_name, latest_order_status, event_location, price_in_currency],
    3: [transfer_between_owners, pay_in_currency, order_product, cancel_latest_open_order, reschedule],
    4: [deposit_and_confirm, foreign_deposit, list_then_count, note_roundtrip, due_date_note],
}
RULES_LEVEL = 4           # the "rules" family: `consistent` also checks the documented rules


# The tool families each template can use (None: level 0 picks any single tool; `generate` checks
# every draft's tools anyway, so this map only decides which templates rotate under a family filter).
TEMPLATE_FAMILIES: dict[str, frozenset[str] | None] = {
    "easy": None,
    "balance_by_id": frozenset({"accounts"}), "stock_by_sku": frozenset({"shop"}),
    "order_status_by_id": frozenset({"shop"}), "convert_units": frozenset({"convert"}),
    "events_count": frozenset({"calendar"}),
    "balance_by_owner": frozenset({"accounts"}), "stock_by_name": frozenset({"shop"}),
    "latest_order_status": frozenset({"shop"}), "event_location": frozenset({"calendar"}),
    "price_in_currency": frozenset({"shop", "convert"}),
    "transfer_between_owners": frozenset({"accounts"}), "pay_in_currency": frozenset({"accounts", "convert"}),
    "order_product": frozenset({"shop"}), "cancel_latest_open_order": frozenset({"shop"}),
    "reschedule": frozenset({"calendar"}),
    "deposit_and_confirm": frozenset({"accounts", "ledger"}), "foreign_deposit": frozenset({"accounts", "ledger"}),
    "list_then_count": frozenset({"ledger"}), "note_roundtrip": frozenset({"ledger"}),
    "due_date_note": frozenset({"ledger"}),
}
_FAMILY_OF = {t: d for d, ts in DOMAINS.items() for t in ts}


def templates_for(level: int, families: frozenset[str] | None = None) -> list[Callable]:
    """The templates of `level` that can produce a task within `families` (None: all)."""
    if families is None:
        return TEMPLATES[level]
    return [t for t in TEMPLATES[level]
            if TEMPLATE_FAMILIES[t.__name__] is None or TEMPLATE_FAMILIES[t.__name__] <= families]


def split_of(combo: tuple) -> str:
    h = int(hashlib.sha256(json.dumps(combo, default=str).encode()).hexdigest()[:8], 16)
    return "test" if h % TEST_BUCKETS == 0 else "train"


def generate(split: str, level: int, index: int, suite_seed: int = 0,
             families: frozenset[str] | None = None) -> dict[str, Any]:
    """The `index`-th task of (split, level): a dict with prompt, world_seed, gold messages, checks.

    Templates rotate with the index; the template's choices (and every few draws the world) are
    re-drawn until the template applies and its entity combination falls in `split`'s buckets
    (about 1 in 5 draws for test, 4 in 5 for train). families: only tasks whose exposed and called
    tools all belong to these tool families (None: any)."""
    templates = templates_for(level, families)
    if not templates:
        raise ValueError(f"level {level} has no task using only the tool families {sorted(families)}")
    template = templates[index % len(templates)]
    for attempt in range(1000):
        h = hashlib.sha256(f"builtin|{suite_seed}|{split}|{level}|{index}|{attempt}".encode()).hexdigest()
        if attempt % WORLD_REUSE == 0:  # re-draw entities in one world a few times before a new world
            world_seed = int(h[:15], 16) * 2 + (split == "test")   # disjoint seed spaces: even/odd
            blob = json.dumps(make_world(world_seed))
        world = json.loads(blob)
        script = Script(world)
        draft = template(world, random.Random(h), script)
        if draft is None or split_of(draft.combo) != split:
            continue
        if families is not None and not {_FAMILY_OF[t] for t in draft.tools} | {
                _FAMILY_OF[c["function"]["name"]] for m in script.messages for c in m.get("tool_calls") or []
        } <= families:
            continue
        for req in script.required:   # an argument the request states is not traced
            src = {}
            for k, v in req.pop("sources", {}).items():
                if _stated_in(req["arguments"][k], draft.prompt):
                    continue
                stated = {a: x for a, x in v["args"].items() if _stated_in(x, draft.prompt)}
                beside = {a: x for a, x in v["with"].items() if _stated_in(x, draft.prompt)}
                src[k] = {"tool": v["tool"], "key": v["key"], "args": stated, "with": beside}
            if src:
                req["sources"] = src
        return {"prompt": draft.prompt, "world_seed": world_seed, "level": level,
                "template": template.__name__, "tools": draft.tools, "answer": draft.answer,
                "rules": level == RULES_LEVEL, "required_calls": script.required, "n_calls": script.n_calls,
                "state_digest": state_digest(world), "combo": list(draft.combo),
                "gold": script.messages}
    raise RuntimeError(f"could not generate task {index} of level {level} ({template.__name__}) for "
                       f"split {split!r} in 1000 draws")
