"""The vocabulary-outer backward (kernels/_vocab_outer.py: Triton backend and LM-head variants):
float64 references at plans with one and several row groups and many vocabulary blocks (Triton
through TRITON_INTERPRET=1, fp32/fp16 inputs), the budget arithmetic at the target GPU shape,
and that with one row group no dW accumulator is read back."""
import pytest
import torch

from _kernel_ref import rel_err
from fastrehearse.kernels import linear_logprobs
from fastrehearse.kernels import _common, _vocab_outer

pytestmark = pytest.mark.usefixtures("one_thread")


def _ref(x, w, b, t, mask, cap, temperature):
    z = x.double() @ w.double().T
    if b is not None:
        z = z + b.double()
    if cap is not None:
        z = cap * torch.tanh(z / cap)
    lp = torch.log_softmax(z / temperature, -1)
    logp = torch.where(mask, lp.gather(1, t.clamp(0).view(-1, 1)).squeeze(1), 0.0)
    ent = torch.where(mask, -(lp.exp() * lp).sum(-1), 0.0)
    return logp, ent


PLANS = {  # name: (workspace_bytes, chunk_size) at n=41 rows, h=24, v=1037
    "default_one_block": (None, None),
    "one_group_many_blocks": (41 * 24 * 4 + 41 * 8 * 200, None),
    "row_groups": (None, 9),
    "row_groups_and_blocks": (20_000, 7),
    "minimal_blocks": (1, None),            # below any real budget: 16-column blocks
}


PATHS = [("triton", None, torch.float32), ("triton", "cap_bias", torch.float32),
         ("triton", None, torch.float16), ("torch", "cap_bias", torch.float32),
         ("torch", "bias", torch.float16)]
# 16-column blocks are ~65 interpreted launches per call on Triton: that plan runs on torch only
CASES = [(p, *path) for p in PLANS for path in PATHS
         if not (p == "minimal_blocks" and path[0] == "triton")]


@pytest.mark.parametrize("plan,backend,variant,dtype", CASES)
def test_vocab_outer_backward_matches_float64(plan, backend, variant, dtype):
    ws, chunk = PLANS[plan]
    n, h, v, temp = 41, 24, 1037, 0.9
    g = torch.Generator().manual_seed(len(plan) + h)
    x = torch.randn(n, h, generator=g).to(dtype)
    w = (torch.randn(v, h, generator=g) * 3 / h ** 0.5).to(dtype)
    b = torch.randn(v, generator=g).to(dtype) if variant else None
    cap = 4.0 if variant == "cap_bias" else None
    t = torch.randint(0, v, (n,), generator=g)
    t[:4] = torch.tensor([0, v - 1, 16, 15])            # targets at block edges
    mask = torch.rand(n, generator=g) > 0.2
    g1 = torch.randn(n, generator=g, dtype=torch.float64)
    g2 = torch.randn(n, generator=g, dtype=torch.float64)
    rows, cols = _vocab_outer.vocab_outer_plan(int(mask.sum()), h, v, torch.device("cpu"),
                                               block_elem_bytes=8, workspace_bytes=ws, rows=chunk)
    if ws is not None:
        assert cols < v                                   # several vocabulary blocks really run
    if plan.startswith("row_groups"):
        assert rows < int(mask.sum())

    xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
    br = None if b is None else b.double().requires_grad_()
    lp_r, ent_r = _ref(xr, wr, br, t, mask, cap, temp)
    ((lp_r * g1).sum() + (ent_r * g2).sum()).backward()
    lp_r, ent_r = lp_r.detach(), ent_r.detach()

    xk, wk = x.clone().requires_grad_(), w.clone().requires_grad_()
    bk = None if b is None else b.clone().requires_grad_()
    lp, ent = linear_logprobs(xk, wk, t, mask=mask, temperature=temp, with_entropy=True,
                              backend=backend, bias=bk, logit_softcap=cap, chunk_size=chunk,
                              workspace_bytes=ws)
    assert float((lp.detach().double() - lp_r).abs().max()) <= 1e-4
    assert float((ent.detach().double() - ent_r).abs().max()) <= 1e-4
    ((lp * g1.float()).sum() + (ent * g2.float()).sum()).backward()
    tol = 1e-3 if dtype == torch.float16 else 1e-4       # fp16 rounding of returned gradients
    assert xk.grad.dtype == dtype and wk.grad.dtype == dtype
    assert rel_err(xk.grad, xr.grad) <= tol and rel_err(wk.grad, wr.grad) <= tol
    # every element, not only the norm: per-row / per-vocabulary-row relative errors
    assert float(((xk.grad.double() - xr.grad).norm(dim=1) / xr.grad.norm(dim=1).clamp_min(1e-12))
                 [mask].max()) <= 20 * tol
    assert torch.all(xk.grad[~mask] == 0)
    if b is not None:
        assert rel_err(bk.grad, br.grad) <= tol


def test_plan_at_the_target_shape_fits_the_budget_and_writes_dw_once():
    """N=16384, H=4096, V=128256, bf16 on CUDA: all rows in one group (each dW block written
    once), workspace (fp32 dX accumulator + logits/dZ blocks + an fp32 dW block) <= 1 GiB."""
    n, h, v = 16384, 4096, 128256
    cuda = torch.device("cuda")
    for elem in (4 + 2, 4 + 4 + 2):                      # plain head; soft-cap (pre-cap block too)
        rows, cols = _vocab_outer.vocab_outer_plan(n, h, v, cuda, block_elem_bytes=elem)
        work = rows * h * 4 + rows * cols * elem + cols * h * 4
        assert rows == n and cols >= 2048 and cols % 128 == 0
        assert work <= _common.WORKSPACE_BYTES_CUDA
    rows, cols = _vocab_outer.vocab_outer_plan(n, h, v, cuda, block_elem_bytes=6,
                                               workspace_bytes=256 << 20)
    assert rows < n and rows * h * 4 <= 128 << 20        # a small budget: row groups
    assert _vocab_outer.vocab_outer_plan(n, h, v, cuda, block_elem_bytes=6, rows=1000)[0] == 1000
    with pytest.raises(ValueError, match="workspace_bytes must be a positive int"):
        linear_logprobs(torch.randn(2, 4), torch.randn(5, 4), torch.tensor([0, 1]),
                        workspace_bytes=0)


def test_one_row_group_reads_back_no_dw_accumulator(monkeypatch):
    """With one row group the only accumulate-GEMM target is the fp32 [R, H] dX; with several
    groups the dW blocks of later groups accumulate."""
    seen = []
    real = _vocab_outer.addmm_f32_

    def spy(acc, a, b):
        seen.append(tuple(acc.shape))
        return real(acc, a, b)

    monkeypatch.setattr(_vocab_outer, "addmm_f32_", spy)
    n, h, v = 23, 16, 517
    x = torch.randn(n, h, requires_grad=True)
    w = torch.randn(v, h, requires_grad=True)
    t = torch.randint(0, v, (n,))
    lp, _ = linear_logprobs(x, w, t, backend="triton", workspace_bytes=n * h * 4 + 40_000)
    lp.sum().backward()
    assert seen and set(seen) == {(n, h)}
    seen.clear()
    x.grad = w.grad = None
    lp, _ = linear_logprobs(x, w, t, backend="triton", chunk_size=10, workspace_bytes=40_000)
    lp.sum().backward()
    assert any(s[1] == h and s[0] != 10 and s[0] != 3 for s in seen)   # dW blocks accumulate
