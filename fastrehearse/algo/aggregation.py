"""Loss aggregation modes as per-token weights for the fused loss.

The fused loss computes, for loss-bearing token t of role r(t) with per-token loss l_t,

    loss = sum_r w_r * sum_{t in r} c_t * l_t

where c_t is either 1 / n_r (the kernel's `normalizers`, token-mean) or an explicit per-token weight
(`token_weights`). Each mode below fixes c_t so that summing over micro-batches and data-parallel
ranks gives exactly the full-batch loss, whatever the split (all counts are global):

  token-mean (default)      c_t = 1 / N_r              N_r = tokens of role r in the whole step
                            (each token counts the same; DAPO / prime-rl style)
  seq-mean-token-mean       c_t = 1 / (S_r * n_{i,r})  S_r = episodes with >= 1 token of role r
                            (original GRPO: mean over tokens per episode, then over episodes)
  seq-mean-token-sum-norm   c_t = 1 / (S_r * L)        L = norm_len, a constant (Dr. GRPO: removes
                            the length bias of per-episode token means)

i = the episode of token t, n_{i,r} = its tokens of role r. An episode lies whole inside one rank's
micro-batches (packing never splits one), so n_{i,r} is local; N_r and S_r are all-reduced.
"""
from __future__ import annotations

from typing import Protocol, Sequence

import torch

from fastrehearse.kernels.roles import NUM_ROLES, Role

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


class _HasRoles(Protocol):
    roles: torch.Tensor     # [T] role of each target token
    seq_ids: torch.Tensor   # [T] episode index of each token


def check_mode(mode: str) -> str:
    if mode not in AGGREGATIONS:
        raise ValueError(f"aggregation={mode!r} is not one of {list(AGGREGATIONS)}")
    return mode


def local_counts(batches: Sequence[_HasRoles]) -> torch.Tensor:
    """[2, NUM_ROLES] float64: row 0 = token count per role, row 1 = episodes having that role.

    All-reduce (SUM) this across ranks to get the global N_r and S_r.
    """
    tokens = torch.zeros(NUM_ROLES, dtype=torch.float64)
    pairs = []
    for b in batches:
        roles = b.roles.detach().to("cpu", torch.int64).reshape(-1)
        tokens += torch.bincount(roles, minlength=NUM_ROLES)[:NUM_ROLES].to(torch.float64)
        pairs.append(torch.stack([b.seq_ids.detach().to("cpu", torch.int64).reshape(-1), roles], 1))
    seqs = torch.zeros(NUM_ROLES, dtype=torch.float64)
    if pairs:
        uniq = torch.unique(torch.cat(pairs), dim=0)
        seqs += torch.bincount(uniq[:, 1], minlength=NUM_ROLES)[:NUM_ROLES].to(torch.float64)
    seqs[int(Role.CONTEXT)] = 0.0   # CONTEXT carries no loss; not counted as an episode of a role
    return torch.stack([tokens, seqs])


def token_weights(batches: Sequence[_HasRoles], mode: str, global_counts: torch.Tensor,
                  *, norm_len: float | None = None) -> list[torch.Tensor]:
    """Per-token weights c_t (float32, one tensor per batch; 0 on CONTEXT tokens).

    global_counts: [2, NUM_ROLES] from `local_counts`, summed over all ranks.
    """
    check_mode(mode)
    if mode == "seq-mean-token-sum-norm" and (norm_len is None or norm_len <= 0):
        raise ValueError(f"aggregation={mode!r} needs norm_len > 0 (a constant such as the "
                         f"maximum response length), got norm_len={norm_len}")
    n_tok, n_seq = global_counts[0].to(torch.float64), global_counts[1].to(torch.float64)
    # Per-(episode, role) token counts over all of this rank's batches (an episode is in one).
    per_seq = None
    if mode == "seq-mean-token-mean":
        num_seqs = 1 + max((int(b.seq_ids.max()) for b in batches if b.seq_ids.numel()), default=0)
        per_seq = torch.zeros(num_seqs * NUM_ROLES, dtype=torch.float64)
        for b in batches:
            key = b.seq_ids.cpu().long().reshape(-1) * NUM_ROLES + b.roles.cpu().long().reshape(-1)
            per_seq.index_add_(0, key, torch.ones(key.numel(), dtype=torch.float64))

    out = []
    for b in batches:
        roles = b.roles.cpu().long().reshape(-1)
        if mode == "token-mean":
            denom = n_tok[roles]
        elif mode == "seq-mean-token-sum-norm":
            denom = n_seq[roles] * norm_len
        else:
            denom = n_seq[roles] * per_seq[b.seq_ids.cpu().long().reshape(-1) * NUM_ROLES + roles]
        w = torch.where(roles != int(Role.CONTEXT), 1.0 / denom.clamp_min(1e-300),
                        torch.zeros((), dtype=torch.float64))
        out.append(w.to(torch.float32).to(b.roles.device))
    return out
