"""Test-time rehearsal on the rollout engine: private rehearsals never reach the real environment
(env.execute counted), the memory form puts exactly one rehearsal memory in context per committed
turn, select commits a draft only when the world model foresees the greedy turn failing, and the
token cost of rehearsal is counted apart from the committed turns."""
import pytest

from fastrehearse.envs.builtin import BuiltinSuite
from fastrehearse.eval.harness import HarnessConfig, run_items
from fastrehearse.eval.rehearsal import (MEMORY_HEAD, RehearsalPolicy, judge, looks_like_error)
from fastrehearse.eval.results import ResultStore
from fastrehearse.eval.runner import EvalSettings, eval_engine
from fastrehearse.kernels.roles import Role
from fastrehearse.rollout.engine.policy import ModelPolicy, ScriptedPolicy
from fastrehearse.rollout.text.template import assistant_text, format_tool_call


@pytest.fixture(scope="module")
def tiny():
    """A tiny random Llama with a wide init, so its greedy text is words, not one repeated newline
    (its assessments are then non-empty text)."""
    from fastrehearse.model import build_tiny_model, load_tokenizer
    from fastrehearse.model.loader import _sync_special_tokens

    tok = load_tokenizer("smollm2")
    model = build_tiny_model("llama", vocab_size=len(tok), seed=0, initializer_range=0.2)
    _sync_special_tokens(model, tok)
    return model, tok


class CountingSuite(BuiltinSuite):
    """Builtin tasks whose environments count every env.execute call."""
    executed = 0

    def make_env(self):
        env = super().make_env()
        inner = env.execute

        def execute(call):
            CountingSuite.executed += 1
            return inner(call)

        env.execute = execute
        return env


def _gold_call(r):
    """The task's first gold call turn (a valid call of a visible tool)."""
    return assistant_text(next(m for m in r.task.gold if m.get("tool_calls")))


def _call_then_answer(r):
    return _gold_call(r) if r.turn == 0 else "All done."


def _run(tiny, policy, out, n=3, suite=None, max_new_tokens=8):
    suite = suite or CountingSuite()
    model, tok = tiny
    engine = eval_engine(model, tok, EvalSettings(max_turns=4, max_new_tokens=max_new_tokens))
    tasks = suite.tasks("test", n)
    return run_items([("test", t) for t in tasks], lambda c: suite.make_env(), engine, policy,
                     ResultStore(out, {}), HarnessConfig(batch_size=3)), engine


def _policy(tiny, budget, **kw):
    model, tok = tiny
    kw.setdefault("max_new_tokens", 8)
    kw.setdefault("assess_tokens", 6)
    return RehearsalPolicy(model, tok, budget, **kw)


@pytest.mark.parametrize("form", ["memory", "select"])
@pytest.mark.parametrize("mode", ["parallel", "sequential"])
def test_private_rehearsals_never_execute(tmp_path, tiny, mode, form):
    """Drafts call a tool in every rehearsal, yet env.execute runs exactly the committed calls."""
    CountingSuite.executed = 0
    p = _policy(tiny, 2, form=form, mode=mode, base=ScriptedPolicy(_call_then_answer),
                draft=ScriptedPolicy(_gold_call))
    done, _ = _run(tiny, p, tmp_path)
    assert all(r.error is None for r in done), [r.error for r in done]
    committed = sum(len(next(m for m in t.gold if m.get("tool_calls"))["tool_calls"])
                    for t in CountingSuite().tasks("test", 3))
    assert CountingSuite.executed == sum(r.real_calls for r in done) == committed
    assert all(r.rehearsal_tokens > 0 for r in done)        # the model wrote the predicted responses


def test_memory_form_one_memory_per_committed_turn(tiny):
    """The engine episode holds exactly one rehearsal memory per committed turn, as CONTEXT at the
    start of that turn, each built from N drafts with the model's own assessment."""
    model, tok = tiny
    suite = BuiltinSuite()
    tasks = suite.tasks("test", 2)
    engine = eval_engine(model, tok, EvalSettings(max_turns=4, max_new_tokens=8))
    p = _policy(tiny, 2, form="memory", base=ScriptedPolicy(_call_then_answer),
                draft=ScriptedPolicy(_gold_call))
    envs = [suite.make_env() for _ in tasks]
    res = engine.generate([engine.prompt_for(t, e, i) for i, (t, e) in enumerate(zip(tasks, envs))], policy=p)
    for ep, traj in zip(res.episodes, res.trajectories):
        turns = ep.metadata["turns"]
        assert turns == 2
        text = tok.decode(ep.input_ids)
        assert text.count(MEMORY_HEAD) == turns
        agent = [m for m in traj.messages if m["role"] == "assistant"]
        assert len(agent) == turns and all(m["context"].startswith(MEMORY_HEAD) for m in agent)
        for m in agent:
            assert m["context"].count("Rehearsal 1:") == 1 and m["context"].count("Rehearsal 2:") == 1
            assert m["context"].count("my assessment:") == 2 and "predicted:" in m["context"]
        # the memory tokens are CONTEXT: find each memory's first token and check its role
        head = tok.encode(MEMORY_HEAD, add_special_tokens=False)
        starts = [i for i in range(len(ep.input_ids)) if ep.input_ids[i:i + len(head)] == head]
        assert len(starts) == turns and all(ep.roles[i] == int(Role.CONTEXT) for i in starts)
        info = ep.metadata["policy"]
        assert [i["turn"] for i in info] == [0, 1] and all(i["rehearsal_tokens"] > 0 for i in info)


def test_rehearsal_tokens_counted_apart(tmp_path, tiny):
    """rehearsal_tokens per item = the private tokens the policy reported; gen_tokens = the sampled
    tokens of the committed turns only (here the model samples them after reading the memory)."""
    model, tok = tiny
    p = _policy(tiny, 2, form="memory")
    done, _ = _run(tiny, p, tmp_path / "r", n=2)
    base, _ = _run(tiny, ModelPolicy(), tmp_path / "b", n=2)
    for r, b in zip(done, base):
        assert r.error is None and r.rehearsal_tokens > 0 and b.rehearsal_tokens == 0
        assert 0 < r.gen_tokens <= 8 * r.steps           # committed: max_new_tokens per turn at most
    # budget 0 is exactly the base policy
    zero, _ = _run(tiny, _policy(tiny, 0), tmp_path / "z", n=2)
    assert [(r.score, r.steps, r.gen_tokens, r.rehearsal_tokens) for r in zero] == \
        [(b.score, b.steps, b.gen_tokens, b.rehearsal_tokens) for b in base]
    assert [r.extra["transcript"] for r in zero] == [b.extra["transcript"] for b in base]


@pytest.mark.parametrize("greedy,draft,expect_draft", [
    ("unknown", "valid", True),      # greedy calls a tool that does not exist: a draft wins
    ("valid", "unknown", False),     # drafts are worse: greedy kept
    ("valid", "valid", False),       # a tie: greedy kept
])
def test_select_commits_the_candidate_the_world_model_favours(tmp_path, tiny, greedy, draft, expect_draft):
    def script(kind):
        return lambda r: ((_gold_call(r) if kind == "valid" else format_tool_call("no_such_tool", {}))
                          if r.turn == 0 else "All done.")

    CountingSuite.executed = 0
    p = _policy(tiny, 2, form="select", base=ScriptedPolicy(script(greedy)), draft=ScriptedPolicy(script(draft)))
    done, _ = _run(tiny, p, tmp_path, n=2)
    for r in done:
        sel = r.extra["rehearsal_select"]
        assert sel["from_draft"] == (1 if expect_draft else 0)
        # what was committed reached the env only when it was a known tool
        assert r.real_calls == (1 if (expect_draft or greedy == "valid") else 0)
        assert r.malformed == (0 if (expect_draft or greedy == "valid") else 1)
    assert p.selected_drafts == (2 if expect_draft else 0)
    assert CountingSuite.executed == sum(r.real_calls for r in done)


def test_judge_and_error_detection():
    tools = {"get_balance"}
    ok = {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_balance", "arguments": {}}}]}
    unknown = {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "nope", "arguments": {}}}]}
    assert judge(ok, ['{"balance": 1}'], tools) == 0
    assert judge(ok, ['{"error": "not found"}'], tools) == -1
    assert judge(ok, ["Error: no such account"], tools) == -1
    assert judge(unknown, ['{"x": 1}'], tools) == -2
    assert judge(ok, ['{"balance": 1}'], tools, malformed=1) == -2
    assert judge({"role": "assistant", "content": "the answer"}, [], tools) == 0
    assert looks_like_error('{"error": {"code": "E_X"}}') and looks_like_error("error: bad id")
    assert not looks_like_error("all good") and not looks_like_error('{"balance": 3}')


def test_rehearsal_rejects_bad_settings(tiny):
    model, tok = tiny
    for kw, msg in (({"budget": -1}, "budget"), ({"mode": "random"}, "mode"), ({"form": "note"}, "form"),
                    ({"horizon": 0}, "horizon"), ({"temperature": -1.0}, "temperature")):
        args = {"budget": 1, **kw}
        with pytest.raises(ValueError, match=msg):
            RehearsalPolicy(model, tok, args.pop("budget"), **args)
