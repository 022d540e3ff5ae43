"""Writes tasks.jsonl for the inventory server: 111 tasks over its seeded data, each with a check
(number / contains / exact), the response field the answer comes from (check.source) and the gold
calls; about one in five is in the test split (fixed by a hash of the id, so reruns agree).

    python make_tasks.py            # rewrites tasks.jsonl beside this file
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from server import CATEGORIES, SEED_ITEMS


def call(tool: str, **arguments) -> dict:
    return {"name": tool, "arguments": arguments}


def number(value, tool: str, field: str, tol: float = 0.0) -> dict:
    return {"type": "number", "value": value, "tol": tol, "source": {"tool": tool, "field": field}}


def category_value(items, category: str) -> float:
    return round(sum(stock * price for _, _, c, stock, price in items if c == category), 2)


def tasks() -> list[dict]:
    out = []
    for i, (sku, name, cat, stock, price) in enumerate(SEED_ITEMS):
        q_add, q_add2, q_rm = 5 + i, 40 + 3 * i, 1 + stock // 3
        q_rm2 = stock                                 # ship everything: remaining 0
        new_price = round(price * 1.1 + 0.05, 2)
        changed = [(s, n, c, st, new_price if s == sku else p) for s, n, c, st, p in SEED_ITEMS]
        out += [
            {"id": f"stock-{sku}", "prompt": f"How many units of the {name} are in stock?",
             "check": number(stock, "get_item", "stock"),
             "gold_calls": [call("find_item", name=name), call("get_item", sku=sku)]},
            {"id": f"price-{sku}", "prompt": f"What is the unit price of item {sku}, in USD?",
             "check": number(price, "get_item", "price", tol=0.005), "gold_calls": [call("get_item", sku=sku)]},
            {"id": f"sku-{sku}", "prompt": f"What is the SKU of the {name}?",
             "check": {"type": "contains", "value": sku, "source": {"tool": "find_item", "field": "sku"}},
             "gold_calls": [call("find_item", name=name)]},
            {"id": f"name-{sku}", "prompt": f"Which product is item {sku}? Answer with its name only.",
             "check": {"type": "exact", "value": name, "source": {"tool": "get_item", "field": "name"}},
             "gold_calls": [call("get_item", sku=sku)]},
            {"id": f"add-{sku}", "prompt": f"We received {q_add} more units of the {name}. Record them and "
                                          f"tell me the new stock.",
             "check": number(stock + q_add, "add_stock", "stock"),
             "gold_calls": [call("find_item", name=name), call("add_stock", sku=sku, quantity=q_add)]},
            {"id": f"add2-{sku}", "prompt": f"Add {q_add2} units to item {sku}. How many are in stock now?",
             "check": number(stock + q_add2, "add_stock", "stock"),
             "gold_calls": [call("add_stock", sku=sku, quantity=q_add2)]},
            {"id": f"ship-{sku}", "prompt": f"Ship {q_rm} units of {sku} and tell me how many remain.",
             "check": number(stock - q_rm, "remove_stock", "stock"),
             "gold_calls": [call("remove_stock", sku=sku, quantity=q_rm)]},
            {"id": f"shipall-{sku}", "prompt": f"Ship all {q_rm2} units of the {name} we have. How many are left?",
             "check": number(0, "remove_stock", "stock"),
             "gold_calls": [call("find_item", name=name), call("remove_stock", sku=sku, quantity=q_rm2)]},
            {"id": f"reprice-{sku}", "prompt": f"Set the price of {sku} to {new_price} USD, then tell me the total "
                                              f"stock value of the {cat} category.",
             "check": number(category_value(changed, cat), "category_value", "value", tol=0.01),
             "gold_calls": [call("set_price", sku=sku, price=new_price), call("category_value", category=cat)]},
        ]
    for cat in CATEGORIES:
        out.append({"id": f"value-{cat}", "prompt": f"What is the total stock value of the {cat} category, in USD?",
                    "check": number(category_value(SEED_ITEMS, cat), "category_value", "value", tol=0.01),
                    "gold_calls": [call("category_value", category=cat)]})
    for t in out:
        t["split"] = "test" if int(hashlib.sha256(t["id"].encode()).hexdigest(), 16) % 5 == 0 else "train"
    return out


if __name__ == "__main__":
    rows = tasks()
    path = Path(__file__).with_name("tasks.jsonl")
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    n_test = sum(r["split"] == "test" for r in rows)
    print(f"wrote {len(rows)} tasks to {path} ({len(rows) - n_test} train, {n_test} test)")
