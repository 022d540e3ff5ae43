"""fastrehearse.kernels -- fused linear log-prob / entropy / policy-loss kernels.

Importable alone: depends on torch only (no transformers, no trainer code; triton is imported
when the Triton backend runs), with a plain-tensor API so other RL trainers (verl, TRL,
prime-rl, ...) can drop it in.

    linear_logprobs(hidden, weight, targets, *, mask, temperature, with_entropy, backend,
                    chunk_size, bias, logit_softcap, logit_scale, workspace_bytes)
    linear_policy_loss(hidden, weight, targets, roles, advantages, old_logp, config, ...,
                       bias, logit_softcap, logit_scale, seq_ids)      # old_logp=None: on-policy
    check_backend(backend, device, *, weight, bias, logit_softcap, logit_scale)  # before any work
    BACKENDS; FUSED_WORKSPACE_BYTES_CUDA   # the backends; the fused tile kernel's CUDA workspace

See docs/kernels.md for the math and the design.
"""
from ._common import BACKENDS, FUSED_WORKSPACE_BYTES_CUDA, check_backend
from .linear_logprobs import linear_logprobs
from .policy_loss import PolicyLossConfig, PolicyLossOutput, linear_policy_loss
from .roles import NUM_ROLES, Role

__all__ = ["Role", "NUM_ROLES", "linear_logprobs", "linear_policy_loss", "PolicyLossConfig",
           "PolicyLossOutput", "BACKENDS", "check_backend", "FUSED_WORKSPACE_BYTES_CUDA"]
