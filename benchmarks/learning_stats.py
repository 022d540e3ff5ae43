"""Intervals for the learning experiment (benchmarks/bench_learning.py): contrasts between arms
whose runs differ by seed, each run scored on the same held-out items.

  welch(a, b)            95% Welch interval for mean(a) - mean(b) over per-seed means (the seed is
                         the unit: items of one run are not independent draws of training)
  bootstrap(A, B)        95% percentile interval of the same difference, resampling seeds within
                         each arm and, jointly for both arms, the items (paired: the same item ids)
  mde(a, b)              the smallest true difference the Welch test would detect with 80% power at
                         alpha 0.05 given the seed spread seen (a normal-theory planning number)
A/B for bootstrap: {seed: {item_id: score}}; a/b for Welch: per-seed means.
"""
from __future__ import annotations

import math
import random
import statistics



def t_cdf(x: float, df: float) -> float:
    """Student t CDF by Simpson integration of the density from 0 (no scipy in the project)."""
    if x < 0:
        return 1.0 - t_cdf(-x, df)
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)
    n = 2000
    h = x / n
    f = [c * (1 + (i * h) ** 2 / df) ** (-(df + 1) / 2) for i in range(n + 1)]
    return 0.5 + h / 3 * (f[0] + f[-1] + 4 * sum(f[1:-1:2]) + 2 * sum(f[2:-1:2]))


def t_ppf(q: float, df: float) -> float:
    """Inverse of t_cdf by bisection (q in (0, 1))."""
    lo, hi = -1e3, 1e3
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_cdf(mid, df) < q else (lo, mid)
    return (lo + hi) / 2


def _mean(xs):
    return sum(xs) / len(xs)


def welch(a: list[float], b: list[float], level: float = 0.95) -> dict:
    """{diff, lo, hi, df, p, why} for mean(a) - mean(b). lo/hi/p None, and `why` says so, when
    either arm has < 2 seeds or neither arm's seeds differ: every seed of both arms on one value
    (e.g. a ceiling) is no evidence that the seed-to-seed spread is zero, and a zero-width t
    interval would claim it is."""
    d = _mean(a) - _mean(b)
    if len(a) < 2 or len(b) < 2:
        return {"diff": d, "lo": None, "hi": None, "df": None, "p": None, "why": "< 2 seeds"}
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    se = math.sqrt(va + vb)
    if se == 0:
        return {"diff": d, "lo": None, "hi": None, "df": None, "p": None, "why": "no seed spread in either arm"}
    df = (va + vb) ** 2 / ((va ** 2 / (len(a) - 1)) + (vb ** 2 / (len(b) - 1)))
    t = t_ppf(0.5 + level / 2, df)
    p = 2 * (1 - t_cdf(abs(d) / se, df))
    return {"diff": d, "lo": d - t * se, "hi": d + t * se, "df": df, "p": p}


def mde(a: list[float], b: list[float], power: float = 0.8, alpha: float = 0.05) -> float | None:
    """(t_{1-alpha/2, df} + t_{power, df}) * SE with the Welch SE and df of these seeds; None when
    Welch is undefined (< 2 seeds, or no seed spread in either arm)."""
    if len(a) < 2 or len(b) < 2:
        return None
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    se = math.sqrt(va + vb)
    if se == 0:
        return None
    df = (va + vb) ** 2 / ((va ** 2 / (len(a) - 1)) + (vb ** 2 / (len(b) - 1)))
    return (t_ppf(1 - alpha / 2, df) + t_ppf(power, df)) * se


def bootstrap(A: dict, B: dict, reps: int = 4000, level: float = 0.95, seed: int = 0) -> dict:
    """{diff, lo, hi} for mean over seeds of (mean over items) in A minus the same in B. Items are
    resampled once per replicate for both arms (the same ids: a paired design); seeds per arm."""
    items = sorted(set.intersection(*[set(s) for s in list(A.values()) + list(B.values())]))
    if not items:
        raise ValueError("bootstrap: the runs share no item id")
    a_runs = [[A[s][i] for i in items] for s in sorted(A)]
    b_runs = [[B[s][i] for i in items] for s in sorted(B)]

    def stat(a_idx, b_idx, it):
        ma = _mean([_mean([a_runs[k][j] for j in it]) for k in a_idx])
        mb = _mean([_mean([b_runs[k][j] for j in it]) for k in b_idx])
        return ma - mb
    full = list(range(len(items)))
    d = stat(range(len(a_runs)), range(len(b_runs)), full)
    rng = random.Random(seed)
    out = sorted(stat([rng.randrange(len(a_runs)) for _ in a_runs], [rng.randrange(len(b_runs)) for _ in b_runs],
                      [rng.randrange(len(items)) for _ in items]) for _ in range(reps))
    lo = out[int((1 - level) / 2 * reps)]
    hi = out[min(reps - 1, int((1 + level) / 2 * reps))]
    return {"diff": d, "lo": lo, "hi": hi, "n_items": len(items)}
