"""The kernels on a real CUDA device (skipped without one): the compiled Triton path (no
interpreter), bf16 with fp32-result GEMMs, and the torch backend on CUDA, against float64.

The CPU tests cover the math with the Triton interpreter in fp32/fp16; these check what only a
GPU runs: bf16 tensor-core GEMMs (`out_dtype=float32` where torch has it), bf16 dZ, compiled
Triton row kernels at a real block size, the fused tl.dot + log-sum-exp tile kernel
('triton-fused') on real bf16 tensor cores. Run by benchmarks/gpu_check.sh.
"""
import pytest
import torch

from _kernel_ref import (CONFIDENT_ROW_TOL, confident_rows, ref_logprobs, ref_policy_loss, rel_err,
                         row_rel_err)
from fastrehearse.kernels import PolicyLossConfig, Role, linear_logprobs, linear_policy_loss

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# fp32: the CPU tolerances. bf16: inputs are rounded to bf16 and the float64 reference uses
# the same rounded values, so logp sees only fp32-result GEMM rounding; gradients go through
# a bf16 dZ (2^-8 relative) and come back in bf16.
TOL = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (1e-3, 8e-3),
       torch.float16: (1e-4, 2e-3)}    # fp16: fp32-accumulated logits; dZ / grads 2^-11 rounding


def _inputs(n, h, v, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g).to(dtype)
    w = (torch.randn(v, h, generator=g) * (scale / h ** 0.5)).to(dtype)
    t = torch.randint(0, v, (n,), generator=g)
    mask = torch.rand(n, generator=g) >= 0.3
    return x, w, t, mask


@pytest.fixture(autouse=True)
def _no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False   # fp32 means fp32 in the reference checks
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


@pytest.mark.parametrize("backend", ["triton", "triton-fused", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,h,v,temperature,scale", [(301, 256, 5003, 0.8, 1.0),
                                                     (67, 128, 50257, 1.0, 30.0)])
def test_linear_logprobs_cuda(backend, dtype, n, h, v, temperature, scale):
    x, w, t, mask = _inputs(n, h, v, dtype, seed=n + v, scale=scale)
    t = torch.where(mask, t, torch.full_like(t, -100))
    g = torch.Generator().manual_seed(1)
    g1, g2 = torch.randn(n, generator=g, dtype=torch.float64), torch.randn(n, generator=g,
                                                                           dtype=torch.float64)
    xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
    lr, er = ref_logprobs(xr, wr, t, mask, temperature)
    ((lr * g1).sum() + (er * g2).sum()).backward()

    xk = x.cuda().requires_grad_()
    wk = w.cuda().requires_grad_()
    lp, ent = linear_logprobs(xk, wk, t.cuda(), mask=mask.cuda(), temperature=temperature,
                              with_entropy=True, backend=backend)
    ((lp * g1.float().cuda()).sum() + (ent * g2.float().cuda()).sum()).backward()
    torch.cuda.synchronize()
    logp_tol, grad_tol = TOL[dtype]
    assert float((lp.cpu().double() - lr.detach()).abs().max()) <= logp_tol
    assert float((ent.cpu().double() - er.detach()).abs().max()) <= logp_tol
    assert torch.all(lp.cpu()[~mask] == 0)
    assert xk.grad.dtype == dtype and wk.grad.dtype == dtype
    assert rel_err(xk.grad.cpu(), xr.grad) <= grad_tol
    assert rel_err(wk.grad.cpu(), wr.grad) <= grad_tol


@pytest.mark.parametrize("backend", ["triton", "triton-fused", "torch"])
def test_confident_rows_cuda(backend):
    """Rows with 1 - p_t from ~1 down to 4e-9 (fp32, exact dyadic GEMM): each row's dX within
    CONFIDENT_ROW_TOL of float64, as on the CPU (the target entry from the off-target mass)."""
    x, w, t = confident_rows()
    g = torch.Generator().manual_seed(5)
    g1, g2 = (torch.randn(x.shape[0], generator=g, dtype=torch.float64) for _ in range(2))
    xr = x.double().requires_grad_()
    lr, er = ref_logprobs(xr, w.double(), t, None, 0.25)
    ((lr * g1).sum() + (er * g2).sum()).backward()
    xk = x.cuda().requires_grad_()
    lp, ent = linear_logprobs(xk, w.cuda(), t.cuda(), temperature=0.25, with_entropy=True,
                              backend=backend)
    ((lp * g1.float().cuda()).sum() + (ent * g2.float().cuda()).sum()).backward()
    err = row_rel_err(xk.grad.cpu(), xr.grad)
    assert float(err.max()) <= CONFIDENT_ROW_TOL, err.tolist()


@pytest.mark.parametrize("fused,backend", [(True, "triton"), (False, "triton"), (True, "torch"),
                                           (False, "torch")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_policy_loss_cuda(fused, backend, dtype):
    n, h, v = 96, 64, 3001
    cfg = PolicyLossConfig(kl_coef=0.3, kl_type="k3", entropy_coef=0.05, w_observed=0.5,
                           dual_clip=2.0, temperature=0.9)
    x, w, t, _ = _inputs(n, h, v, dtype, seed=7)
    g = torch.Generator().manual_seed(8)
    roles = torch.randint(0, 4, (n,), generator=g)
    with torch.no_grad():
        lp, _ = linear_logprobs(x.float(), w.float(), t, temperature=cfg.temperature,
                                backend="torch")
    rl = (roles == int(Role.ACT)) | (roles == int(Role.REHEARSE))
    nan = torch.full((n,), float("nan"))
    adv = torch.where(rl, torch.randn(n, generator=g), nan)
    old = torch.where(rl, lp + 0.4 * torch.randn(n, generator=g), nan)
    ref = torch.where(rl, lp + 0.4 * torch.randn(n, generator=g), nan)

    xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
    loss_ref = ref_policy_loss(xr, wr, t, roles, adv, old, ref, cfg)
    loss_ref.backward()

    xk, wk = x.cuda().requires_grad_(), w.cuda().requires_grad_()
    out = linear_policy_loss(xk, wk, t.cuda(), roles.cuda(), adv.cuda(), old.cuda(), cfg,
                             ref_logp=ref.cuda(), fused=fused, backend=backend)
    out.loss.backward()
    torch.cuda.synchronize()
    logp_tol, grad_tol = TOL[dtype]
    assert abs(out.loss.item() - loss_ref.item()) <= logp_tol * max(1.0, abs(loss_ref.item()))
    assert rel_err(xk.grad.cpu(), xr.grad) <= grad_tol
    assert rel_err(wk.grad.cpu(), wr.grad) <= grad_tol


@pytest.mark.parametrize("chunk", [None, 17])
def test_policy_loss_cuda_bf16_dw_accumulator(chunk):
    """dw_accum_dtype=torch.bfloat16 on the GPU path (cuBLAS addmm into the bf16 dW, beta = 1):
    dW within k + 1 bf16 roundings of float64, dX as tight as the default."""
    n, h, v = 96, 64, 3001
    cfg = PolicyLossConfig(w_observed=0.5)
    x, w, t, _ = _inputs(n, h, v, torch.bfloat16, seed=9)
    g = torch.Generator().manual_seed(10)
    roles = torch.randint(0, 4, (n,), generator=g)
    rl = (roles == int(Role.ACT)) | (roles == int(Role.REHEARSE))
    with torch.no_grad():
        lp, _ = linear_logprobs(x.float(), w.float(), t, backend="torch")
    nan = torch.full((n,), float("nan"))
    adv = torch.where(rl, torch.randn(n, generator=g), nan)
    old = torch.where(rl, lp + 0.4 * torch.randn(n, generator=g), nan)
    xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
    ref_policy_loss(xr, wr, t, roles, adv, old, None, cfg).backward()
    xk, wk = x.cuda().requires_grad_(), w.cuda().requires_grad_()
    out = linear_policy_loss(xk, wk, t.cuda(), roles.cuda(), adv.cuda(), old.cuda(), cfg,
                             backend="triton", chunk_size=chunk, dw_accum_dtype=torch.bfloat16)
    out.loss.backward()
    torch.cuda.synchronize()
    rows = sum(1 for r in roles.tolist() if cfg.role_weights()[r] != 0)
    k = 1 if chunk is None else -(-rows // chunk)
    logp_tol, grad_tol = TOL[torch.bfloat16]
    assert wk.grad.dtype == torch.bfloat16
    assert rel_err(xk.grad.cpu(), xr.grad) <= grad_tol
    assert rel_err(wk.grad.cpu(), wr.grad) <= grad_tol + (k + 1) * 2.0 ** -8
