"""`linear_policy_loss`'s inputs and outputs: argument checks, the compaction of the loss-bearing
rows with their per-token scales w_r c_t, and the per-role metrics."""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Sequence

import torch

from ._common import check_targets
from ._token_loss import PolicyLossConfig, rl_mask
from .roles import NUM_ROLES, Role


@dataclass
class LossRows:
    """The loss-bearing rows of one call (roles with a nonzero weight), compacted; per-token
    vectors are float32 [M] or None when not given."""
    rows: torch.Tensor                  # [M] their positions in the call
    roles: torch.Tensor                 # [M] int64 role ids
    targets: torch.Tensor               # [M] target token ids
    adv: torch.Tensor
    old: torch.Tensor | None
    ref: torch.Tensor | None            # only when the config has a KL term
    pg_w: torch.Tensor | None
    scale: torch.Tensor                 # w_r / n_r, or w_r * token_weights
    seq: torch.Tensor | None            # dense sequence ids (importance_sampling="sequence")
    counts: list[int]                   # every role's token count in the call


def check_inputs(roles, advantages, old_logp, ref_logp, token_weights, pg_weights, seq_ids,
                 cfg: PolicyLossConfig, n: int, dev) -> None:
    """The per-token arguments' shapes, dtypes and devices (the values are checked in
    `compact_rows`, after the backend and head checks)."""
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
    if cfg.importance_sampling == "sequence" and seq_ids is None:
        raise ValueError("importance_sampling='sequence' (GSPO) needs seq_ids: an [N] integer "
                         "tensor giving each token's sequence")


def compact_rows(targets, roles, advantages, old_logp, ref_logp, token_weights, pg_weights,
                 seq_ids, cfg: PolicyLossConfig, normalizers, check_finite: bool,
                 vocab: int) -> LossRows:
    """The rows of roles with a nonzero weight (CONTEXT never has one), their targets checked
    against the vocabulary, their per-token vectors (finite where they are read, with
    check_finite) and scales."""
    n, dev = roles.shape[0], roles.device
    weights = cfg.role_weights()
    counts = _role_counts(roles)
    norms = _normalizers(normalizers, counts, weights)
    w_vec = torch.tensor(weights, device=dev, dtype=torch.float32)
    roles_l = roles.long()
    rows = (w_vec[roles_l] != 0).nonzero().view(-1)
    r_c = roles_l.index_select(0, rows)
    t_c = targets.index_select(0, rows)
    check_targets(t_c, rows, vocab)
    seq_c = (_dense_seq_ids(seq_ids, rows, n, dev) if cfg.importance_sampling == "sequence"
             else None)
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
    return LossRows(rows=rows, roles=r_c, targets=t_c, adv=adv_c, old=old_c, ref=ref_c,
                    pg_w=pgw_c, scale=scale, seq=seq_c, counts=counts)


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
    rl = rl_mask(rows_roles)
    oks = [torch.isfinite(v) | (~rl if rl_only else False) for _, v, rl_only in vals]
    ok = torch.stack(oks)
    if bool(ok.all()):
        return
    for (name, v, _), o in zip(vals, oks):
        if not bool(o.all()):
            k = int((~o).nonzero()[0, 0])
            raise ValueError(f"{name}[{int(rows[k])}] = {float(v[k])} is not finite at a "
                             f"loss-bearing token (check_finite=True)")


def role_metrics(counts, r_c, lp_c, ent_c, ratio, clipped, dual, kl_c, parts):
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
