"""fastrehearse.kernels -- fused linear log-prob / entropy / policy-loss kernels.

Importable alone: depends on torch and triton only (no transformers, no trainer code), with a
plain-tensor API so other RL trainers (verl, TRL, prime-rl, ...) can drop it in.
"""
from .roles import NUM_ROLES, Role

__all__ = ["Role", "NUM_ROLES"]

try:  # filled in by the kernel work; kept importable while pieces land
    from .linear_logprobs import linear_logprobs  # noqa: F401
    __all__.append("linear_logprobs")
except ImportError:  # pragma: no cover
    pass
try:
    from .policy_loss import PolicyLossConfig, PolicyLossOutput, linear_policy_loss  # noqa: F401
    __all__ += ["PolicyLossConfig", "PolicyLossOutput", "linear_policy_loss"]
except ImportError:  # pragma: no cover
    pass
