"""pack(): layout invariants, balance/determinism, efficiency, and the documented errors."""
import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fastrehearse.data import Episode
from fastrehearse.kernels.roles import Role
from fastrehearse.packing import PackedBatch, assign_bins, pack, packing_efficiency


def make_episode(rng: random.Random, n: int, i: int, *, logprobs=True, advantages=True) -> Episode:
    return Episode(
        input_ids=[rng.randrange(1, 1000) for _ in range(n)],
        roles=[rng.randrange(0, 4) for _ in range(n)],
        task_id=f"task{i}",
        rollout_logprobs=[-rng.random() for _ in range(n)] if logprobs else None,
        advantages=[rng.uniform(-1, 1) for _ in range(n)] if advantages else None,
    )


def lognormal_lengths(rng: random.Random, k: int, lo=200, hi=8000, median=1200, sigma=0.9):
    return [int(min(hi, max(lo, rng.lognormvariate(math.log(median), sigma)))) for _ in range(k)]


def check_layout(batches: list[PackedBatch], episodes: list[Episode], max_tokens: int):
    seen = []
    for b in batches:
        T = b.num_tokens
        assert 1 <= T <= max_tokens
        assert b.input_ids.shape == b.position_ids.shape == (1, T)
        for name in ("targets", "roles", "advantages", "old_logp", "seq_ids"):
            assert getattr(b, name).shape == (T,), name
        assert b.cu_seqlens.dtype == torch.int32 and b.input_ids.dtype == torch.int64
        cu = b.cu_seqlens.tolist()
        assert cu[0] == 0 and cu[-1] == T and len(cu) == len(b.episode_indices) + 1
        assert b.max_seqlen == max(e - s for s, e in zip(cu[:-1], cu[1:]))
        for k, idx in enumerate(b.episode_indices):
            ep, s, e = episodes[idx], cu[k], cu[k + 1]
            n = len(ep)
            assert e - s == n
            assert b.input_ids[0, s:e].tolist() == ep.input_ids
            assert b.position_ids[0, s:e].tolist() == list(range(n))
            assert b.seq_ids[s:e].tolist() == [idx] * n
            # Shift by one inside the episode; the last position never points into the next episode.
            assert b.targets[s:e - 1].tolist() == ep.input_ids[1:]
            assert b.targets[e - 1].item() == 0
            assert b.roles[s:e - 1].tolist() == ep.roles[1:]
            assert b.roles[e - 1].item() == Role.CONTEXT
            assert math.isnan(b.old_logp[e - 1].item())
            assert b.advantages[e - 1].item() == 0.0
            lp = ep.rollout_logprobs[1:] if ep.rollout_logprobs is not None else [math.nan] * (n - 1)
            torch.testing.assert_close(b.old_logp[s:e - 1], torch.tensor(lp, dtype=torch.float32),
                                       equal_nan=True, rtol=0, atol=0)
            adv = ep.advantages[1:] if ep.advantages is not None else [0.0] * (n - 1)
            want = [a if r != Role.CONTEXT else 0.0 for a, r in zip(adv, ep.roles[1:])]
            torch.testing.assert_close(b.advantages[s:e - 1], torch.tensor(want, dtype=torch.float32),
                                       rtol=0, atol=0)
            seen.append(idx)
    assert sorted(seen) == list(range(len(episodes))), "every episode exactly once, none dropped"


def test_layout_and_shift():
    rng = random.Random(0)
    eps = [make_episode(rng, n, i, logprobs=i % 2 == 0, advantages=i % 3 != 0)
           for i, n in enumerate([1, 2, 7, 50, 300, 299, 3, 128, 64, 1, 17])]
    batches = pack(eps, 400)
    check_layout(batches, eps, 400)
    assert len(batches) == 3  # 872 tokens, lower bound ceil(872/400) = 3 reached


def test_deterministic_and_balanced():
    rng = random.Random(1)
    eps = [make_episode(rng, n, i) for i, n in enumerate(lognormal_lengths(rng, 80, 20, 900, 150))]
    a, b = pack(eps, 2048), pack(eps, 2048)
    assert [x.episode_indices for x in a] == [x.episode_indices for x in b]
    for x, y in zip(a, b):
        assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.cu_seqlens, y.cu_seqlens)
    tokens = [x.num_tokens for x in a]
    assert max(tokens) - min(tokens) < 0.15 * 2048, tokens  # balanced rows, not a few full + one stub


def test_num_ranks_equal_counts():
    rng = random.Random(2)
    eps = [make_episode(rng, n, i) for i, n in enumerate(lognormal_lengths(rng, 37, 10, 500, 80))]
    per_rank = pack(eps, 700, num_ranks=3)
    assert len(per_rank) == 3
    assert len({len(r) for r in per_rank}) == 1
    flat = [b for r in per_rank for b in r]
    check_layout(flat, eps, 700)
    assert 0 < packing_efficiency(per_rank, 700) <= 1
    with pytest.raises(ValueError, match=r"num_ranks=4 needs at least one episode per rank, got 3"):
        pack(eps[:3], 700, num_ranks=4)


def test_efficiency_long_tail():
    rng = random.Random(3)
    lengths = lognormal_lengths(rng, 256)
    eps = [make_episode(rng, n, i, logprobs=False, advantages=False) for i, n in enumerate(lengths)]
    batches = pack(eps, 16384)
    eff = packing_efficiency(batches, 16384)
    assert eff == pytest.approx(sum(lengths) / (len(batches) * 16384))
    assert eff >= 0.95, eff


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 100), min_size=1, max_size=60), st.integers(100, 300), st.integers(1, 4))
def test_assign_bins_properties(lengths, cap, ranks):
    if len(lengths) < ranks:
        with pytest.raises(ValueError):
            assign_bins(lengths, cap, num_ranks=ranks)
        return
    try:
        bins = assign_bins(lengths, cap, num_ranks=ranks)
    except ValueError as e:  # allowed only when the rows needed, rounded up to a multiple of
        # num_ranks, outnumber the episodes (some rank would get an empty micro-batch)
        rows = int(str(e).split("each of ")[1].split()[0])
        assert rows > len(lengths) and rows % ranks == 0, str(e)
        assert -(-sum(lengths) // cap) <= rows
        return
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert len(bins) % ranks == 0 and all(bins)
    assert all(sum(lengths[i] for i in b) <= cap for b in bins)
    assert bins == assign_bins(lengths, cap, num_ranks=ranks)


def test_overlong_error_names_episode():
    eps = [Episode([1, 2, 3], [0, 1, 1], "short"), Episode(list(range(20)), [1] * 20, "long")]
    with pytest.raises(ValueError, match=r"episodes\[1\] \(task_id='long'\) has 20 tokens > max_tokens=10"):
        pack(eps, 10)


@pytest.mark.parametrize("policy", ["truncate_left", "truncate_right"])
def test_overlong_truncate(policy):
    rng = random.Random(4)
    long_ep = make_episode(rng, 25, 0)
    eps = [long_ep, make_episode(rng, 4, 1)]
    with pytest.warns(UserWarning, match=r"truncated 1 episode\(s\).*task0"):
        batches = pack(eps, 10, overlong=policy)
    assert sum(len(b.episode_indices) for b in batches) == 2  # nothing dropped
    b = next(b for b in batches if 0 in b.episode_indices)
    k = b.episode_indices.index(0)
    s, e = b.cu_seqlens[k].item(), b.cu_seqlens[k + 1].item()
    keep = slice(15, 25) if policy == "truncate_left" else slice(0, 10)
    assert e - s == 10
    assert b.input_ids[0, s:e].tolist() == long_ep.input_ids[keep]
    assert b.roles[s:e - 1].tolist() == long_ep.roles[keep][1:]
    assert b.roles[e - 1].item() == Role.CONTEXT
    torch.testing.assert_close(b.old_logp[s:e - 1],
                               torch.tensor(long_ep.rollout_logprobs[keep][1:], dtype=torch.float32))
    assert len(long_ep) == 25  # the caller's episode is not mutated


def test_empty_and_bad_arguments():
    with pytest.raises(ValueError, match=r"Episode\(task_id='e'\) is empty"):
        Episode([], [], "e")
    ep = Episode([1, 2], [0, 1], "gone")
    ep.input_ids, ep.roles = [], []  # mutated after construction: pack() must still refuse it
    with pytest.raises(ValueError, match=r"episodes\[1\] \(task_id='gone'\) is empty"):
        pack([Episode([5], [1], "ok"), ep], 8)
    with pytest.raises(ValueError, match="episodes is empty"):
        pack([], 8)
    with pytest.raises(ValueError, match="max_tokens must be a positive int"):
        pack([Episode([5], [1], "ok")], 0)
    with pytest.raises(ValueError, match="overlong must be one of"):
        pack([Episode([5], [1], "ok")], 8, overlong="drop")
    with pytest.raises(TypeError, match=r"episodes\[0\] is a dict"):
        pack([{"input_ids": [1]}], 8)
