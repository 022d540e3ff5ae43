"""Pack episodes into token-budget rows (one varlen forward each), balanced and deterministic.

Every micro-batch is one row of at most `max_tokens` token slots holding whole episodes back to
back; attention boundaries travel as `cu_seqlens` (see fastrehearse.model.attention), so no token
is padding and no episode sees another.

Bin packing. Each episode is an item of size n (tokens, the hard capacity) and cost
    c(n) = n + quadratic_coef * n^2
(the linear layers cost ~24 H^2 FLOPs per token and layer, causal attention ~2 n^2 H per
sequence and layer, so quadratic_coef ~= 1 / (12 H); the default assumes H ~= 1024). We look for
few rows B (a multiple of num_ranks): from the lower bound ceil(sum n / max_tokens), up to two more
steps, try
  1. LPT-with-capacity: items by cost, largest first, each into the cheapest row it fits in
     (balances the per-row cost, which is what ranks wait on), then
  2. first-fit-decreasing into B rows (the classic near-optimal packer);
and if none fits, use as many rows as unconstrained first-fit-decreasing opens (it always fits
there). A local move/swap pass then lowers the most expensive row's cost. Ties break by episode
index, so the result is deterministic.
"""
from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Callable, Sequence

import torch

from fastrehearse.data import Episode
from fastrehearse.kernels.roles import Role

from .batch import PackedBatch

OVERLONG_POLICIES = ("error", "truncate_left", "truncate_right")
DEFAULT_QUADRATIC_COEF = 1.0 / (12 * 1024)


def episode_cost(n: int, quadratic_coef: float = DEFAULT_QUADRATIC_COEF) -> float:
    """Relative forward/backward cost of an n-token episode: n + quadratic_coef * n^2."""
    return n + quadratic_coef * n * n


def pack(
    episodes: Sequence[Episode],
    max_tokens: int,
    *,
    num_ranks: int = 1,
    overlong: str = "error",
    quadratic_coef: float = DEFAULT_QUADRATIC_COEF,
) -> list[PackedBatch] | list[list[PackedBatch]]:
    """Pack `episodes` into rows of at most `max_tokens` tokens.

    Returns a list of PackedBatch when num_ranks == 1. When num_ranks > 1 returns one list per rank
    (`result[rank]`), all with the same number of micro-batches, so every rank runs the same number
    of forward/backward passes (FSDP collectives stay matched); micro-batch i of every rank has a
    similar cost. Every episode appears in exactly one batch; `seq_ids` / `episode_indices` index
    into `episodes`.

    overlong: what to do with an episode longer than max_tokens:
      "error" (default) raises ValueError naming the episode and its length;
      "truncate_left" keeps its last max_tokens tokens, "truncate_right" its first max_tokens
      (roles, rollout log-probs and advantages are cut the same way; a warning lists them).
    Episodes are never dropped. An empty episode raises ValueError.
    """
    max_tokens = _positive_int("max_tokens", max_tokens)
    num_ranks = _positive_int("num_ranks", num_ranks)
    if overlong not in OVERLONG_POLICIES:
        raise ValueError(f"overlong must be one of {OVERLONG_POLICIES}, got {overlong!r}")
    if not math.isfinite(quadratic_coef) or quadratic_coef < 0:
        raise ValueError(f"quadratic_coef must be finite and >= 0, got {quadratic_coef!r}")
    episodes = list(episodes)
    if not episodes:
        raise ValueError("episodes is empty: nothing to pack")
    if len(episodes) < num_ranks:
        raise ValueError(f"num_ranks={num_ranks} needs at least one episode per rank, "
                         f"got {len(episodes)} episodes")

    episodes = _check_and_fit(episodes, max_tokens, overlong)
    lengths = [len(ep.input_ids) for ep in episodes]
    bins = assign_bins(lengths, max_tokens, num_ranks=num_ranks,
                       cost=lambda n: episode_cost(n, quadratic_coef))
    batches = [build_packed_batch(episodes, sorted(b)) for b in bins]
    if num_ranks == 1:
        return batches
    # Consecutive rows in cost order form one step (similar cost, so ranks wait little); within a
    # step alternate the direction ("snake") so per-rank totals stay balanced too.
    per_rank: list[list[PackedBatch]] = [[] for _ in range(num_ranks)]
    for step in range(len(batches) // num_ranks):
        group = batches[step * num_ranks:(step + 1) * num_ranks]
        if step % 2:
            group = group[::-1]
        for rank, b in enumerate(group):
            per_rank[rank].append(b)
    return per_rank


def packing_efficiency(batches: Sequence[PackedBatch] | Sequence[Sequence[PackedBatch]],
                       max_tokens: int) -> float:
    """Real tokens / token slots, where each micro-batch offers max_tokens slots.

    (A packed row holds no padding, so "slots" is the budget each forward is sized for: a row that
    is 60% full wastes 40% of a micro-batch.) Accepts pack()'s output for any num_ranks.
    """
    flat = [b for item in batches for b in (item if isinstance(item, (list, tuple)) else [item])]
    if not flat:
        raise ValueError("batches is empty")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    return sum(b.num_tokens for b in flat) / (len(flat) * max_tokens)


def _positive_int(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
        raise ValueError(f"{name} must be a positive int, got {v!r}")
    return int(v)


def _check_and_fit(episodes: list[Episode], max_tokens: int, overlong: str) -> list[Episode]:
    out, truncated = [], []
    for i, ep in enumerate(episodes):
        if not isinstance(ep, Episode):
            raise TypeError(f"episodes[{i}] is a {type(ep).__name__}, expected fastrehearse.data.Episode")
        n = len(ep.input_ids)
        if n == 0:  # Episode() rejects this too, but fields can be mutated after construction
            raise ValueError(f"episodes[{i}] (task_id={ep.task_id!r}) is empty: an episode needs >= 1 token")
        ep.validate()
        if n > max_tokens:
            if overlong == "error":
                raise ValueError(
                    f"episodes[{i}] (task_id={ep.task_id!r}) has {n} tokens > max_tokens={max_tokens}; "
                    f"raise max_tokens or pass overlong='truncate_left' / 'truncate_right'")
            ep = truncate_episode(ep, max_tokens, side="left" if overlong == "truncate_left" else "right")
            truncated.append(f"{i} (task_id={episodes[i].task_id!r}, {n} tokens)")
        out.append(ep)
    if truncated:
        warnings.warn(f"pack: truncated {len(truncated)} episode(s) to max_tokens={max_tokens} "
                      f"({overlong}): {', '.join(truncated)}", stacklevel=3)
    return out


def truncate_episode(ep: Episode, max_tokens: int, side: str) -> Episode:
    """Keep the first (side="right") or last (side="left") max_tokens tokens of every per-token field."""
    if side not in ("left", "right"):
        raise ValueError(f"side must be 'left' or 'right', got {side!r}")
    sl = slice(len(ep.input_ids) - max_tokens, None) if side == "left" else slice(0, max_tokens)
    cut = lambda v: None if v is None else list(v)[sl]  # noqa: E731
    meta = dict(ep.metadata)
    meta["truncated"] = {"side": side, "original_length": len(ep.input_ids)}
    return Episode(input_ids=cut(ep.input_ids), roles=cut(ep.roles), task_id=ep.task_id,
                   reward=ep.reward, rollout_logprobs=cut(ep.rollout_logprobs),
                   role_rewards=dict(ep.role_rewards), advantages=cut(ep.advantages), metadata=meta)


# ----------------------------------------------------------------------------------------------
# Bin assignment (pure python on lengths, so it is easy to test and to reuse)

def assign_bins(lengths: Sequence[int], max_tokens: int, *, num_ranks: int = 1,
                cost: Callable[[int], float] = episode_cost) -> list[list[int]]:
    """Indices of `lengths` grouped into rows of <= max_tokens tokens, len(result) % num_ranks == 0,
    no row empty, rows sorted by cost (largest first, ties by first index)."""
    n_items = len(lengths)
    if any(n < 1 or n > max_tokens for n in lengths):
        raise ValueError(f"every length must be in [1, max_tokens={max_tokens}]")
    if n_items < num_ranks:
        raise ValueError(f"need at least num_ranks={num_ranks} items, got {n_items}")
    costs = [cost(n) for n in lengths]
    # Largest first; the index breaks ties so the order (and the result) is deterministic.
    order = sorted(range(n_items), key=lambda i: (-costs[i], -lengths[i], i))
    lower = _round_up(max(1, -(-sum(lengths) // max_tokens)), num_ranks)
    # First-fit-decreasing always fits into as many rows as it opens unconstrained, so rows in
    # [lower, ffd_rows] are worth trying; a few LPT attempts above `lower`, then FFD's count.
    ffd_rows = _round_up(len(_ffd(order, lengths, n_items, max_tokens, trim=True)), num_ranks)
    if ffd_rows > n_items:  # only when num_ranks rounding overshoots the item count
        raise ValueError(f"cannot give each of {ffd_rows} micro-batches an episode "
                         f"({n_items} episodes, num_ranks={num_ranks})")
    bins = None
    for n_bins in range(lower, ffd_rows, num_ranks):
        bins = _lpt_with_capacity(order, lengths, costs, n_bins, max_tokens)
        if bins is None:
            bins = _ffd(order, lengths, n_bins, max_tokens)
        if bins is not None or n_bins >= lower + 2 * num_ranks:
            break
    if bins is None:
        bins = _lpt_with_capacity(order, lengths, costs, ffd_rows, max_tokens)
    if bins is None:
        bins = _ffd(order, lengths, ffd_rows, max_tokens)
        _fill_empty_rows(bins, lengths)
    _rebalance(bins, lengths, costs, max_tokens)
    bins = [sorted(b) for b in bins]
    bins.sort(key=lambda b: (-sum(costs[i] for i in b), b[0]))
    return bins


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _lpt_with_capacity(order, lengths, costs, n_bins, cap):
    bins: list[list[int]] = [[] for _ in range(n_bins)]
    load = [0] * n_bins
    bcost = [0.0] * n_bins
    for i in order:
        best = None
        for b in range(n_bins):
            if load[b] + lengths[i] <= cap and (best is None or bcost[b] < bcost[best]):
                best = b
        if best is None:
            return None
        bins[best].append(i)
        load[best] += lengths[i]
        bcost[best] += costs[i]
    return bins


def _ffd(order, lengths, n_bins, cap, trim=False):
    """First-fit-decreasing into n_bins rows (None if it does not fit); trim drops unused rows."""
    by_len = sorted(order, key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = [[] for _ in range(n_bins)]
    load = [0] * n_bins
    for i in by_len:
        b = next((b for b in range(n_bins) if load[b] + lengths[i] <= cap), None)
        if b is None:
            return None
        bins[b].append(i)
        load[b] += lengths[i]
    return [b for b in bins if b] if trim else bins


def _fill_empty_rows(bins, lengths):
    """Give every empty row the shortest item of the fullest multi-item row (any item fits an
    empty row), so no rank idles through a micro-batch."""
    for empty in [b for b in bins if not b]:
        donor = max((b for b in bins if len(b) > 1), key=lambda b: (sum(lengths[i] for i in b), -min(b)))
        i = min(donor, key=lambda i: (lengths[i], i))
        donor.remove(i)
        empty.append(i)


def _rebalance(bins, lengths, costs, cap, max_rounds: int = 200):
    """Lower the most expensive row's cost by moving one item out of it, or swapping one item with
    a cheaper one, into the cheapest row where that fits. Stops when no such move helps."""
    for _ in range(max_rounds):
        cs = [sum(costs[i] for i in b) for b in bins]
        ts = [sum(lengths[i] for i in b) for b in bins]
        hi = max(range(len(bins)), key=lambda b: (cs[b], -b))
        move = None
        for lo in sorted(range(len(bins)), key=lambda b: (cs[b], b)):
            if lo == hi:
                continue
            best = None  # (new max of the two rows, item in hi, item in lo or None)
            for i in bins[hi]:
                if len(bins[hi]) > 1 and ts[lo] + lengths[i] <= cap:
                    m = max(cs[hi] - costs[i], cs[lo] + costs[i])
                    if m < cs[hi] - 1e-9 and (best is None or m < best[0]):
                        best = (m, i, None)
                for j in bins[lo]:
                    d = lengths[i] - lengths[j]
                    if costs[j] < costs[i] and ts[lo] + d <= cap and ts[hi] - d <= cap:
                        m = max(cs[hi] - costs[i] + costs[j], cs[lo] + costs[i] - costs[j])
                        if m < cs[hi] - 1e-9 and (best is None or m < best[0]):
                            best = (m, i, j)
            if best is not None:
                move = (lo, best[1], best[2])
                break
        if move is None:
            return
        lo, i, j = move
        bins[hi].remove(i)
        bins[lo].append(i)
        if j is not None:
            bins[lo].remove(j)
            bins[hi].append(j)


# ----------------------------------------------------------------------------------------------

def build_packed_batch(episodes: Sequence[Episode], indices: Sequence[int]) -> PackedBatch:
    """Concatenate episodes[indices] into one PackedBatch row (shifting targets/roles by one)."""
    ids, pos, tgt, roles, adv, oldlp, seq = [], [], [], [], [], [], []
    cu = [0]
    for k in indices:
        ep = episodes[k]
        n = len(ep.input_ids)
        ids.extend(ep.input_ids)
        pos.extend(range(n))
        # Position t predicts token t+1 of the same episode; the last position has no target.
        tgt.extend(ep.input_ids[1:])
        tgt.append(0)
        r = [int(x) for x in ep.roles[1:]] + [int(Role.CONTEXT)]
        roles.extend(r)
        if ep.advantages is not None:
            adv.extend(a if rr != Role.CONTEXT else 0.0 for a, rr in zip(list(ep.advantages[1:]) + [0.0], r))
        else:
            adv.extend([0.0] * n)
        if ep.rollout_logprobs is not None:
            oldlp.extend(list(ep.rollout_logprobs[1:]) + [math.nan])
        else:
            oldlp.extend([math.nan] * n)
        seq.extend([k] * n)
        cu.append(cu[-1] + n)
    return PackedBatch(
        input_ids=torch.tensor(ids, dtype=torch.int64).view(1, -1),
        position_ids=torch.tensor(pos, dtype=torch.int64).view(1, -1),
        cu_seqlens=torch.tensor(cu, dtype=torch.int32),
        max_seqlen=max(b - a for a, b in zip(cu[:-1], cu[1:])),
        targets=torch.tensor(tgt, dtype=torch.int64),
        roles=torch.tensor(roles, dtype=torch.int64),
        advantages=torch.tensor(adv, dtype=torch.float32),
        old_logp=torch.tensor(oldlp, dtype=torch.float32),
        seq_ids=torch.tensor(seq, dtype=torch.int64),
        episode_indices=list(indices),
    )
