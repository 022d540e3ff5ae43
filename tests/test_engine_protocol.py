"""The engine as the one episode driver, on small fake environments: user turns rendered with the
chat template between policy turns (token in, token out: the episode equals the template's render of
the whole conversation), tools that change mid-task, the stop tool, an unreachable user simulator
recorded as an error, graded-call-only tasks, token-source policies (scripted, context), and the
protocol defaults."""
import pytest

from fastrehearse.envs import get_suite
from fastrehearse.envs.base import ResetResult, Task, ToolEnv
from fastrehearse.kernels.roles import Role
from fastrehearse.rollout import RolloutConfig, RolloutEngine
from fastrehearse.rollout.engine.policy import ModelPolicy, ScriptedPolicy, Turn
from fastrehearse.rollout.text.template import ChatTemplate, format_tool_call
from _rollout_fixtures import (LLAMA31_TEMPLATE, QWEN25_TEMPLATE, CalcEnv, MultiTurnCalcEnv,
                                          llama3_style_tokenizer, smollm2_tokenizer)


def _template(name):
    if name == "smollm2":
        return ChatTemplate(smollm2_tokenizer())
    if name == "qwen25":
        return ChatTemplate(smollm2_tokenizer(), QWEN25_TEMPLATE)
    return ChatTemplate(llama3_style_tokenizer(), LLAMA31_TEMPLATE)


def engine(tmpl, **cfg):
    # model=None: every turn below is forced by the policy, so nothing is ever sampled.
    return RolloutEngine(None, tmpl.tokenizer, RolloutConfig(mode="real", **cfg), template=tmpl)


TASK = Task("mt-0", "test", {"question": "Add 2 and 3.", "answer": "5",
                             "user_turns": ["Now add 4 and 5.", "Multiply 3 by 4."], "add_tool_at": 2})


@pytest.mark.parametrize("name", ["smollm2", "qwen25", "llama31"])
def test_user_turns_render_as_the_template_does(name):
    """A three-user-turn episode with text replies only: the engine's tokens (prompt, forced
    replies, user turns forced after each reply) are exactly the template's render of the whole
    conversation, and every user turn is CONTEXT."""
    tmpl = _template(name)
    replies = ["It is 5.", "It is 9.", "It is 12."]
    res = engine(tmpl).rollout([TASK], MultiTurnCalcEnv, policy=ScriptedPolicy(replies))
    ep, traj = res.episodes[0], res.trajectories[0]
    assert ep.metadata["stop_reason"] == "final_answer" and ep.metadata["user_turns"] == 2
    assert [m["role"] for m in traj.messages] == ["assistant", "user", "assistant", "user", "assistant"]
    env = MultiTurnCalcEnv()
    reset = env.reset(TASK)
    msgs = reset.messages + [{"role": m["role"], "content": m["content"]} for m in traj.messages]
    full = tmpl.render(msgs, reset.tools)
    # The template's own render ends with the final reply's closing scaffolding; the engine stops
    # right after the end-of-turn marker it wrote.
    assert ep.input_ids == full.input_ids[:len(ep.input_ids)]
    tail = tmpl.tokenizer.decode(full.input_ids[len(ep.input_ids):])
    assert tail in tmpl.scaffolding.texts["assistant_end"], tail
    # every user turn's tokens are CONTEXT, every reply's are ACT
    for s, e, role, mi in full.spans:
        if mi >= len(reset.messages) and e <= len(ep.input_ids):
            want = Role.ACT if msgs[mi]["role"] == "assistant" else Role.CONTEXT
            assert set(ep.roles[s:e]) == {int(want)}, (msgs[mi], set(ep.roles[s:e]))


def test_tools_added_mid_task_are_callable_after_their_turn():
    """`mul` appears at user turn 2: before it, a call is malformed (unknown_tool); after it the
    parser accepts it and the env runs it. The change is recorded."""
    tmpl = _template("smollm2")
    mul = format_tool_call("mul", {"a": 3, "b": 4})
    script = [mul, "No.", "It is 9.", mul, "It is 12."]
    res = engine(tmpl, max_turns=4).rollout([TASK], MultiTurnCalcEnv, policy=ScriptedPolicy(script))
    ep, traj = res.episodes[0], res.trajectories[0]
    assert ep.metadata["malformed"] == {"unknown_tool": 1}
    assert ep.metadata["tools_changed"] == [2]
    assert [c["mode"] for c in ep.metadata["calls"]] == ["error", "real"]
    assert traj.messages[-2] == {"role": "tool", "content": '{"result": 12}', "rehearsed": False}
    assert ep.metadata["stop_reason"] == "final_answer"


def test_stop_tool_ends_the_episode_and_is_never_rehearsed():
    tmpl = _template("smollm2")
    stop = format_tool_call("finish", {})
    for mode in ("real", "rehearse", "hybrid"):
        eng = RolloutEngine(None, tmpl.tokenizer, RolloutConfig(mode=mode, hybrid_p=0.0), template=tmpl)
        res = eng.rollout([TASK], MultiTurnCalcEnv, policy=ScriptedPolicy([stop]))
        ep = res.episodes[0]
        assert ep.metadata["stop_reason"] == "finished", mode
        assert [c["mode"] for c in ep.metadata["calls"]] == ["real"]


def test_unreachable_user_simulator_is_an_error_not_a_score():
    tmpl = _template("smollm2")
    task = Task("mt-1", "test", {"question": "Add 2 and 3.", "answer": "5", "user_fails": True})
    res = engine(tmpl).rollout([task], MultiTurnCalcEnv, policy=ScriptedPolicy(["It is 5."]))
    ep = res.episodes[0]
    assert ep.metadata["stop_reason"] == "env_error"
    assert "ConnectionError: user simulator unreachable" in ep.metadata["error"]
    assert res.metrics["errors"] == 1 and ep.reward == 0.0


def test_max_turns_counts_per_user_turn():
    """Two calls then a reply in each of two user turns: max_turns=3 is enough (the counter
    restarts at the user turn); max_turns=2 cuts the first user turn short."""
    tmpl = _template("smollm2")
    add = format_tool_call("add", {"a": 2, "b": 3})
    task = Task("mt-2", "test", {"question": "q", "answer": "5", "user_turns": ["again"]})
    script = [add, add, "It is 5.", add, add, "It is 5."]
    ep = engine(tmpl, max_turns=3).rollout([task], MultiTurnCalcEnv, policy=ScriptedPolicy(script)).episodes[0]
    assert ep.metadata["stop_reason"] == "final_answer" and ep.metadata["turns"] == 6 and ep.reward == 1.0
    ep = engine(tmpl, max_turns=2).rollout([task], MultiTurnCalcEnv, policy=ScriptedPolicy(script)).episodes[0]
    assert ep.metadata["stop_reason"] == "max_turns" and ep.metadata["turns"] == 2


class GradedEnv(CalcEnv):
    grades_calls_only = True

    def score(self, task, trajectory):
        (msg,) = trajectory.messages
        return float(msg["raw_text"].startswith("<tool_call>"))


def test_graded_calls_only_is_one_turn_and_executes_nothing():
    tmpl = _template("smollm2")
    env_box = []

    def make():
        env_box.append(GradedEnv())
        return env_box[-1]
    bad = "<tool_call>\n{not json\n</tool_call>"
    for text, reward in ((format_tool_call("add", {"a": 1, "b": 2}), 1.0), (bad, 1.0), ("no call", 0.0)):
        ep = engine(tmpl).rollout([TASK], make, policy=ScriptedPolicy([text])).episodes[0]
        assert ep.metadata["stop_reason"] == "graded" and ep.metadata["turns"] == 1
        assert ep.reward == reward and not ep.metadata["malformed"]   # the checker decides
        assert env_box[-1].calls == [] and Role.OBSERVED not in ep.roles


def test_policy_context_and_defaults():
    """Turn(context=...) lands as CONTEXT before the turn and is recorded on the message; a Turn
    with only context lets the model write the turn (here: no model, so it raises cleanly)."""
    tmpl = _template("smollm2")

    def script(req):
        return Turn(text="It is 5.", context="[memory: add gives 5]", info={"k": req.turn})
    res = engine(tmpl).rollout([TASK], CalcEnv, policy=ScriptedPolicy(script))
    ep, traj = res.episodes[0], res.trajectories[0]
    assert traj.messages[0]["context"] == "[memory: add gives 5]" and traj.messages[0]["content"] == "It is 5."
    ctx = tmpl.encode("[memory: add gives 5]")
    i = next(k for k in range(len(ep.input_ids)) if ep.input_ids[k:k + len(ctx)] == ctx)
    assert set(ep.roles[i:i + len(ctx)]) == {int(Role.CONTEXT)} and ep.roles[i + len(ctx)] == Role.ACT
    assert ep.metadata["policy"] == [{"turn": 0, "k": 0}] and ep.reward == 1.0
    with pytest.raises(ValueError, match="cannot sample"):
        engine(tmpl).rollout([TASK], CalcEnv, policy=ModelPolicy())


def test_protocol_defaults_and_type_check():
    class Bare(ToolEnv):
        def reset(self, task):
            return ResetResult([], [{"role": "user", "content": "hi"}])

        def execute(self, call):
            raise AssertionError

        def score(self, task, trajectory):
            return 0.0
    e = Bare()
    assert (e.tools, e.finished, e.control_tools, e.validates_calls, e.grades_calls_only) == \
        (None, False, frozenset(), False, False)
    assert e.next_user_message({"role": "assistant", "content": "x"}) is None and e.drift_stats() == {}
    tmpl = _template("smollm2")
    with pytest.raises(TypeError, match="not a fastrehearse.envs.base.ToolEnv"):
        engine(tmpl).rollout([TASK], lambda: object(), policy=ModelPolicy())


def test_unknown_suite_is_a_one_line_error():
    with pytest.raises(ValueError, match=r"unknown suite 'nope'; available: \['bfcl', 'builtin', 'mcp', 'tau2'\] or an import "
                                         r"path 'package.module:Class'"):
        get_suite("nope")


def test_policy_may_rehearse_privately_with_the_same_engine():
    """A policy that runs engine.generate() on a private prompt (no env) inside begin_turns -- the
    shape of test-time rehearsal -- leaves the outer episode intact: the outer policy keeps being
    asked, the env is never touched by the rehearsal, the private row only rehearses."""
    from fastrehearse.model import load_model
    from fastrehearse.rollout import Prompt
    model, tok = load_model("tiny-llama")
    tmpl = ChatTemplate(tok)
    eng = RolloutEngine(model, tok, RolloutConfig(mode="real", max_new_tokens=4, max_turns=2), template=tmpl)
    envs, private = [], []

    def make():
        envs.append(MultiTurnCalcEnv())
        return envs[-1]

    def script(req):
        res = eng.generate([Prompt(req.input_ids, req.roles, req.tools, seed=req.seed)])
        private.append(res.episodes[0])
        return ["<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 2, \"b\": 3}}\n</tool_call>",
                "It is 5."][req.turn]
    one_turn = Task("mt-3", "test", {"question": "Add 2 and 3.", "answer": "5"})
    res = eng.rollout([one_turn], make, policy=ScriptedPolicy(script))
    ep = res.episodes[0]
    assert ep.metadata["turns"] == 2 and ep.reward == 1.0 and res.metrics["forced_turns"] == 2
    assert len(private) == 2 and all(p.metadata["calls"] == [] or
                                     {c["mode"] for c in p.metadata["calls"]} <= {"rehearse", "error"}
                                     for p in private)
    assert len(envs) == 1 and [c.name for c in envs[0].calls] == ["add"]   # only the outer real call
    assert eng.policy is None


def test_cut_turns_close_as_written_or_end_the_episode():
    """on_max_new_tokens="end_turn" (default): an agent turn cut at max_new_tokens is the reply as
    written (the end-of-turn marker forced as CONTEXT), so a multi-turn task walks on through its
    user turns; "end_episode" stops there."""
    from fastrehearse.model import load_model
    model, tok = load_model("tiny-llama")
    tmpl = ChatTemplate(tok)
    end = tmpl.encode(tmpl.assistant_end_markers[0])
    for how in ("end_turn", "end_episode"):
        eng = RolloutEngine(model, tok, RolloutConfig(mode="real", max_new_tokens=3, on_max_new_tokens=how),
                            template=tmpl)
        res = eng.rollout([TASK], MultiTurnCalcEnv, seed=1)
        ep, traj = res.episodes[0], res.trajectories[0]
        if how == "end_episode":
            assert ep.metadata["stop_reason"] == "max_new_tokens" and ep.metadata["turns"] == 0
            continue
        assert ep.metadata["stop_reason"] == "final_answer" and ep.metadata["user_turns"] == 2
        assert ep.metadata["cut_turns"] == 3 == res.metrics["cut_turns"]
        replies = [m for m in traj.messages if m["role"] == "assistant"]
        assert len(replies) == 3 and all(m["cut"] == "max_new_tokens" for m in replies)
        # after each cut reply: 3 sampled ACT tokens, then the forced end-of-turn as CONTEXT
        acts = [i for i, r in enumerate(ep.roles) if r == Role.ACT]
        assert len(acts) == 9
        for k in (2, 5):
            i = acts[k] + 1
            assert ep.input_ids[i:i + len(end)] == end and set(ep.roles[i:i + len(end)]) == {int(Role.CONTEXT)}


# A Mistral-style structure: the tool list is rendered just before the *last* user message.
TOOLS_NEAR_LAST_USER = (
    "{%- for m in messages %}"
    "{%- if m['role'] == 'user' %}"
    "{%- if loop.last or messages[loop.index0 + 1:] | selectattr('role', 'equalto', 'user') | list | length == 0 %}"
    "{%- if tools %}{{- '[TOOLS]' + (tools | map(attribute='function') | map(attribute='name') | join(',')) + '[/TOOLS]' }}{%- endif %}"
    "{%- endif %}"
    "{{- '<|im_start|>user\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- elif m['role'] == 'tool' %}{{- '<|im_start|>tool\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def test_changed_tools_are_rendered_where_the_template_puts_them():
    """With a template that lists tools before the latest user message, the user turn that adds
    `mul` is preceded by the new tool list (add, lookup, finish, mul); with ChatML (tools in the
    system turn, never re-rendered) the user turns carry no tool list."""
    task = Task("mt-4", "test", {"question": "Add 2 and 3.", "answer": "5", "user_turns": ["Now 3*4."],
                                 "add_tool_at": 1})
    for template, expect in ((TOOLS_NEAR_LAST_USER, "[TOOLS]add,lookup,finish,mul[/TOOLS]"), (None, None)):
        tmpl = ChatTemplate(smollm2_tokenizer(), template)
        res = engine(tmpl).rollout([task], MultiTurnCalcEnv, policy=ScriptedPolicy(["5.", "12."]))
        ep = res.episodes[0]
        assert ep.metadata["tools_changed"] == [1] and ep.metadata["user_turns"] == 1
        after = tmpl.tokenizer.decode(ep.input_ids[ep.metadata["prompt_tokens"]:])
        prompt = tmpl.tokenizer.decode(ep.input_ids[:ep.metadata["prompt_tokens"]])
        if expect:
            assert "[TOOLS]add,lookup,finish[/TOOLS]" in prompt
            assert expect in after and after.index(expect) < after.index("Now 3*4.")
        else:
            assert "mul" not in after and "<tools>" in prompt and "<tools>" not in after
