"""`linear_policy_loss`: the role-wise GRPO / PPO-clip loss fused with the LM-head projection.

The loss of one token is defined once, in `_token_loss.py` (`token_loss`; the formulas in its
docstring and docs/kernels.md); this module checks the call, compacts the loss-bearing rows
(`_loss_io.py`) and picks the path that computes it:
- fused (default): one sweep over row chunks, logits -> per-token slopes -> dX, dW in the same
  pass (6NHV FLOPs; `_fused_linear_loss.py`);
- unfused (`fused=False`, or importance_sampling="sequence"): `linear_logprobs` + `token_loss`
  as plain autograd torch (8NHV; the reference the tests compare against).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Sequence

import torch

from ._common import (check_fused_forward, check_linear_inputs, check_workspace_bytes,
                      resolve_backend)
from ._fused_linear_loss import fast_torch as _fast_torch
from ._fused_linear_loss import fused_policy_loss
from ._head import build_head
from ._loss_io import check_inputs, compact_rows, role_metrics
from ._token_loss import PolicyLossConfig, log_ratio, rl_mask, token_loss, token_stats
from .linear_logprobs import linear_logprobs
from .roles import NUM_ROLES

__all__ = ["PolicyLossConfig", "PolicyLossOutput", "linear_policy_loss"]


@dataclass
class PolicyLossOutput:
    loss: torch.Tensor                  # scalar, differentiable w.r.t. hidden and weight
    logp: torch.Tensor                  # [N] float32, detached; 0 where no loss is computed
    entropy: torch.Tensor | None        # [N] float32, detached (when entropy_coef != 0 or asked)
    metrics: dict[str, dict[str, float]] = field(default_factory=dict)  # per role name


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
        token_weights: [N] float per-token c_t replacing 1/n_r (see _token_loss.py).
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
            `_fused_linear_loss.fused_loss_rows`; default on CUDA 3 GiB, on the CPU 32 MiB
            logits chunks).
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
    n, dev = hidden.shape[0], hidden.device
    check_inputs(roles, advantages, old_logp, ref_logp, token_weights, pg_weights, seq_ids, cfg,
                 n, dev)
    backend = resolve_backend(backend, dev)
    workspace_bytes = check_workspace_bytes(workspace_bytes)
    if dw_accum_dtype not in (torch.float32, weight.dtype):
        raise ValueError(f"dw_accum_dtype must be torch.float32 or the weight's dtype "
                         f"({weight.dtype}), got {dw_accum_dtype!r}")
    head, inv_temp = build_head(bias, logit_softcap, logit_scale, weight,
                                1.0 / float(cfg.temperature))
    check_fused_forward(backend, head)
    batch = compact_rows(targets, roles, advantages, old_logp, ref_logp, token_weights, pg_weights,
                         seq_ids, cfg, normalizers, check_finite, weight.shape[0])
    with_ent = bool(with_entropy) or cfg.entropy_coef != 0.0
    x_c = hidden.index_select(0, batch.rows)

    if fused and cfg.importance_sampling == "token":
        loss, plan = fused_policy_loss(
            x_c, weight, bias, head, inv_temp, batch, cfg, backend=backend,
            fast=_fast_torch(backend, cfg.entropy_coef != 0.0, head), with_entropy=with_ent,
            chunk_size=chunk_size, workspace_bytes=workspace_bytes, dw_accum_dtype=dw_accum_dtype)
        lp_c, ent_c, kl_c = plan.logp, plan.ent, plan.kl
        ratio, clipped, dual, parts = plan.ratio, plan.clipped, plan.dual, plan.loss_parts
    else:
        lp_c, ent_c = linear_logprobs(x_c, weight, batch.targets, temperature=cfg.temperature,
                                      with_entropy=with_ent, backend=backend,
                                      chunk_size=chunk_size, workspace_bytes=workspace_bytes,
                                      bias=bias, logit_softcap=logit_softcap,
                                      logit_scale=logit_scale)
        r_c = batch.roles
        l = token_loss(lp_c, ent_c, r_c, batch.adv, batch.old, batch.ref, cfg, batch.seq,
                       batch.pg_w)
        contrib = l * batch.scale
        loss = contrib.sum()
        with torch.no_grad():
            lp_d = lp_c.detach()
            lr = log_ratio(lp_d, batch.old, rl_mask(r_c), batch.seq, cfg)
            ratio, clipped, dual, kl_c = token_stats(lp_d, r_c, batch.adv, lr, batch.ref, cfg)
            parts = torch.zeros(NUM_ROLES, device=dev).index_add_(0, r_c, contrib.detach())
        lp_c = lp_c.detach()
        ent_c = None if ent_c is None else ent_c.detach()

    logp = torch.zeros(n, device=dev, dtype=torch.float32).index_put_((batch.rows,), lp_c)
    ent = None
    if ent_c is not None:
        ent = torch.zeros(n, device=dev, dtype=torch.float32).index_put_((batch.rows,), ent_c)
    metrics = role_metrics(batch.counts, batch.roles, lp_c, ent_c, ratio, clipped, dual, kl_c,
                           parts)
    return PolicyLossOutput(loss=loss, logp=logp, entropy=ent, metrics=metrics)
