"""One rendering of gold trajectories (fastrehearse/rollout/text/gold.py) for its three users: the SFT
warm-up's episodes, the teacher-forced log-probs and GoldPolicy's forced turns all give the tokens
and texts each of them wrote out by hand before (the reference below is that code)."""
from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest

from fastrehearse.envs import get_suite
from fastrehearse.envs.base import Task
from fastrehearse.envs.builtin import BuiltinSuite
from fastrehearse.eval.teacher_forced import _render_gold
from fastrehearse.kernels.roles import Role
from fastrehearse.model.loader import load_tokenizer
from fastrehearse.rollout.engine.policy import GoldPolicy, TurnRequest
from fastrehearse.rollout.text.gold import gold_replies, render_gold
from fastrehearse.rollout.text.template import ChatTemplate, assistant_text
from fastrehearse.train.tasks import _tag_turn_ends, gold_episode


@pytest.fixture(scope="module")
def tmpl():
    return ChatTemplate(load_tokenizer("smollm2"))


def _suites():
    out = [("builtin", BuiltinSuite(level="all", easy_answer=True), "train", 12)]
    if importlib.util.find_spec("bfcl_eval") is not None:     # BFCL is an optional extra
        out.append(("bfcl", get_suite("bfcl"), "multi_turn_base", 2))
    return out


def _reference(tmpl, suite, task):
    """The rendering each user wrote out before: a fresh env's reset + the gold, tool turns OBSERVED."""
    env = suite.make_env()
    try:
        reset = env.reset(task)
    finally:
        env.close()
    msgs = list(reset.messages) + list(task.gold)
    return tmpl.render(msgs, reset.tools, tool_roles=Role.OBSERVED), msgs, reset.tools


@pytest.mark.parametrize("name,suite,split,n", _suites(), ids=lambda x: x if isinstance(x, str) else "")
def test_every_user_gets_the_tokens_it_rendered_itself(tmpl, name, suite, split, n):
    tasks = [t for t in suite.tasks(split, limit=n) if t.gold]
    assert tasks
    run = SimpleNamespace(template=tmpl, tokenizer=tmpl.tokenizer, suite=suite,
                          cfg=SimpleNamespace(rollout=SimpleNamespace(engine=SimpleNamespace(max_episode_tokens=10**6))))
    for task in tasks:
        ref, msgs, tools = _reference(tmpl, suite, task)
        g = render_gold(tmpl, suite, task)
        assert (g.rendered.input_ids, g.rendered.roles, g.rendered.spans) == (ref.input_ids, ref.roles, ref.spans)
        assert (g.messages, g.tools) == (msgs, tools)
        # SFT: the rendering, each turn's end marker given its turn's role
        ep = gold_episode(run, task)
        assert (ep.input_ids, ep.roles) == (ref.input_ids, _tag_turn_ends(tmpl, ref)), task.id
        assert Role.OBSERVED in ep.roles and Role.ACT in ep.roles
        # teacher-forced: the same token ids, the final answer the last message's ACT span
        if task.gold[-1].get("role") == "assistant" and not task.gold[-1].get("tool_calls"):
            ids, answer, responses, _, _ = _render_gold(tmpl, suite, task)
            assert ids == ref.input_ids
            assert answer == [(s, e) for s, e, r, mi in ref.spans if mi == len(msgs) - 1 and r == int(Role.ACT)]
            assert responses == [(s, e) for s, e, r, _ in ref.spans if r == int(Role.OBSERVED)]
        # GoldPolicy: turn k is the k-th gold assistant message's text, then an empty reply
        replies = [m for m in task.gold if m.get("role") == "assistant"]
        assert gold_replies(task) == replies
        reqs = [TurnRequest(row=0, task=task, messages=[], tools=[], input_ids=[], roles=[], turn=k, seed=0)
                for k in range(len(replies) + 1)]
        assert [t.text for t in GoldPolicy().begin_turns(reqs)] == [assistant_text(m) for m in replies] + [""]


def test_a_task_without_gold_is_refused_by_name(tmpl):
    task = Task(id="x", split="train", payload={}, gold=None)
    with pytest.raises(ValueError, match="'x' has no gold"):
        render_gold(tmpl, BuiltinSuite(), task)
    req = TurnRequest(row=0, task=task, messages=[], tools=[], input_ids=[], roles=[], turn=0, seed=0)
    with pytest.raises(ValueError, match="GoldPolicy: task 'x' has no gold"):
        GoldPolicy().begin_turns([req])
