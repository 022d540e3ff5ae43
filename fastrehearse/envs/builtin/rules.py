"""The documented rules of the builtin ledger tools, as pure functions (the handlers in tools.py
compute with them, so a real episode follows every rule by construction). What an episode's
responses reveal and the grading against these rules: expectations.py. The rules, each stated in
the tool's description (tools.SCHEMAS):

  every tool    a field that echoes an argument (tools.RESPONSES "echo") carries it
  get_balance   balance = the account's last balance the episode revealed (an earlier get_balance,
                a transfer's from/to_balance), plus the deposits made since
  transfer      from_balance / to_balance = those balances -/+ the amount, when revealed before
  deposit       amount = the argument rounded to cents (the balance grows by it)
  exchange      converted = amount * rate(from) / rate(to) rounded to cents (RATES), currency = to
  add_days      date = date + days (Gregorian), weekday = that date's weekday
  add_to_list   count = the items added to that list earlier in the episode + 1 (lists start empty)
  get_list      items = the items added to that list earlier in the episode, in order
  create_note   created_on = TODAY (the note id is hidden)
  get_note      title / text / created_on = those of the create_note that returned that id
"""
from __future__ import annotations

import datetime
from typing import Any


RATES = {"USD": 1.0, "EUR": 1.08, "GBP": 1.27, "JPY": 0.0067}   # value of one unit in USD
RATES_TEXT = ", ".join(f"1 {c} = {r} USD" for c, r in RATES.items() if c != "USD")
WEEKDAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]


def exchanged(amount: float, from_currency: str, to_currency: str) -> float:
    return round(amount * RATES[from_currency] / RATES[to_currency], 2)


def balance_after(balance: float, amount: float) -> float:
    return round(balance + round(amount, 2), 2)


def days_added(date: str, days: int) -> dict:
    """{"date", "weekday"} of `date` + `days`; ValueError for an invalid date or one out of range."""
    try:
        d = datetime.date.fromisoformat(date) + datetime.timedelta(days=days)
    except OverflowError:
        raise ValueError("date out of range") from None
    return {"date": d.isoformat(), "weekday": WEEKDAYS[d.weekday()]}


def list_key(name: str) -> str:
    return name.strip().casefold()


def _num(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def same(expected: Any, got: Any) -> bool:
    """Rule equality: strings case-insensitively, numbers to the cent, lists element-wise."""
    if isinstance(expected, list):
        return isinstance(got, list) and len(got) == len(expected) and all(map(same, expected, got))
    if isinstance(expected, str):
        return isinstance(got, str) and expected.strip().casefold() == got.strip().casefold()
    if _num(expected) is not None:
        g = _num(got)
        return g is not None and abs(g - expected) < 0.005 + 1e-9
    return expected == got
