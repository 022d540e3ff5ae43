"""A task's gold trajectory as the model sees it, in one place for every user: the SFT warm-up's
episodes (train/tasks.py), the teacher-forced log-probs (eval/teacher_forced.py) and `GoldPolicy`'s
forced turns (rollout/engine/policy.py, `--policy gold`).

  gold_replies(task)            the gold's agent turns (assistant messages), in order; a forced
                                turn's text is `template.assistant_text(reply)`, the text the
                                template renders for that message
  render_gold(tmpl, suite, task)  the prompt a fresh environment gives (its reset) followed by the
                                whole gold, rendered with the chat template into role-tagged
                                tokens; tool responses are OBSERVED (the gold's are real ones)
"""
from __future__ import annotations

from dataclasses import dataclass

from fastrehearse.envs.base import Suite, Task
from fastrehearse.kernels.roles import Role
from fastrehearse.rollout.text.template import ChatTemplate, Rendered


@dataclass
class GoldRender:
    rendered: Rendered            # token ids, one role per token, spans (message index per content)
    messages: list[dict]          # the reset's messages + the gold: what `rendered` spans index
    tools: list[dict]             # the tools of the prompt (the reset's)


def gold_replies(task: Task | None) -> list[dict]:
    """The gold trajectory's assistant messages, in order; ValueError naming a task without one."""
    if task is None or task.gold is None:
        raise ValueError(f"task {getattr(task, 'id', None)!r} has no gold trajectory (task.gold is None)")
    return [m for m in task.gold if m.get("role") == "assistant"]


def render_gold(tmpl: ChatTemplate, suite: Suite, task: Task) -> GoldRender:
    """The task's prompt (a fresh environment's reset, closed again) and its gold trajectory as
    role-tagged tokens, tool responses OBSERVED."""
    if task.gold is None:
        raise ValueError(f"task {task.id!r} has no gold trajectory (task.gold is None)")
    env = suite.make_env()
    try:
        reset = env.reset(task)
    finally:
        env.close()
    messages = list(reset.messages) + list(task.gold)
    return GoldRender(tmpl.render(messages, reset.tools, tool_roles=Role.OBSERVED), messages, reset.tools)
