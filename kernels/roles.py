"""Token roles of a world-rehearsal sequence (see docs/ARCHITECTURE.md).

One episode is one token sequence; every token carries the role that produced it. Loss terms are
selected by the role of the *target* token.
"""
from enum import IntEnum


class Role(IntEnum):
    CONTEXT = 0   # system prompt, tool schemas, user turns, chat-template scaffolding: no loss
    ACT = 1       # the policy's own tokens (reasoning, <tool_call>...</tool_call>, final answer): RL
    REHEARSE = 2  # the model playing the environment: the tool response it wrote itself: RL
    OBSERVED = 3  # a real environment's response: optional supervised CE (grounding)


NUM_ROLES = len(Role)
