"""Rollout: role-tagged chat templates, the tool-call parser, and the batched world-rehearsal engine.

    from fastrehearse.rollout import RolloutEngine, RolloutConfig
    engine = RolloutEngine(model, tokenizer, RolloutConfig(mode="hybrid", hybrid_p=0.3))
    result = engine.rollout(tasks, suite, group_size=4, seed=step)  # .episodes .trajectories .metrics
    result = engine.rollout(tasks, suite, policy=GoldPolicy())      # who writes the agent's turns
"""
from fastrehearse.rollout.backends.generator import Generator, HFGenerator
from fastrehearse.rollout.config import MODES, Prompt, RolloutConfig
from fastrehearse.rollout.engine.engine import RolloutEngine, RolloutResult
from fastrehearse.rollout.engine.fidelity import aggregate as aggregate_fidelity
from fastrehearse.rollout.engine.fidelity import score_pair
from fastrehearse.rollout.engine.policy import GoldPolicy, ModelPolicy, Policy, ScriptedPolicy, Turn, TurnRequest
from fastrehearse.rollout.text.template import ChatTemplate, Rendered, Scaffolding, format_tool_call
from fastrehearse.rollout.text.toolcall import (ERROR_KINDS, ParsedCall, ParseResult, malformed_response,
                                               parse_tool_calls)

__all__ = ["RolloutEngine", "RolloutConfig", "RolloutResult", "Prompt", "MODES", "Generator",
           "HFGenerator", "ChatTemplate", "Rendered", "Scaffolding", "format_tool_call",
           "parse_tool_calls", "ParsedCall", "ParseResult", "ERROR_KINDS", "malformed_response",
           "score_pair", "aggregate_fidelity", "Policy", "Turn", "TurnRequest", "ModelPolicy",
           "GoldPolicy", "ScriptedPolicy"]
