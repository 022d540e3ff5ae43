"""The role-wise GRPO / PPO-clip loss of one token, written once (torch only, no kernels).

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

`token_loss` is that l_t as autograd torch over [N] vectors: the unfused path applies it to
`linear_logprobs`' output, and the fused sweep (_fused_linear_loss.py) differentiates it on each
chunk's vectors for the slopes its GEMMs need. `PolicyLossConfig` holds the settings.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Real

import torch

from .roles import Role

KL_TYPES = ("k1", "k2", "k3")
IS_LEVELS = ("token", "sequence")
PG_LOSSES = ("ppo_clip", "cispo")


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


def rl_mask(roles):
    """ACT and REHEARSE tokens: the ones with an RL term."""
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
    rl = rl_mask(roles)
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


@torch.no_grad()
def token_stats(logp, roles, adv, lr, ref, cfg: PolicyLossConfig):
    """Metrics of the loss's terms per token: ratio exp(lr), clipped (the clipped branch is the
    larger; cispo: the weight is capped), dual-clipped, and the KL value (None without KL)."""
    rl = rl_mask(roles)
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
