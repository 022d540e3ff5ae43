"""Truncated importance sampling (TIS) for the rollout / trainer mismatch.

A serving backend (vLLM) samples with its own kernels, so the probability it gave a sampled token,
pi_rollout(t), differs slightly from the trainer's own old policy pi_old(t) (recomputed by the
trainer on the same weights: train/update.py). The policy gradient is an expectation under
pi_old, the tokens were drawn from pi_rollout; as verl and TRL do, each sampled token's
policy-gradient term is reweighted by the truncated ratio

    w_t = min(pi_old(t) / pi_rollout(t), C) = min(exp(old_logp_t - rollout_logp_t), C)

(a constant: no gradient flows through it; C = the cap, `algo.tis_cap`). Tokens the backend did not
sample (forced turns, CONTEXT / OBSERVED tokens: rollout log-prob NaN) keep w_t = 1.

In the fused loss (kernels/policy_loss.py: loss = sum_r w_r sum_{t in r} c_t l_t) the weight folds
into the per-token factor c_t (`token_weights`): c_t' = w_t * c_t, where c_t is 1 / N_r (token-mean)
or the aggregation's weight. c_t scales the whole per-token loss l_t, so the fold is exact only
when l_t is the policy-gradient term alone: kl_coef = 0 and entropy_coef = 0 (`check_foldable`);
with a KL or entropy term it would reweight those too, so it is refused rather than approximated.
"""
from __future__ import annotations

import math

import torch

from fastrehearse.kernels.roles import NUM_ROLES


def tis_weights(old_logp: torch.Tensor, rollout_logp: torch.Tensor, cap: float
                ) -> tuple[torch.Tensor, dict[str, float]]:
    """[T] weights min(exp(old - rollout), cap) where both log-probs are finite (1 elsewhere), and
    the ratio's statistics over those tokens: tis_ratio_mean, tis_ratio_max, tis_capped_frac,
    tis_tokens."""
    if not (isinstance(cap, (int, float)) and cap > 0 and math.isfinite(cap)):
        raise ValueError(f"TIS cap must be a finite number > 0, got {cap!r}")
    if old_logp.shape != rollout_logp.shape:
        raise ValueError(f"old_logp {tuple(old_logp.shape)} and rollout_logp {tuple(rollout_logp.shape)} differ")
    sampled = torch.isfinite(old_logp) & torch.isfinite(rollout_logp)
    log_ratio = torch.where(sampled, old_logp.double() - rollout_logp.double(), torch.zeros((), dtype=torch.float64))
    ratio = log_ratio.exp()
    w = torch.where(sampled, ratio.clamp(max=cap), torch.ones((), dtype=torch.float64)).to(old_logp.dtype)
    n = int(sampled.sum())
    r = ratio[sampled]
    stats = {"tis_tokens": n,
             "tis_ratio_mean": float(r.mean()) if n else 1.0,
             "tis_ratio_max": float(r.max()) if n else 1.0,
             "tis_capped_frac": float((r > cap).double().mean()) if n else 0.0}
    return w, stats


def fold_into_token_weights(roles: torch.Tensor, w: torch.Tensor, token_counts: torch.Tensor,
                            base: torch.Tensor | None = None) -> torch.Tensor:
    """c_t' = w_t * c_t for the fused loss's `token_weights`: c_t = base[t] when the aggregation
    gives weights, else 1 / N_r(t) from the global per-role token counts (what `normalizers` does)."""
    if base is None:
        counts = token_counts.detach().to(torch.float64).reshape(-1)[:NUM_ROLES].to(roles.device)
        inv = torch.where(counts > 0, 1.0 / counts.clamp_min(1.0), torch.zeros_like(counts))
        base = inv[roles.long()]
    return (base.to(torch.float64) * w.to(base.device, torch.float64)).to(torch.float32)


def check_foldable(loss_config) -> None:
    """TIS rides on token_weights, which scale the whole per-token loss: refuse KL / entropy terms."""
    bad = [k for k in ("kl_coef", "entropy_coef") if getattr(loss_config, k, 0.0)]
    if bad:
        raise ValueError(f"truncated IS (algo.tis_cap) is folded into the loss's token weights, which would "
                         f"also scale the {' and '.join(bad)} term(s): set algo.tis_cap to null or "
                         f"{' and '.join('algo.loss.' + k for k in bad)} to 0")


def apply_tis(batches, rollout_logp: list[torch.Tensor], global_counts: torch.Tensor,
              weights: list[torch.Tensor] | None, cap: float) -> tuple[list[torch.Tensor], dict[str, float]]:
    """The trainer's step (train/update.py): `rollout_logp[i]` = batch i's old_logp as packed (the
    backend's sampled log-probs, kept before the trainer overwrites old_logp with its own),
    `weights` = the aggregation's token weights or None (token-mean). Returns the token weights
    with TIS folded in and this rank's ratio statistics (token-weighted over batches)."""
    out, n, total, maxes, capped = [], 0, 0.0, [], 0.0
    for i, b in enumerate(batches):
        w, st = tis_weights(b.old_logp, rollout_logp[i].to(b.old_logp.device), cap)
        out.append(fold_into_token_weights(b.roles, w, global_counts[0],
                                           None if weights is None else weights[i]).to(b.roles.device))
        k = st["tis_tokens"]
        n += k
        total += st["tis_ratio_mean"] * k
        capped += st["tis_capped_frac"] * k
        if k:
            maxes.append(st["tis_ratio_max"])
    return out, {"tis_ratio_mean": total / n if n else 1.0, "tis_ratio_max": max(maxes, default=1.0),
                 "tis_capped_frac": capped / n if n else 0.0, "tis_tokens": n}
