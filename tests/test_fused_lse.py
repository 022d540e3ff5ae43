"""backend='triton-fused': the tile kernel of kernels/_fused_lse.py (logits GEMM + log-sum-exp in
one kernel) against float64, every output element, under TRITON_INTERPRET=1 (fp32 / fp16: the
interpreter's bf16 tl.dot is wrong, so bf16 is upcast there and checked as such).

The end-to-end float64 checks of linear_logprobs (values and gradients, all CASES, confident rows)
run this backend in tests/test_linear_logprobs.py.
"""
import pytest
import torch

from _kernel_ref import U32, confident_rows, ref_policy_loss
from fastrehearse.kernels import PolicyLossConfig, linear_logprobs, linear_policy_loss
from fastrehearse.kernels._fused_lse import GROUP_M, fused_row_stats, tile_config
from fastrehearse.kernels._rowmath import row_stats_torch

pytestmark = pytest.mark.usefixtures("one_thread")

BM, BN = tile_config(torch.float32, torch.device("cpu"))[:2]


def _ref_stats(x, w, t, inv_temp):
    """(logp, ent, lse, off, off_ent) in float64 from the float64 logits (every term of off is a
    positive float64 sum: its relative precision ~1e-16 whatever p_t)."""
    z = x.double() @ w.double().T
    return row_stats_torch(z, t, inv_temp, True)


def _inputs(n, h, v, seed, dtype=torch.float32, scale=1.0, negative=False):
    g = torch.Generator().manual_seed(seed)
    if negative:   # every logit in about [-190, -140]; small dyadic values: X W^T exact in fp32
        x = torch.randint(3, 5, (n, h), generator=g).to(dtype)
        w = (-torch.randint(10, 14, (v, h), generator=g) / 4).to(dtype)
    else:
        x = torch.randn(n, h, generator=g).to(dtype)
        w = (torch.randn(v, h, generator=g) * (scale / h ** 0.5)).to(dtype)
    return x, w, torch.randint(0, v, (n,), generator=g)


CASES = {
    # name: (n, h, v, kwargs); odd sizes: no tile divides them
    "odd": (37, 24, 1000, {}),
    "many_row_tiles": (BM * (GROUP_M + 2) + 5, 16, 2 * BN + 3, {}),   # a last, partial group
    "v1": (9, 8, 1, {}),
    "one_past_tile": (11, 8, BN + 1, {}),        # the last vocabulary tile has one column
    "h_not_multiple_of_k": (13, 70, 300, {}),
    "large_logits": (19, 16, 700, {"scale": 80.0}),
    "all_negative": (17, 16, 400, {"negative": True}),
    "fp16": (31, 32, 300, {"dtype": torch.float16}),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_tile_stats_match_float64(case, temperature):
    n, h, v, kw = CASES[case]
    x, w, t = _inputs(n, h, v, seed=n * 131 + v, **kw)
    t[0] = t[-1] = v - 1          # targets in the last (partial) vocabulary tile, first and last row
    inv = 1.0 / temperature
    got = fused_row_stats(x, w, t, inv, True)
    ref = _ref_stats(x, w, t, inv)
    # fp32 rounding of each logit s = (x . w) / T is ~2^-24 (sum_k |x_k w_k|) / T; logp and lse
    # inherit it, plus ~1e-6 of the softmax math itself, plus the rounding of each result at its
    # own size (16 U32 |ref|: lse ~ 500-780 in large_logits has an ulp of 3-6e-5, which the first
    # two terms leave out: 1.9-2.7x margins here, docs/tolerances.md)
    mag = float((x.double().abs() @ w.double().abs().T).max()) * inv
    for name, a, b in zip(("logp", "ent", "lse", "off", "off_ent"), got, ref):
        assert a.dtype == torch.float32 and a.shape == (n,), name
        assert torch.isfinite(a).all(), name
        tol = 1e-6 + 4 * U32 * mag + 16 * U32 * float(b.abs().max())
        err = float((a.double() - b).abs().max())
        assert err <= tol, (name, err, tol)
    lp2, ent2, *_ = fused_row_stats(x, w, t, inv, False)
    assert ent2 is None and torch.equal(lp2, got[0])


@pytest.mark.parametrize("case", ["odd", "large_logits"])
def test_tile_stats_tolerance_fails_planted_bugs(case):
    """The bound above (with its 16 U32 |ref| term) still fails what the kernel test exists for:
    the vocabulary tile holding a row's largest logit lost from the online lse (a merge /
    rescale bug), and the last, partial tile left out (a masking bug), against the kernel's own
    correct output on the same inputs."""
    n, h, v, kw = CASES[case]
    x, w, t = _inputs(n, h, v, seed=n * 131 + v, **kw)
    t[0] = t[-1] = v - 1          # targets in the last (partial) vocabulary tile, as above
    inv = 1.0 / 0.7
    logp, _, lse, *_ = _ref_stats(x, w, t, inv)
    mag = float((x.double().abs() @ w.double().abs().T).max()) * inv
    tol = lambda ref: 1e-6 + 4 * U32 * mag + 16 * U32 * float(ref.abs().max())  # noqa: E731
    got = fused_row_stats(x, w, t, inv, True)
    assert float((got[0].double() - logp).abs().max()) <= tol(logp)
    assert float((got[2].double() - lse).abs().max()) <= tol(lse)
    z = (x.double() @ w.double().T) * inv
    tile = (torch.arange(v) // BN)[None, :]
    lost_max = torch.where(tile != (z.argmax(-1) // BN)[:, None], z, -torch.inf).logsumexp(-1)
    assert float((lost_max - lse).abs().max()) > 10 * tol(lse)
    # the partial tile unread: its target logits taken as 0 (rows 0 and n - 1)
    unread = logp.clone()
    unread[[0, -1]] = -lse[[0, -1]]
    assert float((unread - logp).abs().max()) > 10 * tol(logp)


def test_confident_rows_keep_the_off_target_mass():
    """off = sum_{j != t} p_j with its relative precision down to 1 - p_t ~ 4e-9 (never 1 - p_t)."""
    x, w, t = confident_rows()
    got = fused_row_stats(x, w, t, 4.0, True)
    ref = _ref_stats(x, w, t, 4.0)
    assert float(ref[3].min()) < 1e-8
    rel = ((got[3].double() - ref[3]).abs() / ref[3]).max()
    assert float(rel) <= 1e-5, float(rel)
    rel_b = ((got[4].double() - ref[4]).abs() / ref[4].abs()).max()
    assert float(rel_b) <= 1e-5, float(rel_b)


def test_bf16_is_exact_through_the_interpreter_upcast():
    """bf16 operands on the CPU are upcast (exactly) before the dot: same numbers as fp32 on the
    bf16 values, within the fp32 GEMM's summation order."""
    x, w, t = _inputs(23, 40, 517, seed=3, dtype=torch.bfloat16)
    got = fused_row_stats(x, w, t, 1.25, True)
    ref = _ref_stats(x, w, t, 1.25)
    for a, b in zip(got, ref):
        assert float((a.double() - b).abs().max()) <= 1e-5


def test_forward_never_forms_the_logits(monkeypatch):
    """No logits GEMM outside the kernel: the chunk GEMMs of linear_logprobs and the policy
    loss's sweep raise if called, and the forward-only calls still run."""
    import sys
    ll = sys.modules["fastrehearse.kernels.linear_logprobs"]   # the module, not the function

    def boom(*a, **k):
        raise AssertionError("a [rows, V] logits GEMM ran outside the tile kernel")
    monkeypatch.setattr(ll, "mm_f32", boom)
    x, w, t = _inputs(21, 16, 300, seed=1)
    with torch.no_grad():
        lp, ent = linear_logprobs(x, w, t, with_entropy=True, backend="triton-fused")
        roles = torch.full((21,), 1)
        out = linear_policy_loss(x, w, t, roles, torch.randn(21), None, backend="triton-fused",
                                 with_entropy=True)
    lr, er = _ref_stats(x, w, t, 1.0)[:2]
    assert float((lp.double() - lr).abs().max()) <= 1e-5
    assert float((out.logp.double() - lr).abs().max()) <= 1e-5
    with pytest.raises(AssertionError, match="logits GEMM"):   # the triton backend does form them
        linear_logprobs(x, w, t, backend="triton")


@pytest.mark.parametrize("kl,entropy", [(0.0, 0.01), (0.05, 0.0)])
def test_policy_loss_forward_only_matches_float64(kl, entropy):
    """No gradient wanted: the sweep's stats come from the tile kernel. Loss vs the float64
    token-by-token reference; per-token logp / entropy vs float64; metrics as the triton sweep."""
    n, h, v = 41, 24, 500
    x, w, t = _inputs(n, h, v, seed=7)
    g = torch.Generator().manual_seed(8)
    roles = torch.randint(0, 4, (n,), generator=g)
    adv, old = torch.randn(n, generator=g), -torch.rand(n, generator=g) * 5
    ref_lp = -torch.rand(n, generator=g) * 5
    cfg = PolicyLossConfig(entropy_coef=entropy, kl_coef=kl)
    outs = {}
    with torch.no_grad():
        for b in ("triton-fused", "triton"):
            outs[b] = linear_policy_loss(x, w, t, roles, adv, old, cfg, backend=b,
                                         ref_logp=ref_lp if kl else None, with_entropy=True)
    out = outs["triton-fused"]
    ref_loss = ref_policy_loss(x, w, t, roles, adv, old, ref_lp if kl else None, cfg)
    assert abs(float(out.loss) - float(ref_loss)) <= 1e-5 * max(1.0, abs(float(ref_loss)))
    lp_ref, ent_ref = _ref_stats(x, w, t, 1.0)[:2]
    on = (roles == 1) | (roles == 2)            # ACT / REHEARSE (CONTEXT, weight-0 OBSERVED: not)
    assert float((out.logp.double() - lp_ref)[on].abs().max()) <= 1e-5
    assert float((out.entropy.double() - ent_ref)[on].abs().max()) <= 1e-5
    assert torch.all(out.logp[~on] == 0)
    for role, m in out.metrics.items():
        for k, val in m.items():
            assert val == pytest.approx(outs["triton"].metrics[role][k], rel=1e-5, abs=1e-6), \
                (role, k)


def test_policy_loss_with_gradient_is_the_triton_sweep():
    """A sweep with a gradient needs each chunk's logits for dZ: it is the 'triton' sweep,
    bit for bit."""
    n, h, v = 33, 16, 300
    x, w, t = _inputs(n, h, v, seed=9)
    roles, adv, old = torch.randint(0, 4, (n,)), torch.randn(n), -torch.rand(n) * 3
    res = {}
    for b in ("triton", "triton-fused"):
        xk, wk = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = linear_policy_loss(xk, wk, t, roles, adv, old, PolicyLossConfig(entropy_coef=0.01),
                                 backend=b)
        out.loss.backward()
        res[b] = (out.loss.detach(), out.logp, xk.grad, wk.grad)
    for a, b in zip(res["triton"], res["triton-fused"]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kw,what", [({"bias": "zeros"}, "bias"),
                                     ({"logit_softcap": 30.0}, "logit_softcap"),
                                     ({"logit_scale": -1.0}, "logit_scale")])
def test_head_variants_are_refused(kw, what):
    x, w, t = _inputs(5, 8, 50, seed=2)
    if kw.get("bias") == "zeros":
        kw = {"bias": torch.zeros(50)}
    with pytest.raises(ValueError, match=f"triton-fused.*{what}"):
        linear_logprobs(x, w, t, backend="triton-fused", **kw)
    with pytest.raises(ValueError, match="triton-fused"):
        linear_policy_loss(x, w, t, torch.ones(5, dtype=torch.long), torch.randn(5), None,
                           backend="triton-fused", **kw)


def test_positive_logit_scale_is_folded():
    x, w, t = _inputs(9, 8, 60, seed=4)
    a, _ = linear_logprobs(x, w, t, backend="triton-fused", logit_scale=2.0, temperature=0.5)
    b = _ref_stats(x, w, t, 2.0 / 0.5)[0]              # s = z * scale / T
    assert float((a.double() - b).abs().max()) <= 1e-5


def test_cpu_without_interpreter_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x, w, t = _inputs(3, 8, 20, seed=0)
    with pytest.raises(ValueError, match="backend='triton-fused' needs CUDA"):
        linear_logprobs(x, w, t, backend="triton-fused")


def test_no_fp32_output_gemm_differentiated_calls_run_as_triton(monkeypatch):
    """Where torch cannot return fp32 from a bf16 GEMM, the backward's recomputed logits are bf16:
    a differentiated fused forward would save an lse that does not match them, so such calls run
    as 'triton' (warned once); forward-only calls stay fused. (A stand-in CUDA tensor: only its
    dtype and device are read.)"""
    import types
    import warnings

    from fastrehearse.kernels import _common
    x = types.SimpleNamespace(dtype=torch.bfloat16, device=torch.device("cuda"))
    monkeypatch.setattr(_common, "_out_dtype_ok", lambda fn, like: False)
    monkeypatch.setitem(_common._TRITON_STATE, "fused_warned", "")
    with pytest.warns(UserWarning, match="triton-fused.*out_dtype"):
        assert _common.fused_forward_backend("triton-fused", x, True) == "triton"
    with warnings.catch_warnings():
        warnings.simplefilter("error")                  # once only
        assert _common.fused_forward_backend("triton-fused", x, True) == "triton"
    assert _common.fused_forward_backend("triton-fused", x, False) == "triton-fused"
    monkeypatch.setattr(_common, "_out_dtype_ok", lambda fn, like: True)
    assert _common.fused_forward_backend("triton-fused", x, True) == "triton-fused"
    x32 = types.SimpleNamespace(dtype=torch.float32, device=torch.device("cuda"))
    assert _common.fused_forward_backend("triton-fused", x32, True) == "triton-fused"
