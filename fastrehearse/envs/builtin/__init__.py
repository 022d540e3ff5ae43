"""The builtin suite: seeded multi-step tool-use tasks over accounts, a shop, a calendar and unit
conversion, with gold trajectories and exact scoring. See docs/envs.md."""
from fastrehearse.envs.builtin.suite import LEVEL_PRESETS, SYSTEM_PROMPT, BuiltinEnv, BuiltinSuite
from fastrehearse.envs.builtin.tools import DOMAINS, SCHEMAS

__all__ = ["BuiltinSuite", "BuiltinEnv", "LEVEL_PRESETS", "SYSTEM_PROMPT", "SCHEMAS", "DOMAINS"]
