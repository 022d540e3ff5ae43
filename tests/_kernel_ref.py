"""float64 references shared by the kernel tests (materialized logits: fine at test sizes)."""
import math

import torch

U32 = 2.0 ** -24   # fp32 unit roundoff: ulp(x) / 2 <= U32 * |x|


def fp32_atol(ref, floor=1e-5, mag=0.0, terms=1):
    """Absolute error allowed to a correct fp32 result against `ref`, under any summation order
    (any instruction set, thread count or BLAS kernel; docs/tolerances.md). Three stated parts:
    - `floor`: the tolerance the test had for O(1) values (what it exists to catch sits above it);
    - 16 U32 * max|ref|: the result's own rounding. Two correct fp32 paths round a log-prob of
      size m at ulp(m) ~ 2 U32 m per step (ulp(75) = 7.6e-6: a fixed 1e-5 is 1.3 ulp there, which
      is how an Intel box failed tests that passed here); 16 U32 is 8-16 ulps of the largest value,
      for the few roundings of log-sum-exp and the head's scale / cap / bias steps;
    - 2 sqrt(terms) U32 * mag: the GEMM the logits come from, mag >= max_i sum_k |x_ik w_vk| / T
      over `terms` products (typical error sqrt(k) U32 mag; worst case k U32 mag).
    Bugs the kernel tests exist to catch (a dropped mask / bias / scale / cap, a wrong merge,
    attention leaking across documents) move log-probs by >= 1e-2, far above this bound at the
    tests' sizes (|ref| <= ~900: 9e-4)."""
    big = float(ref.detach().abs().max()) if ref.numel() else 0.0
    return floor + 16 * U32 * big + 2 * math.sqrt(terms) * U32 * float(mag)


def logits_atol(x, w, ref, temperature=1.0, floor=1e-5):
    """fp32_atol for log-probs / entropies of the logits x @ w.T / T: mag = max_i sum_k
    |x_ik w_vk| / T over the hidden size k (x: [N, k], w: [V, k])."""
    mag = float((x.detach().double().abs() @ w.detach().double().abs().T).max()) / temperature
    return fp32_atol(ref, floor=floor, mag=mag, terms=x.shape[-1])


def max_abs_err(a, b):
    return float((a.detach().double() - b.detach().double()).abs().max())


def ref_logprobs(x, w, t, mask=None, temperature=1.0):
    """logp, entropy in float64 from the same inputs; masked rows are 0."""
    z = (x.double() @ w.double().T) / temperature
    lp = torch.log_softmax(z, dim=-1)
    logp = lp.gather(1, t.clamp(0, w.shape[0] - 1).long().view(-1, 1)).squeeze(1)
    ent = -(lp.exp() * lp).sum(-1)
    if mask is not None:
        logp = torch.where(mask, logp, torch.zeros_like(logp))
        ent = torch.where(mask, ent, torch.zeros_like(ent))
    return logp, ent


def rel_err(a, b):
    a, b = a.double(), b.double()
    den = b.norm()
    if den == 0:
        return float(a.norm())
    return float((a - b).norm() / den)


def ref_policy_loss(x, w, t, roles, adv, old, ref, cfg, normalizers=None, token_weights=None,
                    pg_weights=None):
    """float64 role-wise GRPO loss written out token by token from the spec (docs/kernels.md)."""
    n = x.shape[0]
    z = (x.double() @ w.double().T) / cfg.temperature
    lp_all = torch.log_softmax(z, dim=-1)
    ent = -(lp_all.exp() * lp_all).sum(-1)
    role_w = {1: cfg.w_act, 2: cfg.w_rehearse, 3: cfg.w_observed}
    counts = {r: int((roles == r).sum()) for r in (1, 2, 3)}
    norm = normalizers if normalizers is not None else [0, counts[1], counts[2], counts[3]]
    loss = x.new_zeros((), dtype=torch.float64)
    for i in range(n):
        r = int(roles[i])
        if r == 0 or role_w[r] == 0:
            continue
        lp = lp_all[i, int(t[i])]
        if r == 3:
            l = -lp
        else:
            a = float(adv[i])
            rho = torch.exp(lp - float(old[i]))
            l = torch.maximum(-a * rho, -a * torch.clamp(rho, 1 - cfg.clip_low, 1 + cfg.clip_high))
            if cfg.dual_clip is not None and a < 0:
                l = torch.minimum(l, torch.tensor(-cfg.dual_clip * a, dtype=torch.float64))
            if pg_weights is not None:          # the policy-gradient term only
                l = float(pg_weights[i]) * l
            if cfg.kl_coef:
                d = float(ref[i]) - lp
                kl = {"k1": -d, "k2": 0.5 * d * d, "k3": torch.exp(d) - d - 1}[cfg.kl_type]
                l = l + cfg.kl_coef * kl
            if cfg.entropy_coef:
                l = l - cfg.entropy_coef * ent[i]
        c = float(token_weights[i]) if token_weights is not None else 1.0 / float(norm[r])
        loss = loss + role_w[r] * c * l
    return loss


def confident_rows(n=10, h=24, v=301, seed=0):
    """Rows whose target is the argmax by a margin growing with the row: at T = 1/4, 1 - p_t runs
    from ~1 down to 4e-9. Dyadic inputs: X W^T is exact in fp32, so only the softmax math is
    measured."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-4, 5, (n, h), generator=g) / 4
    w = torch.randint(-4, 5, (v, h), generator=g) / 16
    t = torch.randperm(v, generator=g)[:n]
    w[t] = x / 16 * torch.arange(1, n + 1).view(-1, 1)
    return x, w, t


def row_rel_err(a, b):
    return (a.double() - b).norm(dim=1) / b.norm(dim=1)


CONFIDENT_ROW_TOL = 1e-5   # per row of dX (measured <= 2e-6; the entry formed from 1 - p_t: up to 10)
