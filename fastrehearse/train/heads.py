"""The loss heads run inside the (sharded) model's forward, where the LM-head weight is whole:
the RL head (fastrehearse.kernels.linear_policy_loss) and the SFT head (masked CE)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fastrehearse.kernels import linear_logprobs, linear_policy_loss
from fastrehearse.kernels.roles import NUM_ROLES, Role

from .config import TrainConfig


def rl_head(cfg: TrainConfig, b, token_counts, w, pg_w=None):
    """The loss head run inside the (sharded) module's forward, where the LM-head weight is whole.
    cfg.algo.loss is the kernel's PolicyLossConfig (temperature resolved by config.validate).
    w: the aggregation's token weights (None: token-mean); pg_w: truncated-IS weights on the
    policy-gradient term (fastrehearse.algo.tis; None: off)."""
    pcfg = cfg.algo.loss

    def head(hidden, weight, **head_kw):   # head_kw: the model's LM-head settings (bias, soft-cap, scale)
        kw = {"ref_logp": b.ref_logp, "backend": cfg.model.kernel_backend, "pg_weights": pg_w,
              **head_kw}
        if w is None:
            kw["normalizers"] = token_counts.to(hidden.device)
        else:
            kw["token_weights"] = w
        return linear_policy_loss(hidden, weight, b.targets, b.roles, b.advantages, b.old_logp, pcfg, **kw)
    return head


@dataclass
class CEResult:
    loss: torch.Tensor
    logp: torch.Tensor
    roles: torch.Tensor
    metrics: dict = field(default_factory=dict)


def sft_head(cfg: TrainConfig, b, token_counts):
    """Masked CE on ACT (w_act), OBSERVED (w_observed) and REHEARSE (w_rehearse) tokens, each role divided by its global
    token count: loss = sum_r w_r / N_r * sum_{t in r} -log p(t)."""
    w_role = torch.zeros(NUM_ROLES, dtype=torch.float64)
    w_role[int(Role.ACT)] = cfg.sft.w_act
    w_role[int(Role.OBSERVED)] = cfg.sft.w_observed
    w_role[int(Role.REHEARSE)] = cfg.sft.w_rehearse   # only own_rehearsals episodes carry REHEARSE tokens
    scale = torch.where(token_counts > 0, w_role / token_counts.clamp_min(1), torch.zeros_like(w_role))

    def head(hidden, weight, **head_kw):
        mask = scale.to(b.roles.device)[b.roles] > 0
        logp, _ = linear_logprobs(hidden, weight, b.targets, mask=mask,
                                  backend=cfg.model.kernel_backend, **head_kw)
        c = scale.to(hidden.device, torch.float32)[b.roles]
        return CEResult(loss=-(logp * c).sum(), logp=logp.detach(), roles=b.roles)
    return head


