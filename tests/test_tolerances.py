"""The suite's fp32 tolerance (`_kernel_ref.fp32_atol`, docs/tolerances.md) checked in both directions on
the inputs where it matters most, logits of a few hundred: every summation order a CPU may use
passes it, and the bugs the kernel tests exist for fail it by a wide margin.

Summation orders are emulated here (the GEMM's k-sum done forwards, backwards, in blocks of 4,
and by torch's own kernels, under whichever instruction set this process dispatches to); the
real instruction sets and thread counts are run by `make test-isa` (tests/isa_matrix.py)."""
import pytest
import torch

from _kernel_ref import U32, fp32_atol, logits_atol, max_abs_err, ref_logprobs
from fastrehearse.kernels import linear_logprobs

pytestmark = pytest.mark.usefixtures("one_thread")

N, H, V, SCALE, T = 19, 16, 700, 80.0, 0.7     # test_linear_logprobs' large_logits shape


def _large_logits(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, H, generator=g)
    w = torch.randn(V, H, generator=g) * (SCALE / H ** 0.5)
    t = torch.randint(0, V - 1, (N,), generator=g)
    return x, w, t


def _orders(x, w):
    """fp32 logits x @ w.T summed in four different orders."""
    fwd = torch.zeros(N, V)
    for k in range(H):
        fwd = fwd + x[:, k:k + 1] * w[:, k]
    bwd = torch.zeros(N, V)
    for k in reversed(range(H)):
        bwd = bwd + x[:, k:k + 1] * w[:, k]
    blocks = sum(x[:, k:k + 4] @ w[:, k:k + 4].T for k in range(0, H, 4))
    return {"torch": x @ w.T, "forward": fwd, "backward": bwd, "blocks_of_4": blocks}


def test_bound_is_8_to_16_ulps_of_the_largest_value_plus_the_floor():
    ref = torch.tensor([-75.0, 1.0])
    assert fp32_atol(ref, floor=0.0) == pytest.approx(16 * U32 * 75.0)
    for m in (64.0, 75.0, 127.9):   # [64, 128): ulp = 2^(6 - 23); 16 U32 m is 8 to 16 ulps
        ulp = 2.0 ** -17
        assert 8 * ulp <= fp32_atol(torch.tensor([m]), floor=0.0) < 16 * ulp
    assert fp32_atol(ref) > 1e-5 and fp32_atol(torch.tensor([900.0])) < 1e-3


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_summation_order_passes(seed):
    x, w, t = _large_logits(seed)
    lp64, ent64 = ref_logprobs(x.double(), w.double(), t, temperature=T)
    tol = logits_atol(x, w, lp64, T)
    assert float(lp64.abs().max()) > 100          # the regime where a fixed 1e-5 is < 1 ulp
    for name, z in _orders(x, w).items():
        lp = torch.log_softmax(z / T, -1).gather(1, t[:, None])[:, 0]
        assert max_abs_err(lp, lp64) <= tol, name
    for backend in ("torch", "triton", "triton-fused"):
        lp, ent = linear_logprobs(x, w, t, temperature=T, backend=backend, with_entropy=True)
        assert max_abs_err(lp, lp64) <= tol, backend
        assert max_abs_err(ent, ent64) <= tol, backend


@pytest.mark.parametrize("bug", ["target_off_by_one", "temperature_twice", "mask_ignored",
                                 "last_vocab_tile_dropped"])
def test_planted_bugs_fail_it(bug):
    """Each bug's error against float64 is over 10x the bound on the same inputs."""
    x, w, t = _large_logits(3)
    mask = torch.arange(N) % 3 != 0
    lp64, _ = ref_logprobs(x.double(), w.double(), t, mask, temperature=T)
    tol = logits_atol(x, w, lp64, T)
    if bug == "target_off_by_one":
        lp, _ = linear_logprobs(x, w, t + 1, mask=mask, temperature=T, backend="torch")
    elif bug == "temperature_twice":
        lp, _ = linear_logprobs(x / T, w, t, mask=mask, temperature=T, backend="torch")
    elif bug == "mask_ignored":
        lp, _ = linear_logprobs(x, w, t, temperature=T, backend="torch")
    else:   # an online-lse merge that loses one 64-column tile: the one holding the row's max
        z = (x @ w.T) / T
        tile = z.argmax(-1) // 64
        cols = torch.arange(V)
        keep = (cols[None, :] // 64) != tile[:, None]
        lse = torch.logsumexp(torch.where(keep, z, torch.full_like(z, -torch.inf)), -1)
        lp = torch.where(mask, z.gather(1, t[:, None])[:, 0] - lse, torch.zeros(()))
    assert max_abs_err(lp, lp64) > 10 * tol, (bug, max_abs_err(lp, lp64), tol)
