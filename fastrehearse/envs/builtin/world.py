"""The builtin suite's world: a small seeded database (accounts, shop, calendar) as plain dicts.

A world is a pure function of its seed, so an environment, a task generator and a scorer can each
rebuild the same world and agree on every id, price and balance. Everything is JSON-serializable
(money rounded to cents) so the final state can be digested and compared exactly.
"""
from __future__ import annotations

import hashlib
import json
import random
from typing import Any

FIRST = ["Alice", "Bob", "Carla", "Deepak", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jonas",
         "Kemi", "Liam", "Maya", "Nikolai", "Olga", "Pablo", "Quinn", "Rosa", "Sven", "Tara"]
LAST = ["Chen", "Li", "Garcia", "Okafor", "Novak", "Silva", "Kim", "Larsen", "Haddad", "Moreau",
        "Rossi", "Tanaka", "Walsh", "Yilmaz", "Kowalski", "Ito", "Mensah", "Petrov", "Dubois", "Patel"]
COLORS = ["red", "blue", "green", "black", "white", "silver", "orange", "purple"]
NOUNS = ["widget", "gadget", "lamp", "kettle", "backpack", "notebook", "headset", "mug"]
EVENT_TITLES = ["Team sync", "Design review", "1:1 with manager", "Budget planning", "Customer call",
                "Sprint retro", "Lunch with Sam", "Dentist", "Hiring panel", "Product demo"]
LOCATIONS = ["Room A", "Room B", "Cafe", "Online", "HQ lobby", "Lab 2"]
ORDER_STATUSES = ["placed", "shipped", "delivered", "cancelled"]
TODAY = "2026-12-01"          # placed_on of orders created during an episode
NEW_ID_BASE = 9000            # ids created during an episode start here; seeded ids are 1000-8999
ALL_NAMES = [f"{f} {l}" for f in FIRST for l in LAST]
ALL_PRODUCTS = [f"{c} {n}" for c in COLORS for n in NOUNS]


def make_world(seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    used: set[int] = set()

    def new_id(prefix: str) -> str:
        while True:
            n = rng.randint(1000, NEW_ID_BASE - 1)
            if n not in used:
                used.add(n)
                return f"{prefix}{n}"

    names = rng.sample(ALL_NAMES, 6)
    accounts = {}
    for name in names[:5]:
        for typ in rng.sample(["checking", "savings"], rng.choice([1, 2])):
            accounts[new_id("AC")] = {"owner": name, "type": typ,
                                      "balance": round(rng.uniform(50, 5000), 2), "currency": "USD"}
    customers = {new_id("CU"): {"name": name} for name in rng.sample(names, 4)}
    products = {}
    for name in rng.sample(ALL_PRODUCTS, 6):
        products[new_id("SK")] = {"name": name, "price": round(rng.uniform(2, 200), 2),
                                  "stock": rng.randint(0, 40)}
    orders = {}
    days = rng.sample(range(1, 300), 8)            # distinct placement days -> a unique "most recent"
    cust_ids, skus = list(customers), list(products)
    for i, day in enumerate(days):
        # Each customer gets >= 1 order so "latest order of <customer>" is always defined.
        cid = cust_ids[i] if i < len(cust_ids) else rng.choice(cust_ids)
        orders[new_id("OR")] = {"customer_id": cid, "sku": rng.choice(skus), "quantity": rng.randint(1, 5),
                                "status": rng.choice(ORDER_STATUSES), "placed_on": _date_of_day(day)}
    events = {}
    for day in rng.sample(range(1, 300), 3):
        date = _date_of_day(day)
        hours = sorted(rng.sample(range(8, 18), rng.randint(2, 4)))
        for title, h in zip(rng.sample(EVENT_TITLES, len(hours)), hours):
            events[new_id("EV")] = {"title": title, "date": date, "start": f"{h:02d}:00",
                                    "end": f"{h + 1:02d}:00", "location": rng.choice(LOCATIONS),
                                    "attendees": sorted(rng.sample(names, rng.randint(1, 3)))}
    return {"accounts": accounts, "customers": customers, "products": products, "orders": orders,
            "events": events, "next_id": NEW_ID_BASE}


def _date_of_day(day: int) -> str:
    """Day-of-year (1-based, 2026 is not a leap year) -> 'YYYY-MM-DD'."""
    months = [31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31]
    m = 0
    while day > months[m]:
        day -= months[m]
        m += 1
    return f"2026-{m + 1:02d}-{day:02d}"


def state_digest(world: dict[str, Any]) -> str:
    """A short stable hash of the whole database: equal digests <=> equal final states."""
    blob = json.dumps(world, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
