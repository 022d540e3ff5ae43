"""Intervals for the learning experiment (benchmarks/bench_learning.py): contrasts between arms
whose runs differ by seed, each run scored on the same held-out items.

  permutation_test(a, b) the PRIMARY test for 4-10 seeds: two-sided p of mean(a) - mean(b) over
                         every relabelling of the pooled seed means into groups of the arms' sizes
                         (exact up to `max_exact` labellings, else Monte Carlo, said in the result);
                         it assumes only exchangeable seeds under "no difference"
  welch(a, b)            secondary: 95% Welch interval for mean(a) - mean(b) over per-seed means (the
                         seed is the unit: items of one run are not independent draws of training).
                         No interval when an arm's seeds all sit on one value (a ceiling or a cap):
                         that is no estimate of its seed spread
  bootstrap(A, B)        95% percentile interval of the same difference, resampling seeds within
                         each arm and, jointly for both arms, the items (paired: the same item ids).
                         With 3-4 seeds its seed part under-covers (its width was 0.5-0.6x Welch's in
                         v3): descriptive only, never the decision
  mde(a, b)              the smallest true difference the Welch test would detect with 80% power at
                         alpha 0.05 given the seed spread seen (after the fact: descriptive)
  mde_planned(sd, n_a, n_b)  the same planning number BEFORE a run, from a pilot's per-seed SD
  seeds_for_mde(sd, target)  the fewest seeds per arm whose planned MDE is <= target
  recovery_ratio(ca, r, w)   (mean(ca) - mean(w)) / (mean(r) - mean(w)) with a Fieller interval
A/B for bootstrap: {seed: {item_id: score}}; a/b for Welch and permutations: per-seed means.
"""
from __future__ import annotations

import itertools
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
    flat = [f"{n} (every seed = {x[0]:g})" for n, x, v in (("a", a, va), ("b", b, vb)) if v == 0]
    if flat:   # Welch would take that arm's spread as 0 and narrow the interval by it
        return {"diff": d, "lo": None, "hi": None, "df": None, "p": None,
                "why": f"no seed spread in arm {flat[0]}: a ceiling or cap, not an estimate of its spread"}
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
    if va == 0 or vb == 0:
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
    return {"diff": d, "lo": lo, "hi": hi, "n_items": len(items),
            "resamples": "seeds within each arm, and items jointly for both arms (paired ids)"}


def permutation_test(a: list[float], b: list[float], *, max_exact: int = 100_000, reps: int = 20_000,
                     seed: int = 0) -> dict:
    """Two-sided permutation test of mean(a) - mean(b) over seed labels: {diff, p, n_labelings,
    exact, reps}. Exact: p = the share of the C(n_a + n_b, n_a) relabellings whose |difference| is at
    least the observed one (the observed labelling counts). Monte Carlo when there are more than
    `max_exact`: p = (1 + hits) / (1 + reps) over `reps` random relabellings (never 0)."""
    if len(a) < 1 or len(b) < 1:
        raise ValueError(f"permutation_test needs >= 1 seed per arm, got {len(a)} and {len(b)}")
    pooled, na = list(a) + list(b), len(a)
    total = sum(pooled)
    n, nb = len(pooled), len(b)

    def diff(sa: float) -> float:
        return sa / na - (total - sa) / nb
    obs = _mean(a) - _mean(b)
    tol = 1e-12 * max(1.0, max(abs(x) for x in pooled))   # ties by float round-off count as ties
    n_lab = math.comb(n, na)
    if n_lab <= max_exact:
        hits = sum(abs(diff(sum(pooled[i] for i in idx))) >= abs(obs) - tol
                   for idx in itertools.combinations(range(n), na))
        return {"diff": obs, "p": hits / n_lab, "n_labelings": n_lab, "exact": True, "reps": None}
    rng = random.Random(seed)
    hits = sum(abs(diff(sum(rng.sample(pooled, na)))) >= abs(obs) - tol for _ in range(reps))
    return {"diff": obs, "p": (1 + hits) / (1 + reps), "n_labelings": n_lab, "exact": False, "reps": reps}


def mde_planned(sd: float, n_a: int, n_b: int, power: float = 0.8, alpha: float = 0.05) -> float:
    """The minimum detectable difference of a two-arm comparison planned before a run: (t_{1-alpha/2}
    + t_{power}) * sd * sqrt(1/n_a + 1/n_b), df = n_a + n_b - 2, with `sd` the per-seed SD of the
    metric measured in a pilot (pooled over the pilot's arms). A normal-theory number for a
    permutation test too (close to it at these sizes)."""
    if not (isinstance(sd, (int, float)) and math.isfinite(sd) and sd > 0):
        raise ValueError(f"mde_planned: sd must be a finite number > 0 (a pilot's seed spread), got {sd!r}")
    if n_a < 2 or n_b < 2:
        raise ValueError(f"mde_planned: >= 2 seeds per arm, got {n_a} and {n_b}")
    df = n_a + n_b - 2
    return (t_ppf(1 - alpha / 2, df) + t_ppf(power, df)) * sd * math.sqrt(1 / n_a + 1 / n_b)


def pooled_sd(*arms: list[float]) -> float:
    """The pooled per-seed SD of a pilot's arms (each with >= 2 seeds)."""
    if not arms or any(len(x) < 2 for x in arms):
        raise ValueError("pooled_sd: every arm needs >= 2 seeds")
    ss = sum(statistics.variance(x) * (len(x) - 1) for x in arms)
    return math.sqrt(ss / sum(len(x) - 1 for x in arms))


def seeds_for_mde(sd: float, target: float, power: float = 0.8, alpha: float = 0.05, max_seeds: int = 64) -> int | None:
    """The fewest seeds per arm (equal arms) whose planned MDE is <= target; None past max_seeds."""
    for n in range(2, max_seeds + 1):
        if mde_planned(sd, n, n, power, alpha) <= target:
            return n
    return None


def recovery_ratio(ca: list[float], r: list[float], w: list[float], level: float = 0.95) -> dict:
    """{ratio, lo, hi, df, why}: rho = (mean(ca) - mean(w)) / (mean(r) - mean(w)), the share of the
    real-reward arm's gain over the warm-up that the rehearsed arm recovers, with a Fieller interval:
    the rho where (N - rho D)^2 <= t^2 (vN - 2 rho c + rho^2 vD), N = mean(ca) - mean(w),
    D = mean(r) - mean(w), vN = s2_ca/n_ca + s2_w/n_w, vD = s2_r/n_r + s2_w/n_w, c = s2_w/n_w (the
    shared warm-up); a one-checkpoint warm-up (len(w) == 1) is a constant (variance 0). t at
    df = min(n - 1) over the arms with >= 2 seeds (conservative). When D is not significantly
    non-zero (D^2 <= t^2 vD) the Fieller set is unbounded: lo/hi None and `why` says so."""
    if len(ca) < 2 or len(r) < 2 or len(w) < 1:
        raise ValueError(f"recovery_ratio: >= 2 seeds of ca and r and >= 1 warm-up value, got "
                         f"{len(ca)}, {len(r)}, {len(w)}")
    vw = statistics.variance(w) / len(w) if len(w) > 1 else 0.0
    N, D = _mean(ca) - _mean(w), _mean(r) - _mean(w)
    vN, vD, c = statistics.variance(ca) / len(ca) + vw, statistics.variance(r) / len(r) + vw, vw
    df = min(len(x) - 1 for x in (ca, r, w) if len(x) > 1)
    t2 = t_ppf(0.5 + level / 2, df) ** 2
    ratio = N / D if D != 0 else None
    qa, qb, qc = D * D - t2 * vD, -2 * (N * D - t2 * c), N * N - t2 * vN
    if qa <= 0:
        return {"ratio": ratio, "lo": None, "hi": None, "df": df,
                "why": "R - warm-up is not significantly non-zero: the Fieller set is unbounded"}
    disc = max(0.0, qb * qb - 4 * qa * qc)
    lo, hi = sorted(((-qb - math.sqrt(disc)) / (2 * qa), (-qb + math.sqrt(disc)) / (2 * qa)))
    return {"ratio": ratio, "lo": lo, "hi": hi, "df": df, "why": None}
