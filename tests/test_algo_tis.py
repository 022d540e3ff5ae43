"""Truncated importance sampling (fastrehearse/algo/tis.py): the weights by hand, and folded into
the fused loss's token_weights they give exactly sum_t w_t c_t l_pg,t (float64 reference, every
token and the gradient checked)."""
import math

import pytest
import torch

from fastrehearse.algo.tis import tis_weights
from fastrehearse.kernels import PolicyLossConfig, linear_policy_loss
from fastrehearse.kernels.roles import Role


def test_weights_by_hand():
    old = torch.tensor([-1.0, -2.0, math.nan, -0.1, -3.0])
    rollout = torch.tensor([-1.5, -1.0, -0.5, math.nan, -5.0])
    w, st = tis_weights(old, rollout, cap=2.0)
    want = [math.exp(0.5), math.exp(-1.0), 1.0, 1.0, 2.0]          # e^2 capped at 2
    assert torch.allclose(w, torch.tensor(want), rtol=0, atol=1e-6)
    assert st["tis_tokens"] == 3
    assert st["tis_ratio_max"] == pytest.approx(math.exp(2.0))
    assert st["tis_ratio_mean"] == pytest.approx((math.exp(0.5) + math.exp(-1) + math.exp(2)) / 3)
    assert st["tis_capped_frac"] == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="cap"):
        tis_weights(old, rollout, cap=0.0)
    with pytest.raises(ValueError, match="differ"):
        tis_weights(old, rollout[:2], cap=2.0)


@pytest.mark.parametrize("kl_coef,entropy_coef", [(0.0, 0.0), (0.05, 0.01)])
def test_pg_weights_give_the_truncated_is_loss_in_float64(kl_coef, entropy_coef):
    """The truncated ratios as the kernel's pg_weights: the float64 loss that weights the
    policy-gradient term alone, the KL penalty and entropy bonus unweighted (what verl and TRL
    do, and what every preset with kl_coef needs on vLLM)."""
    g = torch.Generator().manual_seed(0)
    n, h, v = 40, 8, 32
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, v, (n,), generator=g)
    roles = torch.tensor([int(Role.CONTEXT)] * 5 + [int(Role.ACT)] * 20 + [int(Role.REHEARSE)] * 15)
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    with torch.no_grad():
        logp0 = torch.log_softmax(hidden @ weight.T, -1).gather(1, targets[:, None])[:, 0]
    old = logp0 + 0.05 * torch.randn(n, generator=g, dtype=torch.float64)
    ref_lp = logp0 + 0.1 * torch.randn(n, generator=g, dtype=torch.float64)
    rollout = old + 0.3 * torch.randn(n, generator=g, dtype=torch.float64)
    rollout[[6, 30]] = math.nan                                   # forced tokens: weight 1
    w, _ = tis_weights(old, rollout, cap=1.5)
    counts = torch.bincount(roles, minlength=4).double()
    cfg = PolicyLossConfig(clip_low=0.2, clip_high=0.28, kl_coef=kl_coef, entropy_coef=entropy_coef)
    # the kernel runs in fp32 (its inputs: the float64 values rounded once); the reference in float64
    h32 = hidden.detach().float().requires_grad_()
    w32 = weight.detach().float().requires_grad_()
    out = linear_policy_loss(h32, w32, targets, roles, adv.float(), old.float(), cfg,
                             ref_logp=ref_lp.float(), normalizers=counts, pg_weights=w.float(),
                             backend="torch")
    hidden, weight = h32.double().detach().requires_grad_(), w32.double().detach().requires_grad_()
    # float64 reference: PPO-clip per token times the truncated ratio, + k3 KL - entropy, token-mean
    lsm = torch.log_softmax(hidden @ weight.T, -1)
    logp = lsm.gather(1, targets[:, None])[:, 0]
    ent = -(lsm.exp() * lsm).sum(-1)
    rho = (logp - old).exp()
    l_pg = torch.maximum(-adv * rho, -adv * rho.clamp(1 - 0.2, 1 + 0.28))
    d = ref_lp - logp
    l = w.double() * l_pg + kl_coef * (d.exp() - d - 1) - entropy_coef * ent
    rl = (roles == int(Role.ACT)) | (roles == int(Role.REHEARSE))
    ref = (l / counts[roles])[rl].sum()
    # fp32 tolerance: the kernel's rounding (~1e-7 relative per op over a 32-term softmax)
    assert abs(float(out.loss) - float(ref)) < 1e-5 * max(1.0, abs(float(ref)))
    gh, gw = torch.autograd.grad(out.loss, (h32, w32))
    rh, rw = torch.autograd.grad(ref, (hidden, weight))
    assert torch.allclose(gh.double(), rh, rtol=1e-4, atol=1e-6)
    assert torch.allclose(gw.double(), rw, rtol=1e-4, atol=1e-6)
    # without the weights the loss differs: they matter
    plain = linear_policy_loss(h32.detach(), w32.detach(), targets, roles, adv.float(), old.float(), cfg,
                               ref_logp=ref_lp.float(), normalizers=counts, backend="torch")
    assert abs(float(plain.loss) - float(ref)) > 1e-3


def test_apply_tis_over_batches_gives_each_batch_its_weights():
    from types import SimpleNamespace
    from fastrehearse.algo.tis import apply_tis
    g = torch.Generator().manual_seed(1)
    roles = [torch.tensor([0, 1, 1, 2, 3]), torch.tensor([0, 1, 2, 2])]
    old = [torch.randn(5, generator=g) - 2, torch.randn(4, generator=g) - 2]
    roll = [o + 0.5 * torch.randn(o.shape, generator=g) for o in old]
    roll[0][4] = math.nan
    batches = [SimpleNamespace(roles=r, old_logp=o) for r, o in zip(roles, old)]
    ws, st = apply_tis(batches, roll, cap=1.2)
    for b, r, w in zip(batches, roll, ws):
        tw, _ = tis_weights(b.old_logp, r, 1.2)
        assert torch.equal(w, tw)
    # in float64, as apply_tis computes them: an fp32 subtract + exp + 8-term mean here would
    # round at ~3e-7 relative, a third of the 1e-6 below, in whichever order the CPU sums
    # (docs/tolerances.md)
    ratios = torch.cat([(o.double() - r.double()).exp()[torch.isfinite(r)]
                        for o, r in zip(old, roll)])
    assert st["tis_tokens"] == ratios.numel() == 8
    assert st["tis_ratio_max"] == pytest.approx(float(ratios.max()), rel=1e-6)
    assert st["tis_ratio_mean"] == pytest.approx(float(ratios.mean()), rel=1e-6)


def test_sequence_weights_by_hand():
    """Per episode r_s = exp(sum of its sampled tokens' old - rollout): truncate weights all its
    tokens by min(r_s, C); mask zeroes the episodes with r_s outside [1/C, C]; an episode with no
    sampled token keeps 1."""
    from fastrehearse.algo.tis import sequence_weights
    old = torch.tensor([-1.0, -2.0, math.nan, -0.1, -3.0, -1.0, -1.0], dtype=torch.float64)
    rollout = torch.tensor([-1.5, -1.0, -0.5, math.nan, -5.0, math.nan, -1.2], dtype=torch.float64)
    seq = torch.tensor([0, 0, 0, 1, 1, 2, 3])
    # seq 0: 0.5 - 1.0 = -0.5; seq 1: 2.0 (token 3 not sampled); seq 2: none sampled; seq 3: 0.2
    w, st = sequence_weights(old, rollout, seq, "truncate", 2.0)
    want = [math.exp(-0.5)] * 3 + [2.0] * 2 + [1.0] + [math.exp(0.2)]
    assert torch.allclose(w, torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-12)
    assert st == {"tis_seq_n": 3, "tis_seq_log_ratio_mean": pytest.approx((-0.5 + 2.0 + 0.2) / 3),
                  "tis_seq_affected": 1}
    w, st = sequence_weights(old, rollout, seq, "mask", 2.0)
    assert w.tolist() == [1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0] and st["tis_seq_affected"] == 1
    w, _ = sequence_weights(old, rollout, seq, "mask", 1.5)     # |-0.5| > log 1.5 = 0.405: masked too
    assert w.tolist() == [0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="mode"):
        sequence_weights(old, rollout, seq, "geometric", 2.0)
    with pytest.raises(ValueError, match="> 1 to mask"):
        sequence_weights(old, rollout, seq, "mask", 1.0)


def test_apply_tis_multiplies_token_and_sequence_weights():
    """pg_weights = the token cap's weights x the sequence factors; the token cap off (None)
    leaves the sequence factors alone (and the ratio statistics are still reported)."""
    from types import SimpleNamespace

    from fastrehearse.algo.tis import apply_tis, sequence_weights
    g = torch.Generator().manual_seed(1)
    old = -torch.rand(23, generator=g, dtype=torch.float64) * 3
    rollout = old + torch.randn(23, generator=g, dtype=torch.float64) * 0.5
    rollout[[0, 7]] = math.nan
    seq = torch.tensor([0] * 6 + [1] * 9 + [2] * 8)
    b = SimpleNamespace(old_logp=old, roles=torch.zeros(23), seq_ids=seq)
    (w,), st = apply_tis([b], [rollout], 2.0, "truncate", 1.5)
    tok, _ = tis_weights(old, rollout, 2.0)
    sw, _ = sequence_weights(old, rollout, seq, "truncate", 1.5)
    assert torch.equal(w, tok * sw) and st["tis_seq_n"] == 3 and "tis_ratio_mean" in st
    (w,), st = apply_tis([b], [rollout], None, "mask", 1.5)
    assert torch.equal(w, sequence_weights(old, rollout, seq, "mask", 1.5)[0]) and st["tis_capped_frac"] == 0.0
    (w,), st = apply_tis([b], [rollout], 2.0)
    assert torch.equal(w, tok) and "tis_seq_n" not in st
