"""Role-wise GRPO: per-(task group, role) advantages and loss-aggregation weights (plain torch)."""
from .advantages import AdvantageConfig, AdvantageStats, compute_advantages, group_advantages, with_advantages
from .aggregation import AGGREGATIONS, check_mode, local_counts, token_weights

__all__ = ["AdvantageConfig", "AdvantageStats", "compute_advantages", "group_advantages", "with_advantages",
           "AGGREGATIONS", "check_mode", "local_counts", "token_weights"]
