"""The fused policy loss's chunk plan (`_fused_linear_loss.fused_loss_rows`, `workspace_bytes=`):
the budget counts the fp32 V x H dW accumulator, bad budgets are refused, and budget-sized chunks
(several, with an odd last one) still match a float64 reference through the Triton interpreter."""
import pytest
import torch

from _kernel_ref import rel_err
from fastrehearse.kernels import PolicyLossConfig, _fused_linear_loss, linear_policy_loss
from fastrehearse.kernels._common import FUSED_WORKSPACE_BYTES_CUDA
from fastrehearse.kernels._fused_linear_loss import fused_loss_rows
from fastrehearse.kernels.linear_logprobs import forward_rows
from test_policy_loss import TOL, make_batch, reference

pytestmark = pytest.mark.usefixtures("one_thread")
CUDA, CPU = torch.device("cuda"), torch.device("cpu")     # device objects only: no GPU needed


def test_default_cuda_plan_counts_the_fp32_accumulator():
    n, h, v = 16384, 4096, 128256
    acc = v * h * 4                                        # 1.96 GiB
    rows = fused_loss_rows(n, v, CUDA, elem_bytes=6, fixed_bytes=acc)   # fp32 Z + bf16 dZ
    assert rows == 1408 and rows % 64 == 0                 # 12 chunks instead of 32 x 512
    assert acc + rows * v * 6 <= FUSED_WORKSPACE_BYTES_CUDA < acc + (rows + 64) * v * 6
    # a caller budget: exactly what it holds, the accumulator counted
    assert fused_loss_rows(n, v, CUDA, elem_bytes=6, fixed_bytes=acc,
                           workspace_bytes=acc + 100 * v * 6) == 100
    with pytest.raises(ValueError, match=r"workspace_bytes=1610612736 cannot hold .* fused=False"):
        fused_loss_rows(n, v, CUDA, elem_bytes=6, fixed_bytes=acc, workspace_bytes=3 << 29)


def test_default_never_below_the_old_chunks_and_cpu_unchanged():
    # an accumulator above the default budget: the default falls back to linear_logprobs' logits
    # chunks (256 MiB of fp32 logits) rather than refusing; only an explicit budget is refused
    n, h, v = 16384, 8192, 256000
    assert fused_loss_rows(n, v, CUDA, elem_bytes=6, fixed_bytes=v * h * 4) \
        == forward_rows(n, v, None, CUDA, "triton")
    assert fused_loss_rows(5000, 3000, CPU, elem_bytes=4, fixed_bytes=10 ** 9) \
        == forward_rows(5000, 3000, None, CPU, "triton")
    assert fused_loss_rows(5000, 3000, CUDA, elem_bytes=4, fixed_bytes=0, chunk_size=7) == 7
    assert fused_loss_rows(50, 3000, CUDA, elem_bytes=4, fixed_bytes=0) == 50   # all rows


def _recorded_rows(monkeypatch):
    seen = []
    real = _fused_linear_loss.fused_loss_rows

    def spy(*a, **kw):
        seen.append(real(*a, **kw))
        return seen[-1]
    monkeypatch.setattr(_fused_linear_loss, "fused_loss_rows", spy)
    return seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("cfg", [PolicyLossConfig(w_observed=0.5),
                                 PolicyLossConfig(kl_coef=0.3, entropy_coef=0.05, temperature=0.8,
                                                  dual_clip=2.0)], ids=["clip", "k3_entropy"])
def test_budgeted_chunks_match_float64_reference(monkeypatch, dtype, cfg):
    batch = make_batch(n=83, h=16, v=257, seed=5, temperature=cfg.temperature)
    batch["hidden"], batch["weight"] = batch["hidden"].to(dtype), batch["weight"].to(dtype)
    ref_loss, ref_dx, ref_dw = reference(batch, cfg)        # float64 of the same (rounded) inputs
    v, h = batch["weight"].shape
    # CPU: dZ in fp32 in place (4 bytes a logit); the fixed part is the fp32 dW accumulator
    budget = v * h * 4 + 17 * v * 4
    seen = _recorded_rows(monkeypatch)
    x = batch["hidden"].clone().requires_grad_()
    w = batch["weight"].clone().requires_grad_()
    out = linear_policy_loss(x, w, batch["targets"], batch["roles"], batch["advantages"],
                             batch["old_logp"], cfg, ref_logp=batch["ref_logp"], fused=True,
                             backend="triton", workspace_bytes=budget)
    out.loss.backward()
    n_loss = sum(int(m["tokens"]) for k, m in out.metrics.items()
                 if k != "observed" or cfg.w_observed)
    assert seen == [17] and n_loss > 2 * 17 and n_loss % 17 != 0   # >= 3 chunks, odd last one
    assert abs(out.loss.item() - ref_loss.item()) <= TOL * max(1.0, abs(ref_loss.item()))
    # dX / dW are returned in the input dtype: fp16 adds its rounding (<= 2^-11 relative)
    out_tol = TOL + (2.0 ** -11 if dtype == torch.float16 else 0.0)
    assert rel_err(x.grad, ref_dx) <= out_tol and rel_err(w.grad, ref_dw) <= out_tol
    assert torch.isfinite(x.grad).all() and torch.isfinite(w.grad).all()


def test_bad_workspace_bytes_refused():
    b = make_batch(n=12, seed=30)
    call = lambda **kw: linear_policy_loss(  # noqa: E731
        b["hidden"].requires_grad_(), b["weight"].requires_grad_(), b["targets"], b["roles"],
        b["advantages"], b["old_logp"], PolicyLossConfig(), backend="triton", **kw)
    for bad in (0, -5, True, 1.5, "1GiB"):
        with pytest.raises(ValueError, match="workspace_bytes must be a positive int"):
            call(workspace_bytes=bad)
    v, h = b["weight"].shape
    with pytest.raises(ValueError, match="cannot hold the fused loss's"):
        call(workspace_bytes=v * h * 4)                     # the accumulator, no room for a row
    call(workspace_bytes=v * h * 4, fused=False)            # unfused: linear_logprobs' budget


def test_bf16_logits_would_be_unsound():
    """Why the fused loss keeps fp32 logits (docs/gpu.md, idea (b)): log-probs from logits rounded
    to bf16 (what a bf16 logits buffer holds) are off by ~1e-2 nats and more against float64 at a
    logit spread of std 3, vs ~1e-5 with fp32 logits; a PPO clip of 0.2 on exp(logp - old)
    cannot absorb that."""
    g = torch.Generator().manual_seed(0)
    n, h, v = 128, 256, 8000
    x = torch.randn(n, h, generator=g, dtype=torch.float64)
    w = torch.randn(v, h, generator=g, dtype=torch.float64) * 3.0 / h ** 0.5
    t = torch.randint(0, v, (n, 1), generator=g)
    z = x @ w.T
    ref = torch.log_softmax(z, -1).gather(1, t)

    def err(stored):        # the softmax itself in float64: only the storage rounding differs
        return float((torch.log_softmax(stored.double(), -1).gather(1, t) - ref).abs().max())
    assert err(z.float()) < 1e-4            # ~9e-7
    assert err(z.bfloat16()) > 1e-2         # ~5.6e-2


# ---- dw_accum_dtype=weight.dtype: dW accumulated in the returned low-precision dW ---------------
# Each chunk rounds the running dW once to the weight dtype (unit roundoff u), so against float64
# dW carries up to ~k * u relative error after k chunks (each rounding <= u * |running sum|, and a
# running sum of random-signed chunk terms stays within ~|final dW|), plus the final rounding.
UNIT_ROUNDOFF = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}


@pytest.mark.parametrize("dtype,backend", [(torch.float16, "triton"), (torch.float16, "torch"),
                                           (torch.bfloat16, "torch")])
def test_weight_dtype_accumulation_matches_float64_within_its_roundings(monkeypatch, dtype,
                                                                         backend):
    cfg = PolicyLossConfig(w_observed=0.5)
    batch = make_batch(n=83, h=16, v=257, seed=6)
    batch["hidden"], batch["weight"] = batch["hidden"].to(dtype), batch["weight"].to(dtype)
    ref_loss, ref_dx, ref_dw = reference(batch, cfg)
    v, h = batch["weight"].shape

    def run(acc, budget):
        x = batch["hidden"].clone().requires_grad_()
        w = batch["weight"].clone().requires_grad_()
        out = linear_policy_loss(x, w, batch["targets"], batch["roles"], batch["advantages"],
                                 batch["old_logp"], cfg, fused=True, backend=backend,
                                 workspace_bytes=budget, dw_accum_dtype=acc)
        out.loss.backward()
        return out, x.grad, w.grad

    # the torch fast path (no entropy, no head variant, CPU) keeps a fp32 weight copy and, with a
    # low-precision accumulator, one fp32 chunk sum (V x H fp32 each: no saving there); the
    # Triton path (the CUDA one) holds only the chunk's logits
    fixed = 2 * v * h * 4 if backend == "torch" else 0
    budget = fixed + 12 * v * 4            # 12 rows of fp32 logits
    seen = _recorded_rows(monkeypatch)
    out, dx, dw = run(dtype, budget)
    assert seen == [12]                    # the accumulator is the returned dW: not in the budget
    if backend == "triton":                # 12 rows < the 16 rows' worth of an fp32 accumulator
        with pytest.raises(ValueError, match="cannot hold the fused loss's"):
            run(torch.float32, budget)
    n_loss = sum(int(m["tokens"]) for m in out.metrics.values())
    k = -(-n_loss // 12)
    assert k >= 3 and dw.dtype == dtype
    u = UNIT_ROUNDOFF[dtype]
    assert abs(out.loss.item() - ref_loss.item()) <= TOL * max(1.0, abs(ref_loss.item()))
    assert rel_err(dx, ref_dx) <= TOL + u                  # dX: untouched by the option
    err_low = rel_err(dw, ref_dw)
    assert err_low <= TOL + (k + 1) * u, (err_low, k)
    _, _, dw32 = run(torch.float32, budget + (v * h * 4 if backend == "triton" else 0))
    assert seen[-1] == 12                                  # fp32 accumulator, same 12-row chunks
    assert rel_err(dw32, ref_dw) <= TOL + u
    assert not torch.equal(dw32, dw)                       # the option did change the summation


def test_bad_dw_accum_dtype_refused():
    b = make_batch(n=12, seed=31)
    for w_dtype, bad in ((torch.float32, torch.float16), (torch.bfloat16, torch.float16),
                         (torch.float16, torch.float64), (torch.float32, "bf16")):
        with pytest.raises(ValueError, match="dw_accum_dtype must be torch.float32 or the weight"):
            linear_policy_loss(b["hidden"].to(w_dtype), b["weight"].to(w_dtype), b["targets"],
                               b["roles"], b["advantages"], b["old_logp"], PolicyLossConfig(),
                               backend="torch", dw_accum_dtype=bad)


# ---- the fp32-output GEMM probe: warned once, recorded, an OOM never taken for "unsupported" ----
def test_out_dtype_probe_warns_once_and_never_swallows_oom(monkeypatch):
    from fastrehearse.kernels import _common
    monkeypatch.setattr(_common, "_OUT_DTYPE_OK", {})
    like = torch.ones(2, 2, dtype=torch.bfloat16)

    def mm(*a, **kw):                           # a torch without out_dtype
        raise TypeError("mm() got an unexpected keyword argument 'out_dtype'")
    with pytest.warns(UserWarning, match=r"torch.mm\(..., out_dtype=float32\) is unavailable"):
        assert _common._out_dtype_ok(mm, like) is False
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # once: the second call neither probes nor warns
        assert _common._out_dtype_ok(mm, like) is False
    assert [k for k, ok in _common._OUT_DTYPE_OK.items() if not ok] == ["mm:cpu:bfloat16"]

    def addmm(*a, **kw):                        # the probe itself runs out of memory
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    with pytest.raises(torch.OutOfMemoryError):
        _common._out_dtype_ok(addmm, like)
    assert "addmm:cpu:bfloat16" not in _common._OUT_DTYPE_OK    # not recorded as unsupported
    # a torch that has it (this one, on the CPU): the real op probes fine, nothing recorded
    assert _common._out_dtype_ok(torch.mm, like) in (True, False)
