"""Role-wise GRPO / PPO-clip loss fused with the LM-head projection (one pass, 6NHV FLOPs).

For loss-bearing token t with role r = roles[t], logp_t from `linear_logprobs` (with the same
LM-head variants: bias, logit_scale, logit_softcap), A_t = advantage, sg = stop-gradient:

    ACT, REHEARSE:
      log-ratio   d_t = logp_t - old_t                     importance_sampling="token" (default)
                  d_t = mean_{u in seq(t)} (logp_u - old_u)  "sequence" (GSPO; u over the RL
                                                            tokens of t's sequence, by seq_ids)
                  old_logp=None (on-policy): old = sg(logp), so d = 0 with gradient 1
      ratio       rho = exp(d)
      pg_loss="ppo_clip":  l_pg = max(-A rho, -A clip(rho, 1 - clip_low, 1 + clip_high))
                           l_pg = min(l_pg, -c A)          if dual_clip = c and A < 0
      pg_loss="cispo":     l_pg = -sg(min(rho, 1 + clip_high)) A logp
      l = g_t l_pg + kl_coef * KL(logp, ref_logp) [* rho if kl_ratio] - entropy_coef * H
          g_t = pg_weights[t] (detached; 1 if not given): a per-token factor on the policy
          gradient term alone -- truncated importance sampling against the rollout engine's
          log-probs (fastrehearse.algo.tis), which must not scale a KL penalty or entropy bonus
          KL: k1 = logp - ref, k2 = (logp - ref)^2 / 2, k3 = exp(ref - logp) - (ref - logp) - 1
    OBSERVED:       l = -logp                          (supervised CE on real tool responses)
    CONTEXT:        nothing (and no projection work)

    loss = sum_r w_r * sum_{t in r} c_t * l_t,   c_t = 1 / n_r                    (default)
                                                 c_t = token_weights[t]           (if given)

n_r = normalizers[r] (global token counts: all-reduced over ranks, summed over micro-batches)
or the role's token count in this call; a role with no tokens contributes 0. `token_weights`
*replaces* 1/n_r (still times w_r): `fastrehearse.algo.aggregation` builds them for
seq-mean-token-mean (GRPO) and seq-mean-token-sum-norm (Dr. GRPO). Roles with w_r = 0 are
compacted out with CONTEXT: no projection work, exactly zero gradient, logp reported as 0.

Fused path: dl/dlogp and dl/dH are known as soon as logp and H are, so each chunk does
Z = X_c W^T -> row stats -> per-token dl/dlogp, dl/dH -> dZ in place -> dX_c = dZ W,
dW += dZ^T X_c. Backward only scales the stored dX, dW (, d bias) by grad_output. 6NHV instead
of 8NHV. dW accumulates in fp32 across chunks by default (a V x H accumulator, read and written
once per chunk), so the chunk size comes from a workspace budget that counts that accumulator
(`workspace_bytes`, `_common.fused_loss_rows`): few, large chunks hide its traffic behind the
dW GEMM's FLOPs. `dw_accum_dtype=weight.dtype` accumulates in the returned low-precision dW
instead (each chunk's dZ^T X_c summed in fp32 inside the GEMM, the running dW rounded once per
chunk, as Liger's FLCE): no accumulator in the workspace and half its traffic, for k roundings
of dW instead of one (k = number of chunks; relative error <= k * 2^-8 for bf16). A sequence-level ratio couples the tokens of a sequence (its gradient needs
every logp of the sequence first), so importance_sampling="sequence" runs the unfused path
(8NHV).
Unfused path: `linear_logprobs` + the same loss written as plain autograd torch (the reference).
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from numbers import Integral, Real
from typing import Sequence

import torch

from ._common import (check_fused_forward, check_linear_inputs, check_targets,
                      check_workspace_bytes, fused_loss_rows, fused_rows, resolve_backend)
from ._rowmath import row_stats, target_grad
from ._head import build_head
from .linear_logprobs import chunk_grad, head_logits, linear_logprobs
from ._vocab_outer import block_elem_bytes
from .roles import NUM_ROLES, Role

__all__ = ["PolicyLossConfig", "PolicyLossOutput", "linear_policy_loss"]

KL_TYPES = ("k1", "k2", "k3")
IS_LEVELS = ("token", "sequence")
PG_LOSSES = ("ppo_clip", "cispo")
_RL_ROLES = (int(Role.ACT), int(Role.REHEARSE))


def _num(name, value, *, lo=None, lo_open=False, hi=None, hi_open=False, optional=False):
    """A finite real number (bool and str refused) within the given bounds, as float."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, Real):
        raise ValueError(f"PolicyLossConfig.{name} must be a number, got {value!r}")
    v = float(value)
    bad = (not math.isfinite(v) or (lo is not None and (v <= lo if lo_open else v < lo))
           or (hi is not None and (v >= hi if hi_open else v > hi)))
    if bad:
        rng = (f"{'(' if lo_open else '['}{'-inf' if lo is None else lo}, "
               f"{'inf' if hi is None else hi}{')' if hi_open or hi is None else ']'}")
        raise ValueError(f"PolicyLossConfig.{name} must be finite and in {rng}, got {value!r}")
    return v


def _choice(name, value, options):
    if value not in options:
        raise ValueError(f"PolicyLossConfig.{name} must be one of {options}, got {value!r}")
    return value


def _flag(name, value):
    if not isinstance(value, bool):
        raise ValueError(f"PolicyLossConfig.{name} must be True or False, got {value!r}")
    return value


_FIELD_CHECKS = {
    "w_act": lambda v: _num("w_act", v, lo=0.0),
    "w_rehearse": lambda v: _num("w_rehearse", v, lo=0.0),
    "w_observed": lambda v: _num("w_observed", v, lo=0.0),
    "clip_low": lambda v: _num("clip_low", v, lo=0.0, hi=1.0, hi_open=True),
    "clip_high": lambda v: _num("clip_high", v, lo=0.0),
    "dual_clip": lambda v: _num("dual_clip", v, lo=1.0, lo_open=True, optional=True),
    "kl_coef": lambda v: _num("kl_coef", v, lo=0.0),
    "kl_type": lambda v: _choice("kl_type", "k3" if v == "low_var_kl" else v, KL_TYPES),
    "entropy_coef": lambda v: _num("entropy_coef", v),
    "temperature": lambda v: _num("temperature", v, lo=0.0, lo_open=True),
    "importance_sampling": lambda v: _choice("importance_sampling", v, IS_LEVELS),
    "pg_loss": lambda v: _choice("pg_loss", v, PG_LOSSES),
    "kl_ratio": lambda v: _flag("kl_ratio", v),
}


@dataclass
class PolicyLossConfig:
    """Loss settings (formulas in the module docstring and docs/kernels.md).

    Every field is checked when the config is built *and* on every later assignment
    (`cfg.temperature = 0` raises ValueError and leaves the config unchanged).

    importance_sampling: "token" (PPO/GRPO: rho_t = exp(logp_t - old_t)) or "sequence" (GSPO:
        rho_i = exp(mean over sequence i's loss tokens of (logp - old)), shared by the sequence's
        tokens and clipped per sequence; linear_policy_loss then needs `seq_ids`).
    pg_loss: "ppo_clip" (clipped surrogate, + dual_clip) or "cispo" (CISPO: -sg(min(rho,
        1 + clip_high)) * A * logp; the importance weight is clipped and detached, every token
        keeps a gradient; clip_low and dual_clip are not used, dual_clip must be None).
    kl_ratio: multiply the KL term by the (undetached) importance ratio rho (TRL's
        use_bias_correction_kl); off-policy data then estimates KL(pi_theta || ref) without bias.
    """
    w_act: float = 1.0
    w_rehearse: float = 1.0
    w_observed: float = 0.0
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None     # c > 1: caps the loss of negative-advantage tokens at -c A
    kl_coef: float = 0.0
    kl_type: str = "k3"                # k1, k2, k3 (low-variance, Schulman)
    entropy_coef: float = 0.0
    temperature: float = 1.0
    importance_sampling: str = "token"  # "token" | "sequence" (GSPO)
    pg_loss: str = "ppo_clip"           # "ppo_clip" | "cispo"
    kl_ratio: bool = False              # KL term x ratio (TRL's use_bias_correction_kl)

    def __setattr__(self, name, value):
        check = _FIELD_CHECKS.get(name)
        if check is None:
            raise AttributeError(f"PolicyLossConfig has no field {name!r} "
                                 f"(fields: {', '.join(_FIELD_CHECKS)})")
        value = check(value)
        had, old = name in self.__dict__, self.__dict__.get(name)
        object.__setattr__(self, name, value)
        if all(f in self.__dict__ for f in _FIELD_CHECKS):   # built (or being built: last field)
            try:
                self._check_combination()
            except ValueError:
                if had:
                    object.__setattr__(self, name, old)
                raise

    def _check_combination(self):
        if self.pg_loss == "cispo" and self.dual_clip is not None:
            raise ValueError("PolicyLossConfig: dual_clip applies to pg_loss='ppo_clip' only "
                             "(CISPO clips the detached weight); set dual_clip=None")

    def role_weights(self) -> list[float]:
        return [0.0, float(self.w_act), float(self.w_rehearse), float(self.w_observed)]


@dataclass
class PolicyLossOutput:
    loss: torch.Tensor                  # scalar, differentiable w.r.t. hidden and weight
    logp: torch.Tensor                  # [N] float32, detached; 0 where no loss is computed
    entropy: torch.Tensor | None        # [N] float32, detached (when entropy_coef != 0 or asked)
    metrics: dict[str, dict[str, float]] = field(default_factory=dict)  # per role name


# ---- per-token loss ----------------------------------------------------------------------------


def _rl_mask(roles):
    return (roles == int(Role.ACT)) | (roles == int(Role.REHEARSE))


def log_ratio(logp, old, rl, seq, cfg: PolicyLossConfig):
    """Per-token log importance ratio, differentiable in logp (0 at non-RL tokens).

    old None = on-policy: logp - logp.detach() (value 0, gradient 1: no extra pass).
    importance_sampling "sequence": the mean of (logp - old) over the RL tokens of the token's
    sequence (seq: dense sequence index 0..K-1 per token), broadcast back to its tokens.
    """
    base = logp.detach() if old is None else torch.where(rl, old, logp.detach())
    d = torch.where(rl, logp - base, torch.zeros_like(logp))
    if cfg.importance_sampling == "token":
        return d
    k = int(seq.max()) + 1 if seq.numel() else 0
    num = torch.zeros(k, device=d.device, dtype=d.dtype).index_add(0, seq, d)
    cnt = torch.zeros(k, device=d.device, dtype=d.dtype).index_add(0, seq, rl.to(d.dtype))
    return (num / cnt.clamp_min(1.0))[seq]


def token_loss(logp, ent, roles, adv, old, ref, cfg: PolicyLossConfig, seq=None, pg_w=None):
    """Per-token loss l_t (autograd-friendly torch; the unfused path and the spec in code).

    Selections use torch.where so NaN inputs at tokens of another role never leak in.
    """
    rl = _rl_mask(roles)
    adv = torch.where(rl, adv, torch.zeros_like(adv))
    ratio = torch.exp(log_ratio(logp, old, rl, seq, cfg))
    if cfg.pg_loss == "cispo":
        pg = -ratio.detach().clamp(max=1.0 + cfg.clip_high) * adv * logp
    else:
        pg = torch.maximum(-adv * ratio,
                           -adv * ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high))
        if cfg.dual_clip is not None:
            pg = torch.where(adv < 0, torch.minimum(pg, -cfg.dual_clip * adv), pg)
    if pg_w is not None:
        pg = pg * torch.where(rl, pg_w, torch.ones_like(pg_w)).detach()
    l_rl = pg
    if cfg.kl_coef != 0.0:
        ref = torch.where(rl, ref, logp.detach())
        kl = _kl(logp, ref, cfg.kl_type)
        l_rl = l_rl + cfg.kl_coef * (kl * ratio if cfg.kl_ratio else kl)
    if cfg.entropy_coef != 0.0:
        l_rl = l_rl - cfg.entropy_coef * ent
    obs = roles == int(Role.OBSERVED)
    return torch.where(rl, l_rl, torch.where(obs, -logp, torch.zeros_like(logp)))


def _kl(logp, ref, kl_type):
    d = ref - logp
    if kl_type == "k1":
        return -d
    if kl_type == "k2":
        return 0.5 * d * d
    return torch.exp(d) - d - 1.0


def _loss_and_slopes(logp, ent, roles, adv, old, ref, scale, cfg: PolicyLossConfig, pg_w=None):
    """Fused path: the per-token loss l_t (token_loss, the one definition) and its slopes
    scale_t dl_t/dlogp_t, scale_t dl_t/dH_t (None without an entropy term), by autograd over
    token_loss on the chunk's [C] vectors -- no second, hand-derived copy of the loss to keep in
    step. Token-level importance ratios only (a sequence ratio couples a sequence's tokens across
    chunks: that level runs the unfused path)."""
    with torch.enable_grad():
        lp = logp.detach().requires_grad_()
        en = ent.detach().requires_grad_() if ent is not None and cfg.entropy_coef != 0.0 else ent
        l = token_loss(lp, en, roles, adv, old, ref, cfg, None, pg_w)
        wrt = [lp] + ([en] if en is not None and en.requires_grad else [])
        slopes = torch.autograd.grad(l, wrt, grad_outputs=scale)
    return l.detach(), slopes[0], (slopes[1] if len(slopes) > 1 else None)


@torch.no_grad()
def _token_stats(logp, roles, adv, lr, ref, cfg: PolicyLossConfig):
    """Metrics of the loss's terms per token: ratio exp(lr), clipped (the clipped branch is the
    larger; cispo: the weight is capped), dual-clipped, and the KL value (None without KL)."""
    rl = _rl_mask(roles)
    adv = torch.where(rl, adv, torch.zeros_like(adv))
    ratio = torch.exp(lr)
    dual = torch.zeros_like(rl)
    if cfg.pg_loss == "cispo":
        clipped = ratio > 1.0 + cfg.clip_high
    else:
        pg1 = -adv * ratio
        pg2 = -adv * ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
        clipped = pg2 > pg1
        if cfg.dual_clip is not None:
            dual = (adv < 0) & (torch.maximum(pg1, pg2) > -cfg.dual_clip * adv)
    kl = None
    if cfg.kl_coef != 0.0:
        kl = _kl(logp, torch.where(rl, ref, logp), cfg.kl_type)
    return ratio, clipped & rl, dual & rl, kl


# ---- fused autograd function -------------------------------------------------------------------


class _Plan:
    """Everything the fused forward needs besides (x, w), and the per-token results it leaves."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


def _fast_torch(backend, entropy_grad, head) -> bool:
    """The torch backend without an entropy gradient: dZ = diag(g1) (onehot - E / S) with
    E = exp(s - m), so the chunk needs only amax, sub_, exp_, sum; -g1 / S scales the [C, H]
    operands instead. An entropy wanted as a metric only (entropy_coef == 0, e.g. TRL's logged
    entropy) costs one more row reduction: H = log S - sum_j E_j (s_j - m) / S.
    (Not with an LM-head variant: the head transform sits between the GEMM and the rows.)"""
    return backend == "torch" and not entropy_grad and head is None


def _chunk_rows(n, w, head, fast, grad, need_dw, workspace_bytes, chunk_size, with_entropy=False,
                dw_accum_dtype=torch.float32):
    """Rows per chunk of _fused_sweep from the workspace it holds (see _common.fused_loss_rows):
    per row of a chunk its fp32 logits (+ pre-cap logits, + a low-precision dZ when there is a
    gradient); fixed: the fp32 V x H dW accumulator (none when dW accumulates in the returned
    low-precision dW itself), and the torch fast path's fp32 weight copy."""
    v, h = w.shape
    pre = 4 if head is not None and head.needs_pre else 0
    # fast path: the chunk's fp32 logits (+ E beside s - m when the entropy is wanted)
    elem = (8 if with_entropy else 4) if fast else (block_elem_bytes(w, head) if grad else 4 + pre)
    acc32 = need_dw and (dw_accum_dtype == torch.float32 or w.dtype == torch.float32)
    fixed = (v * h * 4 if acc32 else 0) + (v * h * 4 if fast and w.dtype != torch.float32 else 0)
    if fast and need_dw and not acc32:
        fixed += v * h * 4     # the fast path's per-chunk fp32 dZ^T X_c before it is rounded in
    return fused_loss_rows(n, v, w.device, elem_bytes=elem, fixed_bytes=fixed,
                           workspace_bytes=workspace_bytes, chunk_size=chunk_size)


class _FusedPolicyLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b, plan):
        loss, n = _fused_sweep(x, w, plan, plan.need_dx, plan.need_dw, plan.need_db)
        ctx.save_for_backward(plan.dx, plan.dw, plan.db)
        ctx.used = False
        plan.dx = plan.dw = plan.db = None
        return loss

    @staticmethod
    def backward(ctx, grad_out):
        if ctx.used:
            raise RuntimeError("the fused policy loss stores its gradients and can be "
                               "backpropagated once; use fused=False for retain_graph / "
                               "higher-order use")
        ctx.used = True
        grads = ctx.saved_tensors
        # grad_out is the scalar upstream gradient (1.0, or a loss scale); scale in place.
        g = grad_out.to(torch.float32)
        for t in grads:
            if t is not None:
                t.mul_(g.to(t.dtype))
        return (*grads, None)


def _fused_sweep(x, w, plan, need_dx, need_dw, need_db=False):
    n, v = x.shape[0], w.shape[0]
    dev = x.device
    head = plan.head
    plan.logp = torch.empty(n, device=dev, dtype=torch.float32)
    plan.ent = torch.empty(n, device=dev, dtype=torch.float32) if plan.with_entropy else None
    plan.ratio = torch.empty(n, device=dev, dtype=torch.float32)
    plan.clipped = torch.empty(n, device=dev, dtype=torch.bool)
    plan.dual = torch.empty(n, device=dev, dtype=torch.bool)
    plan.kl = torch.empty(n, device=dev, dtype=torch.float32) if plan.cfg.kl_coef else None
    loss_parts = torch.zeros(NUM_ROLES, device=dev, dtype=torch.float32)
    dx = torch.empty_like(x) if need_dx else None
    dw = torch.zeros(w.shape, device=dev, dtype=plan.dw_dtype) if need_dw else None
    db = torch.zeros(v, device=dev, dtype=torch.float32) if need_db else None
    grad = need_dx or need_dw or need_db
    inv_temp = plan.inv_temp
    fast = plan.fast
    w32 = (w if w.dtype == torch.float32 else w.float()) if fast else None
    for s in range(0, n, plan.chunk):
        e = min(n, s + plan.chunk)
        x_c, t_c, r_c = x[s:e], plan.t[s:e], plan.roles[s:e]
        z_pre = None
        if fast:
            xs = x_c.float() if inv_temp == 1.0 else x_c.float() * inv_temp    # x / T
            z = torch.mm(xs, w32.t())
            ti = t_c.view(-1, 1)
            s_t = z.gather(1, ti).squeeze(1)
            m = z.amax(1)
            sm_t = s_t - m
            e_t = torch.exp(sm_t)
            # E with each row's target entry zeroed: its sum is the off-target mass A S, and the
            # target coefficient of dZ below is g1 A, never the cancelling g1 (1 - E_t / S)
            if plan.with_entropy:                                 # metric only: no gradient
                zm = z.sub_(m.view(-1, 1))                            # s - m
                z = zm.exp().scatter_(1, ti, 0.0)                     # z := E (off-target)
                a = torch.bmm(z.unsqueeze(1), zm.unsqueeze(2)).view(-1) + e_t * sm_t
                del zm                                                # a = sum_j E_j (s_j - m)
                sum_off = z.sum(1)
                sum_e = sum_off + e_t
                h = torch.log(sum_e) - a / sum_e
            else:
                sum_off = z.sub_(m.view(-1, 1)).exp_().scatter_(1, ti, 0.0).sum(1)   # z := E
                sum_e = sum_off + e_t
                h = None
            lp = sm_t - torch.log(sum_e)
        elif plan.fused_fwd:
            from ._fused_lse import fused_row_stats    # lazy: triton only when it is used
            lp, h, _, _, _ = fused_row_stats(x_c, w, t_c, inv_temp, plan.with_entropy)
            z = None
        else:
            z, z_pre = head_logits(x_c, w, head, plan.backend)
            lp, h, lse, off, off_ent = row_stats(z, t_c, inv_temp, plan.with_entropy, plan.backend)
        old_c = None if plan.old is None else plan.old[s:e]
        ref_c = None if plan.ref is None else plan.ref[s:e]
        if old_c is None:                                    # on-policy: ratio exactly 1
            lr = torch.zeros_like(lp)
        else:
            lr = torch.where(_rl_mask(r_c), lp - old_c, torch.zeros_like(lp))
        l, g1, g2 = _loss_and_slopes(lp, h, r_c, plan.adv[s:e], old_c, ref_c, plan.scale[s:e], plan.cfg,
                                     None if plan.pg_w is None else plan.pg_w[s:e])
        ratio, clipped, dual, kl = _token_stats(lp, r_c, plan.adv[s:e], lr, ref_c, plan.cfg)
        loss_parts.index_add_(0, r_c, l * plan.scale[s:e])
        plan.logp[s:e] = lp
        if plan.ent is not None:
            plan.ent[s:e] = h
        plan.ratio[s:e], plan.clipped[s:e], plan.dual[s:e] = ratio, clipped, dual
        if kl is not None:
            plan.kl[s:e] = kl
        if grad and fast:
            r = (-g1 / sum_e).view(-1, 1)
            g1c = (g1 * (sum_off / sum_e)).view(-1, 1)          # the target entry g1 A
            if dx is not None:
                dx_c = torch.mm(z, w32).mul_(r).add_(w32.index_select(0, t_c) * g1c)
                dx[s:e] = dx_c.mul_(inv_temp) if inv_temp != 1.0 else dx_c
            if dw is not None and dw.dtype == torch.float32:
                dw.addmm_(z.t(), xs * r)
                dw.index_add_(0, t_c, xs * g1c)
            elif dw is not None:    # low-precision dW: the chunk's sum in fp32, rounded in once
                dw.add_(torch.mm(z.t(), xs * r).index_add_(0, t_c, xs * g1c))
        elif grad:
            dt = target_grad(lp, h, off, off_ent, g1, g2)
            chunk_grad(x_c, w, z, t_c, lse, h, g1, g2, dt, inv_temp, plan.backend,
                       None if dx is None else dx[s:e], dw, head, z_pre, db)
        del z, z_pre
    plan.dx = dx
    plan.dw = None if dw is None else dw.to(w.dtype)
    plan.db = None if db is None else db.to(head.bias_dtype)
    plan.loss_parts = loss_parts
    return loss_parts.sum(), n


# ---- input handling ----------------------------------------------------------------------------


def _check_vec(name, t, n, device, *, required=True):
    if t is None:
        if required:
            raise ValueError(f"{name} is required")
        return None
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 1 or t.shape[0] != n:
        raise ValueError(f"{name} must have shape [N]=[{n}], got {tuple(t.shape)}")
    if not t.is_floating_point():
        raise ValueError(f"{name} must be a float tensor, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but hidden is on {device}")
    return t


def _role_counts(roles):
    """Per-role token counts (one host sync); raises on role ids outside Role."""
    r = roles.long()
    bad = (r < 0) | (r >= NUM_ROLES)
    counts = torch.bincount(torch.where(bad, NUM_ROLES, r), minlength=NUM_ROLES + 1).tolist()
    if counts[NUM_ROLES]:
        k = int(bad.nonzero()[0, 0])
        raise ValueError(f"roles[{k}] = {int(r[k])} is not a Role id "
                         f"(expected 0..{NUM_ROLES - 1}: {[x.name for x in Role]})")
    return counts[:NUM_ROLES]


def _normalizer_value(where: str, value) -> float:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, Real):
        raise ValueError(f"{where} must be a number, got {value!r}")
    v = float(value)
    if not (math.isfinite(v) and v >= 0.0):
        raise ValueError(f"{where} = {value!r}: must be a finite number >= 0")
    return v


def _normalizers(normalizers, counts, weights):
    """Per-role n_r from a Mapping {Role or role id: n_r} (read by key; a missing role is 0) or
    a length-NUM_ROLES sequence / 1-D tensor indexed by role id. Refused: other keys or
    containers, wrong length, non-finite or negative values, 0 for a weighted role with tokens."""
    if normalizers is None:
        return [float(c) for c in counts]
    if isinstance(normalizers, Mapping):
        norms = [0.0] * NUM_ROLES
        for key, val in normalizers.items():
            if isinstance(key, bool) or not isinstance(key, Integral) \
                    or not 0 <= int(key) < NUM_ROLES:
                raise ValueError(f"normalizers keys must be Role members or role ids 0..{NUM_ROLES - 1}"
                                 f" ({', '.join(r.name for r in Role)}), got {key!r}")
            norms[int(key)] = _normalizer_value(f"normalizers[{Role(int(key)).name}]", val)
    else:
        if isinstance(normalizers, torch.Tensor):
            if normalizers.dim() != 1 or normalizers.is_complex() or normalizers.dtype == torch.bool:
                raise ValueError(f"normalizers tensor must be a 1-D real tensor of length "
                                 f"{NUM_ROLES}, got {normalizers.dtype} of shape "
                                 f"{tuple(normalizers.shape)}")
            normalizers = normalizers.detach().double().cpu().tolist()
        elif isinstance(normalizers, (str, bytes)) or not isinstance(normalizers, Sequence):
            raise ValueError(f"normalizers must be a Mapping {{Role: count}}, a length-{NUM_ROLES} "
                             f"sequence indexed by role id, a 1-D tensor, or None; got "
                             f"{type(normalizers).__name__}")
        if len(normalizers) != NUM_ROLES:
            raise ValueError(f"normalizers must have one entry per Role ({NUM_ROLES}: "
                             f"{', '.join(r.name for r in Role)}), got {len(normalizers)}")
        norms = [_normalizer_value(f"normalizers[{r}] ({Role(r).name})", val)
                 for r, val in enumerate(normalizers)]
    for r in range(1, NUM_ROLES):
        if weights[r] != 0.0 and counts[r] > 0 and not norms[r] > 0.0:
            raise ValueError(f"normalizers[{r}] ({Role(r).name}) = {norms[r]} but this "
                             f"call has {counts[r]} {Role(r).name} tokens: must be > 0")
    return norms


def _dense_seq_ids(seq_ids, rows, n, dev):
    """Compacted rows' sequence ids renumbered 0..K-1 (any integer ids may be given)."""
    if not isinstance(seq_ids, torch.Tensor) or seq_ids.dim() != 1 or seq_ids.shape[0] != n:
        raise ValueError(f"seq_ids must be a tensor of shape [N]=[{n}]")
    if seq_ids.is_floating_point() or seq_ids.is_complex() or seq_ids.dtype == torch.bool \
            or seq_ids.device != dev:
        raise ValueError(f"seq_ids must be an integer tensor on {dev}, got {seq_ids.dtype} on "
                         f"{seq_ids.device}")
    return torch.unique(seq_ids.index_select(0, rows), return_inverse=True)[1]


def _check_finite(rows_roles, named, rows):
    """One fused isfinite reduction over the loss-bearing values; names the culprit on error."""
    vals = [(name, v, rl_only) for name, v, rl_only in named if v is not None]
    if not vals:
        return
    rl = (rows_roles == int(Role.ACT)) | (rows_roles == int(Role.REHEARSE))
    oks = [torch.isfinite(v) | (~rl if rl_only else False) for _, v, rl_only in vals]
    ok = torch.stack(oks)
    if bool(ok.all()):
        return
    for (name, v, _), o in zip(vals, oks):
        if not bool(o.all()):
            k = int((~o).nonzero()[0, 0])
            raise ValueError(f"{name}[{int(rows[k])}] = {float(v[k])} is not finite at a "
                             f"loss-bearing token (check_finite=True)")


def linear_policy_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                       roles: torch.Tensor, advantages: torch.Tensor,
                       old_logp: torch.Tensor | None,
                       config: PolicyLossConfig | None = None, *,
                       ref_logp: torch.Tensor | None = None,
                       normalizers: Mapping | Sequence[float] | torch.Tensor | None = None,
                       token_weights: torch.Tensor | None = None,
                       pg_weights: torch.Tensor | None = None, backend: str = "auto",
                       fused: bool = True, with_entropy: bool = False,
                       check_finite: bool = True,
                       chunk_size: int | None = None, bias: torch.Tensor | None = None,
                       logit_softcap: float | None = None, logit_scale: float | None = None,
                       seq_ids: torch.Tensor | None = None,
                       workspace_bytes: int | None = None,
                       dw_accum_dtype: torch.dtype = torch.float32) -> PolicyLossOutput:
    """Role-wise GRPO loss of the tokens `targets` under softmax(head(hidden @ weight.T) / T).

    Args:
        hidden [N, H], weight [V, H], targets [N]: as in `linear_logprobs`.
        roles: [N] integer Role ids (role of each *target* token).
        advantages: [N] float; read at ACT/REHEARSE tokens only (NaN elsewhere is fine).
        old_logp: [N] float behaviour log-probs (read at ACT/REHEARSE tokens only), or None for
            on-policy: ratio = exp(logp - logp.detach()) = 1 with the policy gradient, no extra pass.
        config: PolicyLossConfig (default: PolicyLossConfig()).
        ref_logp: [N] float, required when config.kl_coef != 0.
        normalizers: per-role token counts n_r, e.g. global counts all-reduced over ranks and
            summed over micro-batches: a Mapping {Role.ACT: n, ...} (keys Role or role id; a
            missing role is 0) or a length-NUM_ROLES sequence / 1-D tensor indexed by role id.
            Default: this call's counts.
        token_weights: [N] float per-token c_t replacing 1/n_r (see module docstring).
        pg_weights: [N] float per-token factor g_t on the policy-gradient term only (not on the
            KL term, the entropy bonus or OBSERVED's CE), read at ACT/REHEARSE tokens; no
            gradient flows into it. Truncated importance sampling against the rollout engine
            (`fastrehearse.algo.tis`) is its use: with token_weights it would scale KL and
            entropy too.
        backend: as in `linear_logprobs`. "triton-fused" fuses the logits GEMM with the
            log-sum-exp where only the forward runs (no gradient wanted: old / reference
            log-probs, evaluation); a sweep with a gradient needs each chunk's logits for dZ and
            runs as "triton".
        fused: one-pass fused kernel (True) or linear_logprobs + torch loss (False, reference).
            importance_sampling="sequence" always runs the latter (a sequence's ratio needs all
            its tokens' log-probs before any gradient).
        with_entropy: compute the entropy even when entropy_coef == 0 (for metrics).
        check_finite: raise ValueError on NaN/inf advantages/old_logp/ref_logp/token_weights/pg_weights at
            loss-bearing tokens (one reduction + sync; disable in hot loops if inputs are trusted).
        bias, logit_softcap, logit_scale: LM-head variants, as in `linear_logprobs`.
        seq_ids: [N] integer sequence id of each token; required by
            importance_sampling="sequence" (each sequence must lie wholly in this call).
        chunk_size: rows per chunk of the fused sweep (default: from `workspace_bytes`).
        workspace_bytes: memory the fused path may use besides the dX / dW it returns: the fp32
            V x H dW accumulator plus the chunk's logits buffers; rows per chunk follow (see
            `_common.fused_loss_rows`; default on CUDA 3 GiB, on the CPU 32 MiB logits chunks).
            Refused when it cannot hold the accumulator plus one row. The unfused path passes it
            to `linear_logprobs` (its vocabulary-outer backward's budget).
        dw_accum_dtype: the fused path's dW accumulator across chunks: torch.float32 (default;
            dW rounded once at the end) or weight.dtype (accumulate in the returned bf16/fp16 dW:
            the accumulator leaves the workspace, so a budget holds larger chunks, and its
            read-modify-write traffic halves; dW is rounded once per chunk, the choice of Liger's
            FLCE). Anything else is refused. No effect on dX, on d bias (fp32), or on the
            unfused path (its vocabulary-outer backward writes each dW block once).
    """
    cfg = PolicyLossConfig() if config is None else config
    if not isinstance(cfg, PolicyLossConfig):
        raise ValueError(f"config must be a PolicyLossConfig, got {type(cfg).__name__}")
    check_linear_inputs(hidden, weight, targets)
    n, v, dev = hidden.shape[0], weight.shape[0], hidden.device
    if not isinstance(roles, torch.Tensor) or roles.dim() != 1 or roles.shape[0] != n:
        raise ValueError(f"roles must be a tensor of shape [N]=[{n}]")
    if roles.is_floating_point() or roles.dtype == torch.bool or roles.device != dev:
        raise ValueError(f"roles must be an integer tensor on {dev}, got {roles.dtype} "
                         f"on {roles.device}")
    _check_vec("advantages", advantages, n, dev)
    _check_vec("old_logp", old_logp, n, dev, required=False)
    _check_vec("ref_logp", ref_logp, n, dev, required=cfg.kl_coef != 0.0)
    _check_vec("token_weights", token_weights, n, dev, required=False)
    _check_vec("pg_weights", pg_weights, n, dev, required=False)
    seq_level = cfg.importance_sampling == "sequence"
    if seq_level and seq_ids is None:
        raise ValueError("importance_sampling='sequence' (GSPO) needs seq_ids: an [N] integer "
                         "tensor giving each token's sequence")
    backend = resolve_backend(backend, dev)
    workspace_bytes = check_workspace_bytes(workspace_bytes)
    if dw_accum_dtype not in (torch.float32, weight.dtype):
        raise ValueError(f"dw_accum_dtype must be torch.float32 or the weight's dtype "
                         f"({weight.dtype}), got {dw_accum_dtype!r}")
    head, inv_temp = build_head(bias, logit_softcap, logit_scale, weight,
                                1.0 / float(cfg.temperature))
    check_fused_forward(backend, head)
    head_kw = dict(bias=bias, logit_softcap=logit_softcap, logit_scale=logit_scale)

    weights = cfg.role_weights()
    counts = _role_counts(roles)
    norms = _normalizers(normalizers, counts, weights)
    w_vec = torch.tensor(weights, device=dev, dtype=torch.float32)
    roles_l = roles.long()
    rows = (w_vec[roles_l] != 0).nonzero().view(-1)
    r_c = roles_l.index_select(0, rows)
    t_c = targets.index_select(0, rows)
    check_targets(t_c, rows, v)
    seq_c = _dense_seq_ids(seq_ids, rows, n, dev) if seq_level else None
    pick = lambda t: None if t is None else t.index_select(0, rows).float()  # noqa: E731
    adv_c, old_c, ref_c, tw_c, pgw_c = (pick(advantages), pick(old_logp),
                                        pick(ref_logp if cfg.kl_coef != 0.0 else None),
                                        pick(token_weights), pick(pg_weights))
    if check_finite:
        _check_finite(r_c, [("advantages", adv_c, True), ("old_logp", old_c, True),
                            ("ref_logp", ref_c, True), ("token_weights", tw_c, False),
                            ("pg_weights", pgw_c, True)], rows)
    if tw_c is None:
        inv_n = torch.tensor([1.0 / c if c > 0 else 0.0 for c in norms], device=dev,
                             dtype=torch.float64).float()
        scale = w_vec[r_c] * inv_n[r_c]
    else:
        scale = w_vec[r_c] * tw_c
    with_ent = bool(with_entropy) or cfg.entropy_coef != 0.0
    x_c = hidden.index_select(0, rows)

    if fused and not seq_level:
        grad_on = torch.is_grad_enabled()
        plan = _Plan(t=t_c.long().contiguous(), roles=r_c, adv=adv_c, old=old_c, ref=ref_c,
                     pg_w=pgw_c, scale=scale, cfg=cfg, inv_temp=inv_temp, with_entropy=with_ent,
                     backend="triton" if backend == "triton-fused" else backend, head=head,
                     fast=_fast_torch(backend, cfg.entropy_coef != 0.0, head),
                     need_dx=grad_on and hidden.requires_grad,
                     need_dw=grad_on and weight.requires_grad,
                     need_db=(grad_on and head is not None and bias is not None
                              and bias.requires_grad), dw_dtype=dw_accum_dtype)
        grad = plan.need_dx or plan.need_dw or plan.need_db
        # 'triton-fused' fuses the forward-only sweep; a gradient needs each chunk's logits for
        # dZ anyway (6NHV in one sweep), so that sweep is the "triton" one
        plan.fused_fwd = backend == "triton-fused" and not grad
        if plan.fused_fwd:
            plan.chunk = fused_rows(rows.numel(), v, weight.dtype, dev, chunk_size,
                                    budget_bytes=workspace_bytes)
        else:
            plan.chunk = _chunk_rows(rows.numel(), weight, head, plan.fast, grad, plan.need_dw,
                                     workspace_bytes, chunk_size, with_ent, dw_accum_dtype)
        b = bias if head is not None else None
        if plan.need_dx or plan.need_dw or plan.need_db:
            loss = _FusedPolicyLoss.apply(x_c.contiguous(), weight.contiguous(), b, plan)
        else:
            loss, _ = _fused_sweep(x_c.contiguous(), weight.contiguous(), plan, False, False)
        lp_c, ent_c, kl_c = plan.logp, plan.ent, plan.kl
        ratio, clipped, dual = plan.ratio, plan.clipped, plan.dual
        parts = plan.loss_parts
    else:
        lp_c, ent_c = linear_logprobs(x_c, weight, t_c, temperature=cfg.temperature,
                                      with_entropy=with_ent, backend=backend,
                                      chunk_size=chunk_size, workspace_bytes=workspace_bytes,
                                      **head_kw)
        l = token_loss(lp_c, ent_c, r_c, adv_c, old_c, ref_c, cfg, seq_c, pgw_c)
        contrib = l * scale
        loss = contrib.sum()
        with torch.no_grad():
            lp_d = lp_c.detach()
            lr = log_ratio(lp_d, old_c, _rl_mask(r_c), seq_c, cfg)
            ratio, clipped, dual, kl_c = _token_stats(lp_d, r_c, adv_c, lr, ref_c, cfg)
            parts = torch.zeros(NUM_ROLES, device=dev).index_add_(0, r_c, contrib.detach())
        lp_c = lp_c.detach()
        ent_c = None if ent_c is None else ent_c.detach()

    logp = torch.zeros(n, device=dev, dtype=torch.float32).index_put_((rows,), lp_c)
    ent = None
    if ent_c is not None:
        ent = torch.zeros(n, device=dev, dtype=torch.float32).index_put_((rows,), ent_c)
    metrics = _metrics(counts, r_c, lp_c, ent_c, ratio, clipped, dual, kl_c, parts)
    return PolicyLossOutput(loss=loss, logp=logp, entropy=ent, metrics=metrics)


def _metrics(counts, r_c, lp_c, ent_c, ratio, clipped, dual, kl_c, parts):
    """Per-role means over the computed tokens, gathered with one host sync. `tokens` counts
    every token of the role; the means are absent for a role with nothing computed."""
    dev = lp_c.device
    stats = {"ratio": ratio, "clip_frac": clipped.float(), "dual_clip_frac": dual.float(),
             "nll": -lp_c}
    if kl_c is not None:
        stats["kl"] = kl_c
    if ent_c is not None:
        stats["entropy"] = ent_c
    k = torch.zeros(NUM_ROLES, device=dev).index_add_(0, r_c, torch.ones_like(lp_c))
    sums = torch.stack([torch.zeros(NUM_ROLES, device=dev).index_add_(0, r_c, v.float())
                        for v in stats.values()])
    flat = torch.cat([(sums / k.clamp_min(1)).flatten(), parts.float(), k]).tolist()  # one sync
    ns = len(stats) * NUM_ROLES
    means = [flat[i * NUM_ROLES:(i + 1) * NUM_ROLES] for i in range(len(stats))]
    parts, computed = flat[ns:ns + NUM_ROLES], flat[ns + NUM_ROLES:]
    out = {}
    for role in Role:
        if role == Role.CONTEXT:
            continue
        m = {"tokens": float(counts[role]), "loss": parts[role]}
        out[role.name.lower()] = m
        if not computed[role]:  # no tokens, or a weight-0 role (compacted out): no means
            continue
        for i, name in enumerate(stats):
            if role == Role.OBSERVED and name in ("ratio", "clip_frac", "dual_clip_frac", "kl"):
                continue
            m[name] = means[i][role]
    return out
