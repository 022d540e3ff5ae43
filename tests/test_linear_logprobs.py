"""linear_logprobs (both backends) against a float64 reference: values, gradients, masks, errors.

The Triton backend runs under TRITON_INTERPRET=1 here (tests/conftest.py), with fp32/fp16 only
(the interpreter's bf16 tl.dot is wrong, and the row kernels are what we exercise).
"""
import zlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _kernel_ref import (CONFIDENT_ROW_TOL, confident_rows, logits_atol, ref_logprobs, rel_err,
                         row_rel_err)
from fastrehearse.kernels import linear_logprobs

BACKENDS = ["torch", "triton", "triton-fused"]
LOGP_TOL = 1e-4   # fp32: max abs error of logp / entropy at O(1) logits (the floor of _logp_tol)
GRAD_TOL = 1e-4   # fp32: ||g - g_ref|| / ||g_ref||


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def _poison_empty():
    """torch.empty returns NaN-filled memory, so an output element we forget to write shows up."""
    import torch.utils.deterministic as det
    old_det, old_fill = torch.are_deterministic_algorithms_enabled(), det.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    det.fill_uninitialized_memory = True
    yield
    torch.use_deterministic_algorithms(old_det)
    det.fill_uninitialized_memory = old_fill


def _logp_tol(x, w, lp_ref, temperature=1.0, floor=LOGP_TOL):
    """LOGP_TOL plus the fp32 rounding that grows with the logits (`logits_atol`): the large-logit
    cases reach |logp| ~ 500-900, where ulp(logp) is 3-6e-5 and a fixed 1e-4 is 1.6-3 ulps, one
    summation order from failing (docs/tolerances.md). The same bound serves the entropy (its error comes
    from the same |z|). What these tests catch -- a block merge / rescale / mask gone wrong,
    an overflowing block not recomputed -- is O(1) nats or inf / NaN."""
    return logits_atol(x, w, lp_ref, temperature, floor)


def _maxabs(a, b):
    d = (a.detach().double() - b.detach().double()).abs()
    return float(d.max()) if d.numel() else 0.0


def _inputs(n, h, v, *, seed, dtype=torch.float32, scale=1.0, negative=False, p_mask=0.3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g).to(dtype)
    w = (torch.randn(v, h, generator=g) * (scale / h ** 0.5)).to(dtype)
    if negative:
        # Every logit in about [-190, -140] (a running max started at 0 underflows exp there).
        # Small integers / quarters make X W^T exact in fp32, so the check isolates the softmax
        # math from GEMM rounding (which at |z| ~ 160 alone is ~1e-4).
        x = torch.randint(3, 5, (n, h), generator=g).to(dtype)
        w = (-torch.randint(10, 14, (v, h), generator=g) / 4).to(dtype)
    t = torch.randint(0, v, (n,), generator=g)
    mask = torch.rand(n, generator=g) >= p_mask
    return x, w, t, mask


def check_against_ref(backend, n, h, v, *, seed=0, temperature=1.0, with_entropy=True,
                      use_mask=True, scale=1.0, negative=False, chunk_size=None, dtype=torch.float32,
                      logp_tol=LOGP_TOL, grad_tol=GRAD_TOL, p_mask=0.3, grads=("logp", "ent")):
    x, w, t, mask = _inputs(n, h, v, seed=seed, dtype=dtype, scale=scale, negative=negative,
                            p_mask=p_mask)
    mask = mask if use_mask else None
    if mask is not None:  # masked targets may be garbage (e.g. -100): must be ignored
        t = torch.where(mask, t, torch.full_like(t, -100))
    g = torch.Generator().manual_seed(seed + 1)
    g_logp = torch.randn(n, generator=g, dtype=torch.float64) if "logp" in grads else None
    g_ent = torch.randn(n, generator=g, dtype=torch.float64) if "ent" in grads else None

    xr = x.double().requires_grad_()
    wr = w.double().requires_grad_()
    lp_ref, ent_ref = ref_logprobs(xr, wr, t, mask, temperature)
    loss_ref = 0
    if g_logp is not None:
        loss_ref = loss_ref + (lp_ref * g_logp).sum()
    if g_ent is not None and with_entropy:
        loss_ref = loss_ref + (ent_ref * g_ent).sum()

    xk = x.clone().requires_grad_()
    wk = w.clone().requires_grad_()
    lp, ent = linear_logprobs(xk, wk, t, mask=mask, temperature=temperature,
                              with_entropy=with_entropy, backend=backend, chunk_size=chunk_size)
    assert lp.dtype == torch.float32 and lp.shape == (n,)
    tol = _logp_tol(x, w, lp_ref, temperature, logp_tol)
    assert _maxabs(lp, lp_ref) <= tol
    if with_entropy:
        assert ent.dtype == torch.float32 and ent.shape == (n,)
        assert _maxabs(ent, ent_ref) <= tol
    else:
        assert ent is None
    if mask is not None:  # masked positions exactly zero
        assert torch.all(lp[~mask] == 0)
        if with_entropy:
            assert torch.all(ent[~mask] == 0)

    if not isinstance(loss_ref, torch.Tensor):
        return
    loss_ref.backward()
    loss = 0
    if g_logp is not None:
        loss = loss + (lp * g_logp.float()).sum()
    if g_ent is not None and with_entropy:
        loss = loss + (ent * g_ent.float()).sum()
    loss.backward()
    assert xk.grad.dtype == dtype and wk.grad.dtype == dtype
    assert torch.isfinite(xk.grad).all() and torch.isfinite(wk.grad).all()
    assert rel_err(xk.grad, xr.grad) <= grad_tol
    assert rel_err(wk.grad, wr.grad) <= grad_tol
    if mask is not None:
        assert torch.all(xk.grad[~mask] == 0)


# ---- shapes and numerics: both backends ---------------------------------------------------------

CASES = {
    # name: kwargs (n, h, v, ...); odd sizes so no block size divides them
    "odd": dict(n=37, h=24, v=1000, chunk_size=8),
    "v1": dict(n=9, h=8, v=1),
    "v2": dict(n=5, h=8, v=2, temperature=0.5),
    "single_token": dict(n=1, h=16, v=333, use_mask=False),
    "all_masked": dict(n=13, h=16, v=100, p_mask=1.0),
    "temperature": dict(n=23, h=40, v=517, temperature=0.7, chunk_size=5),
    "hot_temperature": dict(n=23, h=40, v=517, temperature=2.5),
    "large_logits": dict(n=19, h=16, v=700, scale=80.0, temperature=1.0, chunk_size=7),
    "all_negative": dict(n=17, h=16, v=400, negative=True),
    "no_entropy": dict(n=21, h=32, v=300, with_entropy=False),
    "entropy_grad_only": dict(n=21, h=32, v=300, grads=("ent",)),
    "logp_grad_only": dict(n=21, h=32, v=300, grads=("logp",)),
    "no_mask": dict(n=29, h=24, v=257, use_mask=False, chunk_size=4),
    "block_boundary": dict(n=11, h=8, v=8193),  # one past the interpreter's 8192-wide block
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
def test_matches_float64_reference(backend, case):
    check_against_ref(backend, seed=zlib.crc32(case.encode()) % 1000, **CASES[case])


@pytest.mark.parametrize("h,v,n", [(576, 49152, 12), (128, 50257, 40), (8, 31999, 7)])
def test_big_vocab_torch(h, v, n):
    check_against_ref("torch", n, h, v, seed=v, temperature=0.9)


def test_big_vocab_triton():
    check_against_ref("triton", 4, 64, 40000, seed=5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp16_inputs(backend):
    # Outputs/gradients come back in fp16: compare against the float64 reference of the
    # fp16-rounded inputs; the gradient error budget is fp16's rounding of the result (2^-11).
    check_against_ref(backend, 31, 32, 300, seed=3, dtype=torch.float16, grad_tol=1e-3,
                      chunk_size=8)


def test_bf16_inputs_torch():
    check_against_ref("torch", 31, 32, 300, seed=4, dtype=torch.bfloat16, grad_tol=8e-3)
    # temperature != 1: x / T must be formed after the fp32 upcast (bf16 would round it)
    check_against_ref("torch", 31, 32, 300, seed=5, dtype=torch.bfloat16, grad_tol=8e-3,
                      temperature=0.8)


def test_default_chunking_multi_chunk_torch():
    # CPU budget 32 MiB: V=20000 -> 384 rows per chunk, so 900 rows span 3 chunks.
    check_against_ref("torch", 900, 16, 20000, seed=9)


@pytest.mark.parametrize("budget", [4096, 640])
@pytest.mark.parametrize("case", ["odd", "temperature", "large_logits", "all_negative", "no_mask"])
def test_torch_vocab_blocks(monkeypatch, budget, case):
    # A tiny byte budget splits the vocabulary into many blocks (the online lse / entropy merge).
    import fastrehearse.kernels._common as common
    monkeypatch.setattr(common, "VOCAB_BLOCK_BYTES_CPU", budget)
    check_against_ref("torch", seed=zlib.crc32(case.encode()) % 1000 + budget, **CASES[case])


@pytest.mark.parametrize("with_entropy", [False, True])
def test_torch_vocab_block_overflow_and_underflow(monkeypatch, with_entropy):
    # Later vocabulary blocks whose logits lie ~300 above (exp overflow against the running lse:
    # those rows are recomputed with their exact block max) or ~300 below (every exp underflows:
    # the block must add nothing, not NaN) the first block's.
    import fastrehearse.kernels._common as common
    monkeypatch.setattr(common, "VOCAB_BLOCK_BYTES_CPU", 4 * 8 * 64)   # 8 rows -> 64-column blocks
    n, h, v = 8, 8, 320
    g = torch.Generator().manual_seed(21)
    x = torch.randn(n, h, generator=g)
    x[:, 0] = 10.0
    w = torch.randn(v, h, generator=g) * 0.3
    w[64:128, 0] += 30.0          # block 1: +300
    w[192:256, 0] -= 30.0         # block 3: -300
    w[256:, 0] += 60.0            # block 4: +600
    t = torch.tensor([0, 70, 130, 200, 260, 319, 5, 100])
    xk, wk = x.clone().requires_grad_(), w.clone().requires_grad_()
    lp, ent = linear_logprobs(xk, wk, t, with_entropy=with_entropy, backend="torch", chunk_size=8)
    xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
    lr, er = ref_logprobs(xr, wr, t)
    g1 = torch.randn(n, generator=g, dtype=torch.float64)
    g2 = torch.randn(n, generator=g, dtype=torch.float64)
    ((lr * g1).sum() + ((er * g2).sum() if with_entropy else 0)).backward()
    ((lp * g1.float()).sum() + ((ent * g2.float()).sum() if with_entropy else 0)).backward()
    # |z| ~ 600 makes the fp32 GEMM itself round at ~1e-4 absolute: compare within that.
    tol = _logp_tol(x, w, lr)
    assert torch.isfinite(lp).all() and _maxabs(lp, lr) <= tol
    if with_entropy:
        assert torch.isfinite(ent).all() and _maxabs(ent, er) <= tol
    assert rel_err(xk.grad, xr.grad) <= GRAD_TOL and rel_err(wk.grad, wr.grad) <= GRAD_TOL


def _spy_backward_paths(monkeypatch) -> list:
    """Record which backward (direct / shifted) each row block of the torch backend takes."""
    import fastrehearse.kernels._blocked as blocked
    calls = []
    for name in ("_direct_backward", "_shifted_backward"):
        fn = getattr(blocked, name)
        monkeypatch.setattr(blocked, name, lambda *a, _fn=fn, _n=name: calls.append(_n) or _fn(*a))
    return calls


@pytest.mark.parametrize("chunk_size", [None, 8])
@pytest.mark.parametrize("with_entropy", [False, True])
def test_torch_direct_and_shifted_rows_in_one_block(monkeypatch, with_entropy, chunk_size):
    # The shift-free forward keeps rows whose lse lies within +-69 and hands the others (here:
    # rows with logits ~ +80 and ~ -150) to the shifted forward; both kinds share a row
    # block and several vocabulary blocks. Every row must match float64 and the split must be
    # the expected one.
    import fastrehearse.kernels._blocked as blocked
    import fastrehearse.kernels._common as common
    monkeypatch.setattr(common, "VOCAB_BLOCK_BYTES_CPU", 4 * 16 * 64)   # 16 rows -> 64 columns
    seen = []
    real = blocked._shifted_stats
    monkeypatch.setattr(blocked, "_shifted_stats", lambda x, *a: seen.append(x.shape[0]) or real(x, *a))
    bwd = _spy_backward_paths(monkeypatch)
    n, h, v = 16, 12, 333
    g = torch.Generator().manual_seed(5)
    x = torch.randn(n, h, generator=g)
    w = torch.randn(v, h, generator=g) / h ** 0.5
    # column 0 of w is -1 everywhere and x[:, 0] = 0 except in two rows: a common offset of
    # +80 (row 3) or -150 (row 7) on every logit of that row, nothing for the others
    w[:, 0] = -1.0
    x[:, 0] = 0.0
    x[3, 0], x[7, 0] = -80.0, 150.0
    t = torch.randint(0, v, (n,), generator=g)
    xk, wk = x.clone().requires_grad_(), w.clone().requires_grad_()
    lp, ent = linear_logprobs(xk, wk, t, with_entropy=with_entropy, backend="torch",
                              chunk_size=chunk_size)
    xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
    lr, er = ref_logprobs(xr, wr, t)
    lse_ref = torch.logsumexp(xr.detach() @ wr.detach().T, 1)
    expect = int(((lse_ref < -69) | (lse_ref > 69)).sum())
    assert expect >= 2 and sum(seen) == expect
    g1 = torch.randn(n, generator=g, dtype=torch.float64)
    g2 = torch.randn(n, generator=g, dtype=torch.float64)
    ((lr * g1).sum() + ((er * g2).sum() if with_entropy else 0)).backward()
    ((lp * g1.float()).sum() + ((ent * g2.float()).sum() if with_entropy else 0)).backward()
    # rows 3 and 7 lie in the first of two 8-row blocks: that block takes the shifted backward
    assert bwd == (["_shifted_backward"] if chunk_size is None
                   else ["_shifted_backward", "_direct_backward"])
    tol = _logp_tol(x, w, lr)
    assert _maxabs(lp, lr) <= tol
    if with_entropy:
        assert _maxabs(ent, er) <= tol
    assert rel_err(xk.grad, xr.grad) <= GRAD_TOL and rel_err(wk.grad, wr.grad) <= GRAD_TOL


@pytest.mark.parametrize("case", ["tiny_upstream", "huge_weight_entries"])
def test_torch_direct_backward_guards(monkeypatch, case):
    # The direct backward folds e^-lse into a row scale on X (and accumulates e^s w into dX):
    # an upstream gradient so small that the scale would leave the normal fp32 range, or weight
    # entries so large that the dX accumulator could overflow, must send the block to the
    # shifted backward, with float64-exact results either way.
    bwd = _spy_backward_paths(monkeypatch)
    n, h, v = 12, 8, 300
    g = torch.Generator().manual_seed(11)
    x = torch.randn(n, h, generator=g)
    w = torch.randn(v, h, generator=g) / h ** 0.5
    g1 = torch.randn(n, generator=g, dtype=torch.float64)
    if case == "tiny_upstream":
        g1 = g1 * 1e-33
    else:   # one huge weight column entry whose logit contribution cancels (x[:, 5] = 0)
        x[:, 5] = 0.0
        w[17, 5] = 1e36
    t = torch.randint(0, v, (n,), generator=g)
    xk, wk = x.clone().requires_grad_(), w.clone().requires_grad_()
    lp, _ = linear_logprobs(xk, wk, t, backend="torch")
    (lp * g1.float()).sum().backward()
    xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
    lr, _ = ref_logprobs(xr, wr, t)
    (lr * g1).sum().backward()
    assert bwd == ["_shifted_backward"]
    assert _maxabs(lp, lr) <= _logp_tol(x, w, lr)
    assert rel_err(xk.grad, xr.grad) <= GRAD_TOL and rel_err(wk.grad, wr.grad) <= GRAD_TOL


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, 40), h=st.integers(8, 64), v=st.integers(1, 3000),
       temperature=st.floats(0.3, 3.0), chunk=st.integers(1, 17), scale=st.floats(0.1, 30.0),
       backend=st.sampled_from(BACKENDS), seed=st.integers(0, 10_000))
def test_property_random_shapes(n, h, v, temperature, chunk, scale, backend, seed):
    check_against_ref(backend, n, h, v, seed=seed, temperature=temperature, chunk_size=chunk,
                      scale=scale)


@pytest.mark.parametrize("backend", BACKENDS)
def test_confident_row_gradient_precision(backend):
    # the example hypothesis found (n=1, h=34, v=7, T=0.3125, scale 3, seed 452): logits up to 9.7,
    # p_t = 1 - 2.7e-4; before the off-target sums its dX / dW were off by 1.3-2.0e-4
    check_against_ref(backend, 1, 34, 7, seed=452, temperature=0.3125, chunk_size=1, scale=3.0)


@pytest.mark.parametrize("backend,kw", [("torch", {}), ("triton", {}), ("triton-fused", {}),
                                        ("torch", {"chunk_size": 3}),
                                        ("torch", {"logit_scale": 1.0}),   # row-chunked torch path
                                        ("triton", {"workspace_bytes": 1})])  # vocab-outer groups
@pytest.mark.parametrize("grads", [("logp",), ("ent",), ("logp", "ent")])
def test_confident_rows_keep_their_gradient(backend, kw, grads):
    """Each row's dX (which only that row feeds) against float64, on rows with 1 - p_t from ~1 to
    4e-9: the target entry of dL/dz is formed from the off-target mass, never as 1 - p_t (which
    fp32 cannot hold below ~6e-8: plain fp32 autograd of log_softmax is off by up to 100% there)."""
    temp = 0.25
    x, w, t = confident_rows()
    p_t = torch.softmax((x.double() @ w.double().T) / temp, 1).gather(1, t.view(-1, 1))
    assert float(1 - p_t.min()) > 0.5 and float(1 - p_t.max()) < 1e-8   # the range is covered
    g = torch.Generator().manual_seed(5)
    up = {k: torch.randn(x.shape[0], generator=g, dtype=torch.float64) for k in ("logp", "ent")}
    xr = x.double().requires_grad_()
    lr, er = ref_logprobs(xr, w.double(), t, None, temp)
    sum(((lr, er)[k == "ent"] * up[k]).sum() for k in grads).backward()
    xk = x.clone().requires_grad_()
    lp, ent = linear_logprobs(xk, w, t, temperature=temp, with_entropy=True, backend=backend, **kw)
    sum(((lp, ent)[k == "ent"] * up[k].float()).sum() for k in grads).backward()
    err = row_rel_err(xk.grad, xr.grad)
    assert float(err.max()) <= CONFIDENT_ROW_TOL, err.tolist()


# ---- gradient plumbing --------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_noncontiguous_upstream_grads_and_backends_agree(backend):
    x, w, t, mask = _inputs(30, 16, 211, seed=11)
    big = torch.randn(60, 2, dtype=torch.float64)
    g_logp, g_ent = big[::2, 0], big[::2, 1]  # strided views
    xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
    lr, er = ref_logprobs(xr, wr, t, mask, 1.0)
    torch.autograd.backward([lr, er], [g_logp, g_ent])
    xk, wk = x.clone().requires_grad_(), w.clone().requires_grad_()
    lp, ent = linear_logprobs(xk, wk, t, mask=mask, with_entropy=True, backend=backend)
    torch.autograd.backward([lp, ent], [g_logp.float(), g_ent.float()])
    assert rel_err(xk.grad, xr.grad) <= GRAD_TOL and rel_err(wk.grad, wr.grad) <= GRAD_TOL


def test_grad_only_for_weight_and_frozen_hidden():
    x, w, t, mask = _inputs(20, 16, 100, seed=12)
    wk = w.clone().requires_grad_()
    lp, _ = linear_logprobs(x, wk, t, mask=mask)
    lp.sum().backward()
    wr = w.double().requires_grad_()
    ref_logprobs(x.double(), wr, t, mask)[0].sum().backward()
    assert rel_err(wk.grad, wr.grad) <= GRAD_TOL


def test_no_grad_forward_and_all_masked_backward():
    x, w, t, _ = _inputs(6, 8, 50, seed=13)
    with torch.no_grad():
        lp, _ = linear_logprobs(x, w, t)
    assert not lp.requires_grad
    xk, wk = x.clone().requires_grad_(), w.clone().requires_grad_()
    lp, ent = linear_logprobs(xk, wk, t, mask=torch.zeros(6, dtype=torch.bool), with_entropy=True)
    (lp.sum() + ent.sum()).backward()
    assert torch.all(lp == 0) and torch.all(ent == 0)
    assert xk.grad is not None and torch.all(xk.grad == 0)
    assert wk.grad is not None and torch.all(wk.grad == 0)


def test_backends_agree_bitwise_close():
    x, w, t, mask = _inputs(40, 32, 1234, seed=14)
    a = linear_logprobs(x, w, t, mask=mask, with_entropy=True, backend="torch")
    b = linear_logprobs(x, w, t, mask=mask, with_entropy=True, backend="triton")
    assert torch.allclose(a[0], b[0], atol=1e-5, rtol=0)
    assert torch.allclose(a[1], b[1], atol=1e-5, rtol=0)


# ---- bad input ----------------------------------------------------------------------------------


def _ok():
    x, w, t, mask = _inputs(10, 8, 20, seed=15)
    return x, w, t, mask


@pytest.mark.parametrize("backend", BACKENDS)
def test_target_out_of_range_names_first_bad_position(backend):
    x, w, t, mask = _ok()
    mask[:] = True
    mask[3] = False
    t[3] = 999          # masked: ignored
    t[5] = 20           # == V: first bad unmasked position
    t[7] = -1
    with pytest.raises(ValueError, match=r"targets\[5\] = 20 .*\[0, 20\)"):
        linear_logprobs(x, w, t, mask=mask, backend=backend)
    t[5] = 0
    with pytest.raises(ValueError, match=r"targets\[7\] = -1"):
        linear_logprobs(x, w, t, mask=mask, backend=backend)
    t[7] = 0
    linear_logprobs(x, w, t, mask=mask, backend=backend)  # t[3] = 999 is masked: fine


@pytest.mark.parametrize("bad,match", [
    (lambda x, w, t, m: (x[0], w, t, m), "hidden must be 2-D"),
    (lambda x, w, t, m: (x, w[:, :4], t, m), "weight shape"),
    (lambda x, w, t, m: (x, w.double(), t, m), "weight dtype"),
    (lambda x, w, t, m: (x.long(), w, t, m), "hidden dtype"),
    (lambda x, w, t, m: (x, w, t[:-1], m), "targets must have shape"),
    (lambda x, w, t, m: (x, w, t.float(), m), "targets dtype"),
    (lambda x, w, t, m: (x, w, t, m[:-1]), "mask must have shape"),
    (lambda x, w, t, m: (x, w, t, m.int()), "mask must be a bool"),
    (lambda x, w, t, m: (x, w.to("meta"), t, m), "weight is on meta"),
    (lambda x, w, t, m: (x, w, t.to("meta"), m), "targets is on meta"),
    (lambda x, w, t, m: (x, w[:0], t, m), "at least one row"),
])
def test_bad_arguments_name_the_argument(bad, match):
    args = bad(*_ok())
    with pytest.raises(ValueError, match=match):
        linear_logprobs(args[0], args[1], args[2], mask=args[3])


def test_bad_options():
    x, w, t, mask = _ok()
    with pytest.raises(ValueError, match="temperature"):
        linear_logprobs(x, w, t, temperature=0.0)
    with pytest.raises(ValueError, match="backend"):
        linear_logprobs(x, w, t, backend="cuda")
    with pytest.raises(ValueError, match="chunk_size"):
        linear_logprobs(x, w, t, chunk_size=0)


def test_dtensor_weight_rejected():
    class DTensor(torch.Tensor):  # stand-in with the class name the check looks for
        pass

    x, w, t, _ = _ok()
    with pytest.raises(ValueError, match="DTensor"):
        linear_logprobs(x, w.as_subclass(DTensor), t)
