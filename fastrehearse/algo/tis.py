"""Truncated importance sampling (TIS) for the rollout / trainer mismatch.

A serving backend (vLLM) samples with its own kernels, so the probability it gave a sampled token,
pi_rollout(t), differs slightly from the trainer's own old policy pi_old(t) (recomputed by the
trainer on the same weights: train/update.py). The policy gradient is an expectation under
pi_old, the tokens were drawn from pi_rollout; as verl and TRL do, each sampled token's
policy-gradient term is reweighted by the truncated ratio

    w_t = min(pi_old(t) / pi_rollout(t), C) = min(exp(old_logp_t - rollout_logp_t), C)

(a constant: no gradient flows through it; C = the cap, `algo.tis_cap`). Tokens the backend did not
sample (forced turns, CONTEXT / OBSERVED tokens: rollout log-prob NaN) keep w_t = 1.

Sequence level (`algo.tis_sequence`, beside or instead of the token cap), per episode s:

    r_s = exp(sum over s's sampled tokens of (old_logp_t - rollout_logp_t))
    truncate: w_t *= min(r_s, C_seq)        mask: w_t *= 1 if 1/C_seq <= r_s <= C_seq else 0

for every token t of s (verl's sequence-level rollout correction, truncate / mask modes): an
episode the engine sampled far from the trainer's policy is down-weighted or dropped as a whole.

In the fused loss (kernels/policy_loss.py) the weight is `pg_weights`: a per-token factor on the
policy-gradient term l_pg alone, so a KL penalty, an entropy bonus and OBSERVED's CE keep their own
weights (as verl and TRL apply the correction). Every loss option combines with it.
"""
from __future__ import annotations

import math

import torch


def tis_weights(old_logp: torch.Tensor, rollout_logp: torch.Tensor, cap: float
                ) -> tuple[torch.Tensor, dict[str, float]]:
    """[T] weights min(exp(old - rollout), cap) where both log-probs are finite (1 elsewhere), and
    the ratio's statistics over those tokens: tis_ratio_mean, tis_ratio_max, tis_capped_frac,
    tis_tokens, and tis_logp_diff_max = max |old - rollout| (how far the backend's weights or
    kernels are from the trainer's: ~1e-5 in fp32 right after a weight sync, > 1e-2 for an
    engine left one optimizer step behind)."""
    if cap is not None and not (isinstance(cap, (int, float)) and cap > 0 and math.isfinite(cap)):
        raise ValueError(f"TIS cap must be a finite number > 0, got {cap!r}")
    if old_logp.shape != rollout_logp.shape:
        raise ValueError(f"old_logp {tuple(old_logp.shape)} and rollout_logp {tuple(rollout_logp.shape)} differ")
    sampled = torch.isfinite(old_logp) & torch.isfinite(rollout_logp)
    log_ratio = torch.where(sampled, old_logp.double() - rollout_logp.double(), torch.zeros((), dtype=torch.float64))
    ratio = log_ratio.exp()
    w = torch.where(sampled & (cap is not None), ratio.clamp(max=cap if cap is not None else math.inf),
                    torch.ones((), dtype=torch.float64)).to(old_logp.dtype)
    n = int(sampled.sum())
    r = ratio[sampled]
    stats = {"tis_tokens": n,
             "tis_ratio_mean": float(r.mean()) if n else 1.0,
             "tis_ratio_max": float(r.max()) if n else 1.0,
             "tis_capped_frac": float((r > cap).double().mean()) if n and cap is not None else 0.0,
             "tis_logp_diff_max": float(log_ratio[sampled].abs().max()) if n else 0.0}
    return w, stats


def sequence_weights(old_logp: torch.Tensor, rollout_logp: torch.Tensor, seq_ids: torch.Tensor, mode: str,
                     cap: float) -> tuple[torch.Tensor, dict[str, float]]:
    """[T] per-token factors from each sequence's (episode's) importance ratio (module docstring);
    statistics tis_seq_n, tis_seq_log_ratio_mean (over sequences), tis_seq_affected (sequences
    truncated or masked)."""
    if mode not in ("truncate", "mask"):
        raise ValueError(f"sequence-level IS mode must be 'truncate' or 'mask', got {mode!r}")
    if not (isinstance(cap, (int, float)) and cap > 0 and math.isfinite(cap)) or (mode == "mask" and cap <= 1):
        raise ValueError(f"sequence-level IS cap must be a finite number > 0 (> 1 to mask), got {cap!r}")
    sampled = torch.isfinite(old_logp) & torch.isfinite(rollout_logp)
    lr_tok = torch.where(sampled, old_logp.double() - rollout_logp.double(), torch.zeros((), dtype=torch.float64))
    ids, inv = torch.unique(seq_ids, return_inverse=True)
    lr_seq = torch.zeros(len(ids), dtype=torch.float64, device=old_logp.device).index_add_(0, inv, lr_tok)
    has = torch.zeros(len(ids), dtype=torch.bool, device=old_logp.device).index_fill_(0, inv[sampled], True)
    log_cap = math.log(cap)
    if mode == "truncate":
        w_seq = lr_seq.clamp(max=log_cap).exp()
        affected = has & (lr_seq > log_cap)
    else:
        keep = lr_seq.abs() <= log_cap
        w_seq = keep.double()
        affected = has & ~keep
    w_seq = torch.where(has, w_seq, torch.ones((), dtype=torch.float64))
    stats = {"tis_seq_n": int(has.sum()),
             "tis_seq_log_ratio_mean": float(lr_seq[has].mean()) if has.any() else 0.0,
             "tis_seq_affected": int(affected.sum())}
    return w_seq[inv].to(old_logp.dtype), stats


def apply_tis(batches, rollout_logp: list[torch.Tensor], cap: float | None, sequence: str | None = None,
              sequence_cap: float = 2.0) -> tuple[list[torch.Tensor], dict[str, float]]:
    """The trainer's step (train/update.py): `batches` carry the trainer's old_logp,
    `rollout_logp[i]` = batch i's old_logp as packed (the backend's sampled log-probs).
    Returns each batch's `pg_weights` for the fused loss -- the token cap's weights (`cap`; None:
    1) times the sequence-level factors (`sequence`: truncate | mask | None) -- and this rank's
    ratio statistics (token-weighted over batches)."""
    out, n, total, maxes, capped, diff = [], 0, 0.0, [], 0.0, 0.0
    seq = {"tis_seq_n": 0, "tis_seq_log_ratio_sum": 0.0, "tis_seq_affected": 0}
    for i, b in enumerate(batches):
        rlp = rollout_logp[i].to(b.old_logp.device)
        w, st = tis_weights(b.old_logp, rlp, cap)
        if sequence is not None:
            ws, sst = sequence_weights(b.old_logp, rlp, b.seq_ids.to(b.old_logp.device), sequence, sequence_cap)
            w = w * ws
            seq["tis_seq_n"] += sst["tis_seq_n"]
            seq["tis_seq_log_ratio_sum"] += sst["tis_seq_log_ratio_mean"] * sst["tis_seq_n"]
            seq["tis_seq_affected"] += sst["tis_seq_affected"]
        out.append(w.to(b.roles.device))
        k = st["tis_tokens"]
        n += k
        total += st["tis_ratio_mean"] * k
        capped += st["tis_capped_frac"] * k
        if k:
            maxes.append(st["tis_ratio_max"])
            diff = max(diff, st["tis_logp_diff_max"])
    stats = {"tis_ratio_mean": total / n if n else 1.0, "tis_ratio_max": max(maxes, default=1.0),
             "tis_capped_frac": capped / n if n else 0.0, "tis_tokens": n, "tis_logp_diff_max": diff}
    if sequence is not None:
        stats.update(seq)
    return out, stats
