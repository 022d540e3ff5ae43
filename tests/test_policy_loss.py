"""linear_policy_loss: fused (torch / Triton-interpreted) vs unfused vs a float64 reference,
micro-batch and 2-process invariance, zero-weight / zero-token roles, hand-computed examples."""
import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from _kernel_ref import CONFIDENT_ROW_TOL, confident_rows, ref_policy_loss, rel_err, row_rel_err
from fastrehearse.kernels import (PolicyLossConfig, Role, linear_logprobs, linear_policy_loss)

TOL = 1e-4
PATHS = [(True, "torch"), (True, "triton"), (False, "torch"), (False, "triton")]
# unfused + Triton is linear_logprobs' Triton path (tested on its own): run it in one config only
FAST_PATHS = PATHS[:3]
ACT, REH, OBS, CTX = int(Role.ACT), int(Role.REHEARSE), int(Role.OBSERVED), int(Role.CONTEXT)


pytestmark = pytest.mark.usefixtures("one_thread")


def make_batch(n=80, h=16, v=257, seed=0, noise=0.4, temperature=1.0):
    """Random tokens of all roles; old/ref log-probs near the model's so the clip is often hit.

    advantages/old_logp/ref_logp are NaN at OBSERVED and CONTEXT tokens (as in real rollouts).
    """
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g)
    w = torch.randn(v, h, generator=g) / h ** 0.5
    t = torch.randint(0, v, (n,), generator=g)
    roles = torch.randint(0, 4, (n,), generator=g)
    with torch.no_grad():
        lp, _ = linear_logprobs(x, w, t, temperature=temperature, backend="torch")
    adv = torch.randn(n, generator=g)
    old = lp + noise * torch.randn(n, generator=g)
    ref = lp + noise * torch.randn(n, generator=g)
    rl = (roles == ACT) | (roles == REH)
    nan = torch.full((n,), float("nan"))
    return dict(hidden=x, weight=w, targets=t, roles=roles, advantages=torch.where(rl, adv, nan),
                old_logp=torch.where(rl, old, nan), ref_logp=torch.where(rl, ref, nan))


def run(batch, cfg, fused, backend, **kw):
    x = batch["hidden"].clone().requires_grad_()
    w = batch["weight"].clone().requires_grad_()
    out = linear_policy_loss(x, w, batch["targets"], batch["roles"], batch["advantages"],
                             batch["old_logp"], cfg, ref_logp=batch["ref_logp"], fused=fused,
                             backend=backend, **kw)
    out.loss.backward()
    return out, x.grad, w.grad


def reference(batch, cfg, **kw):
    x = batch["hidden"].double().requires_grad_()
    w = batch["weight"].double().requires_grad_()
    loss = ref_policy_loss(x, w, batch["targets"], batch["roles"], batch["advantages"],
                           batch["old_logp"], batch["ref_logp"], cfg, **kw)
    loss.backward()
    return loss.detach(), x.grad, w.grad


CONFIGS = {
    "clip": PolicyLossConfig(),
    "asym_clip_observed_ce": PolicyLossConfig(clip_low=0.1, clip_high=0.28, w_observed=0.7,
                                              w_rehearse=0.5),
    "dual_clip": PolicyLossConfig(dual_clip=1.25),
    "k1": PolicyLossConfig(kl_coef=0.3, kl_type="k1", w_observed=0.2),
    "k2": PolicyLossConfig(kl_coef=0.3, kl_type="k2"),
    "k2_temp_observed": PolicyLossConfig(kl_coef=0.3, kl_type="k2", temperature=0.7,
                                         w_observed=0.4),
    "k3_entropy_temp": PolicyLossConfig(kl_coef=0.3, kl_type="k3", entropy_coef=0.05,
                                        temperature=0.8, w_observed=1.0, dual_clip=2.0),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_all_paths_match_float64_reference(name):
    cfg = CONFIGS[name]
    batch = make_batch(seed=len(name), temperature=cfg.temperature)
    ref_loss, ref_dx, ref_dw = reference(batch, cfg)
    for fused, backend in (PATHS if name == "k3_entropy_temp" else FAST_PATHS):
        out, dx, dw = run(batch, cfg, fused, backend, chunk_size=16)
        assert abs(out.loss.item() - ref_loss.item()) <= TOL * max(1.0, abs(ref_loss.item()))
        assert rel_err(dx, ref_dx) <= TOL, (fused, backend)
        assert rel_err(dw, ref_dw) <= TOL, (fused, backend)
    # the inputs really exercise the clip (and the dual clip where enabled)
    ms = [out.metrics["act"], out.metrics["rehearse"]]
    share = lambda key: sum(m[key] * m["tokens"] for m in ms) / sum(m["tokens"] for m in ms)  # noqa
    assert 0.15 <= share("clip_frac") <= 0.85
    if cfg.dual_clip is not None and cfg.dual_clip < 1.5:
        assert share("dual_clip_frac") > 0.05


def test_token_weights_match_reference_and_logp_matches_linear_logprobs():
    cfg = PolicyLossConfig(w_observed=0.5, entropy_coef=0.01)
    batch = make_batch(seed=7)
    tw = torch.rand(batch["hidden"].shape[0], generator=torch.Generator().manual_seed(1))
    ref_loss, ref_dx, ref_dw = reference(batch, cfg, token_weights=tw)
    for fused, backend in FAST_PATHS:
        out, dx, dw = run(batch, cfg, fused, backend, token_weights=tw)
        assert abs(out.loss.item() - ref_loss.item()) <= TOL * max(1.0, abs(ref_loss.item()))
        assert rel_err(dx, ref_dx) <= TOL and rel_err(dw, ref_dw) <= TOL
    lp, ent = linear_logprobs(batch["hidden"], batch["weight"], batch["targets"],
                              mask=batch["roles"] != CTX, with_entropy=True)
    assert torch.allclose(out.logp, lp, atol=1e-6) and torch.allclose(out.entropy, ent, atol=1e-6)
    assert not out.logp.requires_grad


@pytest.mark.parametrize("name", ["k3_entropy_temp", "k1", "dual_clip"])
def test_pg_weights_scale_the_policy_gradient_term_only(name):
    """pg_weights (truncated IS against the rollout engine) multiply l_pg alone: every path ==
    the float64 reference that scales only that term, with a KL term, an entropy bonus and
    OBSERVED CE present; NaN at tokens it is not read; and it differs from folding the same
    weights into token_weights (which would scale KL and entropy too)."""
    cfg = CONFIGS[name]
    batch = make_batch(seed=11 + len(name), temperature=cfg.temperature)
    n = batch["hidden"].shape[0]
    g = torch.Generator().manual_seed(5)
    rl = (batch["roles"] == ACT) | (batch["roles"] == REH)
    pgw = torch.where(rl, 0.2 + 1.6 * torch.rand(n, generator=g), torch.full((n,), float("nan")))
    ref_loss, ref_dx, ref_dw = reference(batch, cfg, pg_weights=pgw)
    for fused, backend in (PATHS if name == "k3_entropy_temp" else FAST_PATHS):
        out, dx, dw = run(batch, cfg, fused, backend, pg_weights=pgw, chunk_size=16)
        assert abs(out.loss.item() - ref_loss.item()) <= TOL * max(1.0, abs(ref_loss.item()))
        assert rel_err(dx, ref_dx) <= TOL, (fused, backend)
        assert rel_err(dw, ref_dw) <= TOL, (fused, backend)
    counts = torch.bincount(batch["roles"], minlength=4).double()
    folded = torch.where(rl, pgw, torch.ones(n)) / counts[batch["roles"]].float()
    if cfg.kl_coef or cfg.entropy_coef:     # folding scales them too: another loss
        fold_loss, _, _ = reference(batch, cfg, token_weights=torch.where(
            batch["roles"] == CTX, torch.zeros(n), folded))
        assert abs(fold_loss.item() - ref_loss.item()) > 1e-3 * max(1.0, abs(ref_loss.item()))
    ones, _, _ = run(batch, cfg, True, "torch", pg_weights=torch.where(rl, torch.ones(n), pgw))
    plain, _, _ = run(batch, cfg, True, "torch")
    assert torch.equal(ones.loss, plain.loss)        # g = 1 is exactly no weight


def test_pg_weights_not_finite_at_a_loss_bearing_token_is_refused():
    batch = make_batch(seed=3)
    pgw = torch.ones(batch["hidden"].shape[0])
    k = int(((batch["roles"] == ACT)).nonzero()[0, 0])
    pgw[k] = float("inf")
    with pytest.raises(ValueError, match=rf"pg_weights\[{k}\] = inf is not finite"):
        run(batch, PolicyLossConfig(), True, "torch", pg_weights=pgw)


@pytest.mark.parametrize("fused", [True, False])
def test_micro_batches_with_global_normalizers_equal_one_call(fused):
    cfg = PolicyLossConfig(w_observed=0.3, kl_coef=0.1, dual_clip=1.5)
    batch = make_batch(n=90, seed=3)
    _, dx_full, dw_full = run(batch, cfg, fused, "torch")
    counts = torch.bincount(batch["roles"], minlength=4).double()
    x = batch["hidden"].clone().requires_grad_()
    w = batch["weight"].clone().requires_grad_()
    total = 0.0
    for idx in torch.tensor_split(torch.arange(90), [17, 55]):  # uneven micro-batches
        sub = {k: v[idx] for k, v in batch.items() if k not in ("hidden", "weight")}
        out = linear_policy_loss(x[idx], w, sub["targets"], sub["roles"], sub["advantages"],
                                 sub["old_logp"], cfg, ref_logp=sub["ref_logp"],
                                 normalizers=counts, fused=fused, backend="torch")
        out.loss.backward()
        total += out.loss.item()
    assert rel_err(x.grad, dx_full) <= 1e-5 and rel_err(w.grad, dw_full) <= 1e-5


def _dist_worker(rank, world, init_file, batch, cfg, out_path):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        n = batch["hidden"].shape[0]
        idx = torch.arange(n)[rank::world]  # each rank gets an interleaved half of the tokens
        local = torch.bincount(batch["roles"][idx], minlength=4).double()
        dist.all_reduce(local)  # global per-role counts
        x = batch["hidden"].clone().requires_grad_()
        w = batch["weight"].clone().requires_grad_()
        out = linear_policy_loss(x[idx], w, batch["targets"][idx], batch["roles"][idx],
                                 batch["advantages"][idx], batch["old_logp"][idx], cfg,
                                 ref_logp=batch["ref_logp"][idx], normalizers=local,
                                 backend="torch")
        out.loss.backward()
        loss = out.loss.detach().clone()
        for t in (x.grad, w.grad, loss):
            dist.all_reduce(t)  # SUM: global normalizers make the sum the full-batch value
        if rank == 0:
            torch.save({"dx": x.grad, "dw": w.grad, "loss": loss}, out_path)
    finally:
        dist.destroy_process_group()


def test_two_process_gloo_equals_single_process(tmp_path):
    cfg = PolicyLossConfig(w_observed=0.3, kl_coef=0.1, entropy_coef=0.01)
    batch = make_batch(n=50, seed=5)
    one, dx, dw = run(batch, cfg, True, "torch")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_dist_worker, args=(2, str(tmp_path / "init"), batch, cfg, str(tmp_path / "g.pt")),
             nprocs=2, join=True)
    got = torch.load(tmp_path / "g.pt")
    assert abs(float(got["loss"]) - one.loss.item()) <= 1e-5
    assert rel_err(got["dx"], dx) <= 1e-5 and rel_err(got["dw"], dw) <= 1e-5


@pytest.mark.parametrize("fused,backend", FAST_PATHS)
def test_zero_weight_role_gives_exactly_zero_gradient(fused, backend):
    batch = make_batch(seed=11)
    cfg = PolicyLossConfig(w_rehearse=0.0, w_observed=0.5)
    out, dx, dw = run(batch, cfg, fused, backend)
    assert torch.all(dx[batch["roles"] == REH] == 0)
    assert out.metrics["rehearse"]["tokens"] > 0 and out.metrics["rehearse"]["loss"] == 0
    assert set(out.metrics["rehearse"]) == {"tokens", "loss"}  # nothing computed: no means
    assert torch.all(out.logp[batch["roles"] == REH] == 0)
    # the same call with REHEARSE tokens relabelled CONTEXT: bitwise the same gradient
    relabel = dict(batch, roles=torch.where(batch["roles"] == REH, CTX, batch["roles"]))
    _, dx2, dw2 = run(relabel, cfg, fused, backend)
    assert torch.equal(dx, dx2) and torch.equal(dw, dw2)


@pytest.mark.parametrize("fused,backend", FAST_PATHS)
def test_zero_token_role_and_all_context_give_no_nan(fused, backend):
    batch = make_batch(n=30, seed=12)
    batch["roles"] = torch.where(batch["roles"] == REH, ACT, batch["roles"])  # no REHEARSE
    cfg = PolicyLossConfig(w_observed=1.0, kl_coef=0.1, entropy_coef=0.1)
    out, dx, dw = run(batch, cfg, fused, backend)
    ref_loss, ref_dx, _ = reference(batch, cfg)
    assert math.isfinite(float(out.loss)) and abs(float(out.loss) - float(ref_loss)) <= TOL
    assert out.metrics["rehearse"]["tokens"] == 0 and out.metrics["rehearse"]["loss"] == 0
    assert all(math.isfinite(v) for m in out.metrics.values() for v in m.values())
    batch["roles"] = torch.zeros_like(batch["roles"])  # nothing to learn from at all
    out, dx, dw = run(batch, cfg, fused, backend)
    assert float(out.loss) == 0.0 and torch.all(dx == 0) and torch.all(dw == 0)


# ---- hand-computed examples ---------------------------------------------------------------------
# hidden = 0 makes every logit 0, so logp = -log V and H = log V exactly; old_logp sets the ratio.

V = 4
LOGP = -math.log(V)


def hand_batch(ratios, advs, roles, ref_shift=None):
    n = len(roles)
    ratios = torch.tensor(ratios, dtype=torch.float64)
    old = (LOGP - torch.log(ratios)).float()
    ref = None if ref_shift is None else torch.full((n,), LOGP + ref_shift)
    return dict(hidden=torch.zeros(n, 3), weight=torch.randn(V, 3), targets=torch.arange(n) % V,
                roles=torch.tensor(roles), advantages=torch.tensor(advs, dtype=torch.float32),
                old_logp=old, ref_logp=ref)


def hand_loss(b, cfg, fused=True, **kw):
    x = b["hidden"].clone().requires_grad_()
    out = linear_policy_loss(x, b["weight"], b["targets"], b["roles"], b["advantages"],
                             b["old_logp"], cfg, ref_logp=b["ref_logp"], fused=fused, **kw)
    out.loss.backward()
    return float(out.loss), x.grad


@pytest.mark.parametrize("fused", [True, False])
def test_hand_clip_dual_clip_and_ce(fused):
    # ACT  A=+1 r=1.5: max(-1.5, -1.2) = -1.2 (clipped: no gradient)
    # ACT  A=-1 r=1.5: max(1.5, 1.2) = 1.5 -> dual clip c=1.4: min(1.5, 1.4) = 1.4 (no gradient)
    # REH  A=+2 r=0.5: max(-1.0, -1.6) = -1.0 (unclipped)
    # OBS  CE: -logp = log 4;  CTX: nothing
    b = hand_batch([1.5, 1.5, 0.5, 1.0, 1.0], [1.0, -1.0, 2.0, 0.0, 0.0], [ACT, ACT, REH, OBS, CTX])
    cfg = PolicyLossConfig(w_act=1.0, w_rehearse=0.5, w_observed=0.25, dual_clip=1.4)
    loss, dx = hand_loss(b, cfg, fused)
    expect = 1.0 * (-1.2 + 1.4) / 2 + 0.5 * (-1.0) / 1 + 0.25 * math.log(4) / 1
    assert loss == pytest.approx(expect, abs=1e-6)
    assert torch.all(dx[0] == 0) and torch.all(dx[1] == 0) and torch.all(dx[4] == 0)
    # REH: dl/dlogp = -A r = -1, times w/n = 0.5; dlogp/dh = w_t - mean_j w_j at uniform softmax
    wt = b["weight"]
    assert torch.allclose(dx[2], -0.5 * (wt[2] - wt.mean(0)), atol=1e-6)
    assert torch.allclose(dx[3], -0.25 * (wt[3] - wt.mean(0)), atol=1e-6)
    # without dual clip the A<0 token keeps 1.5
    loss, _ = hand_loss(b, PolicyLossConfig(w_rehearse=0.5, w_observed=0.25), fused)
    assert loss == pytest.approx((-1.2 + 1.5) / 2 - 0.5 + 0.25 * math.log(4), abs=1e-6)


@pytest.mark.parametrize("kl_type,expect", [
    ("k1", -math.log(2)),                          # logp - ref = -log 2
    ("k2", 0.5 * math.log(2) ** 2),                # (logp - ref)^2 / 2
    ("k3", 2.0 - math.log(2) - 1.0),               # exp(ref - logp) - (ref - logp) - 1
])
@pytest.mark.parametrize("fused", [True, False])
def test_hand_kl_types(kl_type, expect, fused):
    b = hand_batch([1.0, 1.0], [0.0, 0.0], [ACT, REH], ref_shift=math.log(2))  # ref = logp + log 2
    loss, _ = hand_loss(b, PolicyLossConfig(kl_coef=0.5, kl_type=kl_type), fused)
    assert loss == pytest.approx(0.5 * expect * 2, abs=1e-6)   # two roles, one token each


@pytest.mark.parametrize("fused", [True, False])
def test_hand_entropy_bonus(fused):
    b = hand_batch([1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [ACT, ACT, REH])
    loss, dx = hand_loss(b, PolicyLossConfig(entropy_coef=0.1), fused)
    # pg = -1 per token (r = 1), entropy = log 4 at uniform logits, dH/dh = 0 there
    assert loss == pytest.approx(2 * (-1.0 - 0.1 * math.log(4)), abs=1e-6)


@pytest.mark.parametrize("fused", [True, False])
def test_hand_token_weight_aggregation(fused):
    # episode 0: 1 ACT token (A=1); episode 1: 3 ACT tokens (A=2); r = 1 -> l = -A
    b = hand_batch([1.0] * 4, [1.0, 2.0, 2.0, 2.0], [ACT] * 4)
    token_mean, _ = hand_loss(b, PolicyLossConfig(), fused)
    assert token_mean == pytest.approx((-1 - 2 - 2 - 2) / 4, abs=1e-6)
    # seq-mean-token-mean: c = 1 / (S * n_i) = 1/2, 1/6, 1/6, 1/6
    tw = torch.tensor([1 / 2, 1 / 6, 1 / 6, 1 / 6])
    seq_mean, _ = hand_loss(b, PolicyLossConfig(), fused, token_weights=tw)
    assert seq_mean == pytest.approx((-1 + -2) / 2, abs=1e-6)
    # Dr. GRPO seq-mean-token-sum-norm with L = 8: c = 1 / (S * L) = 1/16; times w_act = 2
    dr, _ = hand_loss(b, PolicyLossConfig(w_act=2.0), fused, token_weights=torch.full((4,), 1 / 16))
    assert dr == pytest.approx(2 * (-7) / 16, abs=1e-6)


# ---- autograd details and bad input -------------------------------------------------------------


def test_fused_backward_scales_by_grad_output_and_frozen_weight():
    batch = make_batch(seed=21)
    cfg = PolicyLossConfig(w_observed=0.5)
    _, dx, _ = run(batch, cfg, True, "torch")
    x = batch["hidden"].clone().requires_grad_()
    out = linear_policy_loss(x, batch["weight"], batch["targets"], batch["roles"],
                             batch["advantages"], batch["old_logp"], cfg)
    (3.0 * out.loss).backward()
    assert torch.allclose(x.grad, 3.0 * dx, rtol=1e-6, atol=1e-9)
    with pytest.raises(RuntimeError, match="once"):
        out.loss.backward()
    with torch.no_grad():  # forward-only: no gradient work, same loss
        out2 = linear_policy_loss(x, batch["weight"], batch["targets"], batch["roles"],
                                  batch["advantages"], batch["old_logp"], cfg)
    assert float(out2.loss) == pytest.approx(float(out.loss), rel=1e-6)


def _bad_call(**over):
    b = make_batch(n=12, seed=30)
    b = dict(b, **over)
    cfg = over.pop("cfg", PolicyLossConfig(kl_coef=0.1))
    kw = {k: b[k] for k in ("normalizers", "token_weights", "check_finite") if k in b}
    return linear_policy_loss(b["hidden"], b["weight"], b["targets"], b["roles"],
                              b["advantages"], b["old_logp"], cfg, ref_logp=b["ref_logp"], **kw)


def test_bad_inputs():
    b = make_batch(n=12, seed=30)
    rl_pos = int(((b["roles"] == ACT) | (b["roles"] == REH)).nonzero()[0, 0])
    ctx_pos = int((b["roles"] == CTX).nonzero()[0, 0])
    roles = b["roles"].clone()
    roles[ctx_pos] = 7
    with pytest.raises(ValueError, match=rf"roles\[{ctx_pos}\] = 7 is not a Role"):
        _bad_call(roles=roles)
    adv = b["advantages"].clone()
    adv[rl_pos] = float("inf")
    with pytest.raises(ValueError, match=rf"advantages\[{rl_pos}\] = inf is not finite"):
        _bad_call(advantages=adv)
    _bad_call(advantages=adv, check_finite=False)  # opt-out: no check
    old = b["old_logp"].clone()
    old[rl_pos] = float("nan")
    with pytest.raises(ValueError, match=rf"old_logp\[{rl_pos}\]"):
        _bad_call(old_logp=old)
    ref = b["ref_logp"].clone()
    ref[rl_pos] = float("nan")
    with pytest.raises(ValueError, match=rf"ref_logp\[{rl_pos}\]"):
        _bad_call(ref_logp=ref)
    with pytest.raises(ValueError, match="ref_logp is required"):
        _bad_call(ref_logp=None)
    with pytest.raises(ValueError, match="normalizers must have one entry per Role"):
        _bad_call(normalizers=[1.0, 2.0])
    with pytest.raises(ValueError, match=r"normalizers\[1\] \(ACT\)"):
        _bad_call(normalizers=[0.0, 0.0, 5.0, 5.0])
    with pytest.raises(ValueError, match="advantages must have shape"):
        _bad_call(advantages=b["advantages"][:-1])
    with pytest.raises(ValueError, match="roles must be an integer"):
        _bad_call(roles=b["roles"].float())
    with pytest.raises(ValueError, match="kl_type"):
        PolicyLossConfig(kl_type="k4")
    with pytest.raises(ValueError, match="dual_clip"):
        PolicyLossConfig(dual_clip=0.9)
    t = b["targets"].clone()
    t[rl_pos] = 10_000
    with pytest.raises(ValueError, match=rf"targets\[{rl_pos}\] = 10000"):
        _bad_call(targets=t)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_entropy_metric_on_the_fast_torch_path_matches_float64(temperature):
    """with_entropy=True and entropy_coef == 0 (an entropy metric, e.g. TRL's): the torch fast path
    runs (one more row reduction) and its entropy, loss and gradients equal float64."""
    from fastrehearse.kernels.policy_loss import _fast_torch
    assert _fast_torch("torch", False, None) and not _fast_torch("torch", True, None)
    cfg = PolicyLossConfig(kl_coef=0.1, temperature=temperature)
    batch = make_batch(seed=11, temperature=temperature)
    ref_loss, ref_dx, ref_dw = reference(batch, cfg)
    out, dx, dw = run(batch, cfg, True, "torch", chunk_size=16, with_entropy=True)
    assert abs(out.loss.item() - ref_loss.item()) <= TOL * max(1.0, abs(ref_loss.item()))
    assert rel_err(dx, ref_dx) <= TOL and rel_err(dw, ref_dw) <= TOL
    z = batch["hidden"].double() @ batch["weight"].double().t() / temperature
    p = torch.softmax(z, -1)
    ent = -(p * torch.log_softmax(z, -1)).sum(-1)
    rows = (batch["roles"] == ACT) | (batch["roles"] == REH)   # the entropy is reported on RL tokens
    assert out.entropy is not None and float(out.entropy[~rows].abs().max()) == 0.0
    assert float((out.entropy[rows].double() - ent[rows]).abs().max()) <= 1e-4


@pytest.mark.parametrize("fused,backend", PATHS)
@pytest.mark.parametrize("entropy_coef", [0.0, 0.05])
def test_confident_tokens_keep_their_gradient(fused, backend, entropy_coef):
    """Tokens the policy is sure of (1 - p_t from ~1 down to 4e-9): each token's dX row against
    float64. The fused paths (the torch fast path included) form the target entry of dL/dz from the
    off-target mass, never as 1 - p_t; before that, these rows were off by up to 10x."""
    x, w, t = confident_rows()
    n = x.shape[0]
    g = torch.Generator().manual_seed(3)
    roles = torch.tensor([ACT, REH, OBS] * 4)[:n]
    cfg = PolicyLossConfig(temperature=0.25, entropy_coef=entropy_coef, w_observed=1.0)
    with torch.no_grad():
        lp, _ = linear_logprobs(x, w, t, temperature=0.25, backend="torch")
    rl = roles != OBS
    nan = torch.full((n,), float("nan"))
    batch = dict(hidden=x, weight=w, targets=t, roles=roles,
                 advantages=torch.where(rl, torch.randn(n, generator=g), nan),
                 old_logp=torch.where(rl, lp + 0.01 * torch.randn(n, generator=g), nan), ref_logp=nan)
    _, ref_dx, _ = reference(batch, cfg)
    _, dx, _ = run(batch, cfg, fused, backend)
    err = row_rel_err(dx, ref_dx)
    assert float(err.max()) <= CONFIDENT_ROW_TOL, err.tolist()
