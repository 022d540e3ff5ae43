"""A small stateful MCP server: a shop inventory in SQLite, written with the MCP Python SDK.

    python server.py --db inventory.sqlite [--log calls.jsonl] [--faults]

The database is created and seeded (SEED_ITEMS) when the file does not exist; `reset` restores the
seeded state (the fastrehearse config uses it to give each episode its own inventory:
`isolation: reset:reset`). Every tool call is appended to --log as one JSON line (tool, arguments,
pid), so a test can tell which calls reached the server. --faults adds three tools that misbehave
on purpose (crash the process, sleep, answer with an image) for the fault tests.
"""
from __future__ import annotations

import argparse
import json
import os
import sqlite3
import time
from typing import TypedDict

from mcp.server import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.server.mcpserver.utilities.types import Image

SEED_ITEMS = [  # sku, name, category, stock, price
    ("SK101", "red pen", "office", 120, 1.25), ("SK102", "blue pen", "office", 80, 1.25),
    ("SK103", "stapler", "office", 15, 8.99), ("SK104", "paper ream", "office", 40, 5.49),
    ("SK201", "hammer", "tools", 22, 14.5), ("SK202", "screwdriver", "tools", 35, 6.75),
    ("SK203", "tape measure", "tools", 18, 9.2), ("SK204", "wrench", "tools", 9, 12.0),
    ("SK301", "coffee mug", "kitchen", 60, 4.5), ("SK302", "tea kettle", "kitchen", 7, 24.99),
    ("SK303", "cutting board", "kitchen", 26, 11.3), ("SK304", "chef knife", "kitchen", 12, 39.0),
]
CATEGORIES = sorted({c for _, _, c, _, _ in SEED_ITEMS})


class Item(TypedDict):
    sku: str
    name: str
    category: str
    stock: int
    price: float


class Match(TypedDict):
    sku: str
    name: str


class Stock(TypedDict):
    sku: str
    stock: int


class Price(TypedDict):
    sku: str
    price: float


class Value(TypedDict):
    category: str
    items: int
    value: float


def seed(db: sqlite3.Connection) -> None:
    db.execute("DROP TABLE IF EXISTS items")
    db.execute("CREATE TABLE items (sku TEXT PRIMARY KEY, name TEXT, category TEXT, stock INTEGER, price REAL)")
    db.executemany("INSERT INTO items VALUES (?, ?, ?, ?, ?)", SEED_ITEMS)
    db.commit()


def build(db_path: str, log_path: str | None, faults: bool):
    fresh = not os.path.exists(db_path)
    db = sqlite3.connect(db_path, check_same_thread=False)
    if fresh:
        seed(db)
    app = MCPServer("inventory")

    def log(tool: str, **arguments) -> None:
        if log_path:
            with open(log_path, "a") as f:
                f.write(json.dumps({"tool": tool, "arguments": arguments, "pid": os.getpid()}) + "\n")

    def row(sku: str) -> Item:
        r = db.execute("SELECT sku, name, category, stock, price FROM items WHERE sku = ?", (sku.upper(),)).fetchone()
        if r is None:
            raise ToolError(f"unknown sku {sku!r}")
        return Item(sku=r[0], name=r[1], category=r[2], stock=r[3], price=r[4])

    @app.tool()
    def find_item(name: str) -> Match:
        """Find an item by (part of) its name; returns its SKU."""
        log("find_item", name=name)
        rows = db.execute("SELECT sku, name FROM items WHERE name LIKE ? ORDER BY sku",
                          (f"%{name.strip()}%",)).fetchall()
        if not rows:
            raise ToolError(f"no item named like {name!r}")
        if len(rows) > 1:
            raise ToolError(f"{len(rows)} items match {name!r}: {', '.join(n for _, n in rows)}; be more specific")
        return Match(sku=rows[0][0], name=rows[0][1])

    @app.tool()
    def get_item(sku: str) -> Item:
        """An item's name, category, units in stock and unit price (USD)."""
        log("get_item", sku=sku)
        return row(sku)

    @app.tool()
    def add_stock(sku: str, quantity: int) -> Stock:
        """Receive `quantity` units of an item; returns the new stock."""
        log("add_stock", sku=sku, quantity=quantity)
        if quantity <= 0:
            raise ToolError("quantity must be a positive integer")
        it = row(sku)
        db.execute("UPDATE items SET stock = stock + ? WHERE sku = ?", (quantity, it["sku"]))
        db.commit()
        return Stock(sku=it["sku"], stock=it["stock"] + quantity)

    @app.tool()
    def remove_stock(sku: str, quantity: int) -> Stock:
        """Ship `quantity` units of an item; returns the remaining stock."""
        log("remove_stock", sku=sku, quantity=quantity)
        if quantity <= 0:
            raise ToolError("quantity must be a positive integer")
        it = row(sku)
        if quantity > it["stock"]:
            raise ToolError(f"insufficient stock: {it['stock']} units of {it['sku']}")
        db.execute("UPDATE items SET stock = stock - ? WHERE sku = ?", (quantity, it["sku"]))
        db.commit()
        return Stock(sku=it["sku"], stock=it["stock"] - quantity)

    @app.tool()
    def set_price(sku: str, price: float) -> Price:
        """Change an item's unit price (USD)."""
        log("set_price", sku=sku, price=price)
        if price <= 0:
            raise ToolError("price must be positive")
        it = row(sku)
        db.execute("UPDATE items SET price = ? WHERE sku = ?", (round(price, 2), it["sku"]))
        db.commit()
        return Price(sku=it["sku"], price=round(price, 2))

    @app.tool()
    def category_value(category: str) -> Value:
        """Number of items and total stock value (units x price, USD) of a category."""
        log("category_value", category=category)
        rows = db.execute("SELECT stock, price FROM items WHERE category = ?", (category.strip().lower(),)).fetchall()
        if not rows:
            raise ToolError(f"unknown category {category!r}; categories: {', '.join(CATEGORIES)}")
        return Value(category=category.strip().lower(), items=len(rows), value=round(sum(s * p for s, p in rows), 2))

    @app.tool()
    def reset() -> dict:
        """Restore the seeded inventory (used between episodes; not shown to the agent)."""
        log("reset")
        seed(db)
        return {"ok": True}

    if faults:
        @app.tool()
        def crash() -> dict:
            """Exit the server process at once (fault test)."""
            log("crash")
            os._exit(3)

        @app.tool()
        def slow(seconds: float) -> dict:
            """Answer after `seconds` (fault test)."""
            log("slow", seconds=seconds)
            time.sleep(seconds)
            return {"slept": seconds}

        @app.tool()
        def picture() -> Image:
            """An image answer (non-text content test)."""
            log("picture")
            return Image(data=b"\x89PNG\r\n\x1a\nfake", format="png")
    return app


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--db", required=True)
    p.add_argument("--log", default=None)
    p.add_argument("--faults", action="store_true")
    p.add_argument("--http", type=int, default=None, metavar="PORT",
                   help="serve streamable HTTP on 127.0.0.1:PORT/mcp instead of stdio")
    a = p.parse_args()
    app = build(a.db, a.log, a.faults)
    if a.http is None:
        app.run()
    else:
        app.run(transport="streamable-http", host="127.0.0.1", port=a.http)


if __name__ == "__main__":
    main()
