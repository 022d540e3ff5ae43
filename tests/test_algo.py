"""Role-wise GRPO advantages and aggregation weights, against hand-computed values."""
import math

import pytest
import torch

from fastrehearse.algo import (AdvantageConfig, compute_advantages, group_advantages, local_counts,
                               token_weights, with_advantages)
from fastrehearse.data import Episode
from fastrehearse.kernels.roles import Role

C, A, R, O = int(Role.CONTEXT), int(Role.ACT), int(Role.REHEARSE), int(Role.OBSERVED)
ROLES = [C, C, A, A, R, O, A]   # one token of each kind, ACT split around a rehearsed turn


def _ep(task, reward, role_rewards=None, roles=ROLES, **meta):
    return Episode(input_ids=list(range(len(roles))), roles=list(roles), task_id=task, reward=reward,
                   role_rewards=role_rewards or {}, metadata=meta)


def _group():
    # group "a": ACT rewards [1, 0, 0.5]; REHEARSE rewards [0.2 (override), 0, 0.5]
    # group "b": identical rewards -> no signal
    return [_ep("a", 1.0, {R: 0.2}), _ep("a", 0.0), _ep("b", 1.0), _ep("a", 0.5), _ep("b", 1.0)]


def _check_tokens(adv, act, reh):
    want = [0, 0, act, act, reh, 0, act]
    assert adv == pytest.approx(want, abs=1e-12)


def test_group_mean_baseline_per_role_hand_computed():
    adv, stats = compute_advantages(_group())
    # ACT: mean 0.5 -> [0.5, -0.5, 0]; REHEARSE: mean 0.7/3 -> [0.2-0.7/3, -0.7/3, 0.5-0.7/3]
    _check_tokens(adv[0], 0.5, 0.2 - 0.7 / 3)
    _check_tokens(adv[1], -0.5, -0.7 / 3)
    _check_tokens(adv[3], 0.0, 0.5 - 0.7 / 3)
    _check_tokens(adv[2], 0.0, 0.0)
    _check_tokens(adv[4], 0.0, 0.0)
    assert stats.num_groups == 2
    assert stats.zero_std_frac == {"ACT": 0.5, "REHEARSE": 0.5}


def test_advantages_are_returned_and_the_episodes_left_unchanged():
    """compute_advantages reads the episodes; `with_advantages` gives new ones carrying its result
    (what packing reads), the given ones untouched."""
    eps = _group()
    before = [(e.reward, dict(e.role_rewards), dict(e.metadata), e.advantages) for e in eps]
    adv, _ = compute_advantages(eps)
    assert [(e.reward, dict(e.role_rewards), dict(e.metadata), e.advantages) for e in eps] == before
    assert all(e.advantages is None for e in eps)
    new = with_advantages(eps, adv)
    assert [e.advantages for e in new] == adv and all(a is not b for a, b in zip(new, eps))
    assert [(e.input_ids, e.roles, e.task_id, e.reward, e.role_rewards) for e in new] == \
        [(e.input_ids, e.roles, e.task_id, e.reward, e.role_rewards) for e in eps]
    assert all(e.advantages is None for e in eps)
    with pytest.raises(ValueError, match="advantage lists"):
        with_advantages(eps, adv[:-1])


def test_std_normalization_hand_computed():
    adv, _ = compute_advantages(_group(), AdvantageConfig(std_normalize=True, eps=0.0))
    # ACT rewards [1, 0, 0.5]: unbiased std = sqrt((0.25 + 0.25 + 0) / 2) = 0.5
    m = 0.7 / 3
    s = math.sqrt(((0.2 - m) ** 2 + m ** 2 + (0.5 - m) ** 2) / 2)   # REHEARSE [0.2, 0, 0.5]
    _check_tokens(adv[0], 1.0, (0.2 - m) / s)
    _check_tokens(adv[1], -1.0, -m / s)
    _check_tokens(adv[3], 0.0, (0.5 - m) / s)
    # zero-variance group: 0 / (0 + eps) stays 0, never NaN
    adv2, _ = compute_advantages(_group(), AdvantageConfig(std_normalize=True))
    assert adv2[2] == [0.0] * len(ROLES)


def test_leave_one_out_hand_computed():
    adv, _ = compute_advantages(_group(), AdvantageConfig(leave_one_out=True))
    # ACT baselines: mean of the others = [0.25, 0.75, 0.5] -> [0.75, -0.75, 0.0]
    # REHEARSE [0.2, 0, 0.5]: baselines [0.25, 0.35, 0.1] -> [-0.05, -0.35, 0.4]
    _check_tokens(adv[0], 0.75, -0.05)
    _check_tokens(adv[1], -0.75, -0.35)
    _check_tokens(adv[3], 0.0, 0.4)


REAL_ROLES = [C, C, A, A, O, O, A]     # a call executed for real: no REHEARSE token


@pytest.mark.parametrize("loo", [False, True])
def test_role_baseline_only_over_episodes_where_the_role_acted(loo):
    """Hybrid rollouts: real-call episodes (reward 1, no REHEARSE token) must not enter the
    REHEARSE baseline: pooled, every rehearsal gets a negative advantage (the world model collapsed
    that way in the first learning experiment, benchmarks/results/learning_smollm2.*)."""
    eps = [_ep("h", 1.0, roles=REAL_ROLES), _ep("h", 1.0, roles=REAL_ROLES),
           _ep("h", 0.0), _ep("h", 0.5),                     # rehearsed
           _ep("s", 1.0, roles=REAL_ROLES), _ep("s", 0.0)]   # one rehearsal in its group
    adv, stats = compute_advantages(eps, AdvantageConfig(leave_one_out=loo))
    if loo:   # ACT over all 4 of "h": others' means [0.5, 0.5, 0.833.., 0.666..]; REHEARSE over 2
        act, reh = [0.5, 0.5, -2.5 / 3, 0.5 - 2 / 3], [-0.5, 0.5]
    else:     # ACT mean 0.625 over 4; REHEARSE mean 0.25 over the 2 that rehearsed
        act, reh = [0.375, 0.375, -0.625, -0.125], [-0.25, 0.25]
    for got, a in zip(adv[:2], act[:2]):
        assert got == pytest.approx([0, 0, a, a, 0, 0, a], abs=1e-12)
    _check_tokens(adv[2], act[2], reh[0])
    _check_tokens(adv[3], act[3], reh[1])
    # group "s": ACT +-0.5, its single rehearsal has no baseline -> 0 (a lone role has no signal)
    a_s = 1.0 if loo else 0.5
    assert adv[4] == pytest.approx([0, 0, a_s, a_s, 0, 0, a_s], abs=1e-12)
    _check_tokens(adv[5], -a_s, 0.0)
    assert stats.mean_reward["REHEARSE"] == pytest.approx((0.0 + 0.5 + 0.0) / 3)
    assert stats.zero_std_frac == {"ACT": 0.0, "REHEARSE": 0.0}


def test_singleton_group_gets_zero_and_rejects_nonfinite():
    assert group_advantages(torch.tensor([0.7])).tolist() == [0.0]
    with pytest.raises(ValueError, match="non-finite"):
        group_advantages(torch.tensor([1.0, float("nan")]))


class _B:
    def __init__(self, roles, seq_ids):
        self.roles, self.seq_ids = torch.tensor(roles), torch.tensor(seq_ids)


def _batches():
    # seq 0 in batch 0: ACT x2, REHEARSE x1; batch 1: seq 1 ACT x2, seq 2 ACT x3 + OBSERVED x1
    return [_B([C, A, A, R, C], [0, 0, 0, 0, 0]),
            _B([A, C, A, A, A, A, O, C], [1, 1, 1, 2, 2, 2, 2, 2])]


def test_local_counts():
    counts = local_counts(_batches())
    assert counts[0].tolist() == [4, 7, 1, 1]      # tokens per role
    assert counts[1].tolist() == [0, 3, 1, 1]      # episodes having the role


@pytest.mark.parametrize("mode,act_w,reh_w,obs_w", [
    ("token-mean", [1 / 7] * 2 + [1 / 7] * 2 + [1 / 7] * 3, 1.0, 1.0),
    ("seq-mean-token-mean", [1 / 6] * 2 + [1 / 6] * 2 + [1 / 9] * 3, 1.0, 1.0),
    ("seq-mean-token-sum-norm", [1 / 12] * 7, 1 / 4, 1 / 4),
])
def test_aggregation_weights_hand_computed(mode, act_w, reh_w, obs_w):
    bs = _batches()
    w = token_weights(bs, mode, local_counts(bs), norm_len=4)
    assert w[0].tolist() == pytest.approx([0, act_w[0], act_w[1], reh_w, 0])
    assert w[1].tolist() == pytest.approx([act_w[2], 0, act_w[3]] + act_w[4:] + [obs_w, 0])


def _reference_loss(mode, losses, roles, seqs, norm_len):
    """The aggregation formulas written directly, float64, on the full (unsplit) batch."""
    total = 0.0
    for r in (A, R, O):
        sel = [i for i, x in enumerate(roles) if x == r]
        if not sel:
            continue
        if mode == "token-mean":
            total += sum(losses[i] for i in sel) / len(sel)
            continue
        by_seq = {}
        for i in sel:
            by_seq.setdefault(seqs[i], []).append(losses[i])
        if mode == "seq-mean-token-mean":
            total += sum(sum(v) / len(v) for v in by_seq.values()) / len(by_seq)
        else:
            total += sum(sum(v) / norm_len for v in by_seq.values()) / len(by_seq)
    return total


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_split_into_micro_batches_and_ranks_matches_full_batch(mode):
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(1, 30, (9,), generator=g).tolist()
    roles = [torch.randint(0, 4, (n,), generator=g).tolist() for n in lens]
    losses = [torch.randn(n, generator=g, dtype=torch.float64).tolist() for n in lens]
    flat_r = sum(roles, [])
    flat_s = sum([[i] * n for i, n in enumerate(lens)], [])
    flat_l = sum(losses, [])
    want = _reference_loss(mode, flat_l, flat_r, flat_s, 50.0)
    # Two "ranks", each with two micro-batches of whole episodes.
    ranks = [[[0, 3], [5]], [[1, 2, 8], [4, 6, 7]]]
    per_rank = [[_B(sum((roles[i] for i in mb), []), sum(([i] * lens[i] for i in mb), []))
                 for mb in rank] for rank in ranks]
    global_counts = sum(local_counts(bs) for bs in per_rank)
    got = 0.0
    for rank, bs in zip(ranks, per_rank):
        ws = token_weights(bs, mode, global_counts, norm_len=50.0)
        for mb, w in zip(rank, ws):
            l = torch.tensor(sum((losses[i] for i in mb), []), dtype=torch.float64)
            got += float((w.double() * l).sum())
    assert math.isclose(got, want, rel_tol=1e-6)


def test_aggregation_errors():
    with pytest.raises(ValueError, match="aggregation='mean'"):
        token_weights(_batches(), "mean", local_counts(_batches()))
    with pytest.raises(ValueError, match="norm_len"):
        token_weights(_batches(), "seq-mean-token-sum-norm", local_counts(_batches()))
