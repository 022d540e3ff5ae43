"""Test-time rehearsal: private rehearsals run through the model's world model and never reach the
real environment (counted); the committed turn sees the rehearsal note."""
import json
import re

import pytest

from fastrehearse.envs.builtin import BuiltinSuite
from fastrehearse.eval.harness import HarnessConfig, run_items
from fastrehearse.eval.policies import GenConfig, ModelPolicy
from fastrehearse.eval.rehearsal import NOTE_HEAD, RehearsalPolicy
from fastrehearse.eval.results import ResultStore
from fastrehearse.model import load_model


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-llama")


class Scripted(ModelPolicy):
    """A real ModelPolicy (real template, parser, token accounting) whose decoder is scripted:
    assistant prompts get a call to the episode's first tool until two tool responses are in
    context, then a final answer; tool prompts get a JSON response. Records every prompt."""

    def __init__(self, model, tok):
        super().__init__(model, tok, "scripted", GenConfig(max_new_tokens=8, max_response_tokens=8))
        self.prompts = []

    def generate(self, prompts, max_new_tokens, temperature, markers=None, keys=None):
        out = []
        for p in prompts:
            text = self.tok.decode(p)
            self.prompts.append(text)
            if text.endswith("<tool_response>\n"):
                out.append((5, json.dumps({"balance": 12.5, "note": "rehearsed"})))
                continue
            tool = re.search(r'"name": "([a-z_]+)"', text).group(1)
            n_resp = text.count("</tool_response>")
            if n_resp < 2:
                out.append((7, f'<tool_call>\n{{"name": "{tool}", "arguments": {{}}}}\n</tool_call>'))
            else:
                out.append((3, "All done."))
        return out


class CountingSuite(BuiltinSuite):
    executed = 0

    def make_env(self):
        env = super().make_env()
        inner = env.execute

        def execute(call):
            CountingSuite.executed += 1
            return inner(call)

        env.execute = execute
        return env


@pytest.mark.parametrize("mode", ["parallel", "sequential"])
def test_rehearsal_never_executes_private_calls(tmp_path, tiny, mode):
    model, tok = tiny
    base = Scripted(model, tok)
    policy = RehearsalPolicy(base, budget=2, mode=mode, horizon=2)
    suite = CountingSuite()
    CountingSuite.executed = 0
    tasks = suite.tasks("test", 3)
    store = ResultStore(tmp_path, {"mode": mode})
    done = run_items([("test", t) for t in tasks], lambda c: suite.make_env(), policy, store,
                     HarnessConfig(batch_size=3, max_steps=5))
    assert len(done) == 3
    committed = sum(r.real_calls for r in done)
    # Each episode commits exactly two real calls (then answers); rehearsals made many more calls.
    assert committed == 6
    assert CountingSuite.executed == committed
    rehearsed_calls = sum(p.endswith("<tool_response>\n") for p in base.prompts)
    assert rehearsed_calls > committed
    assert all(r.rehearsal_tokens > 0 and r.gen_tokens > 0 for r in done)
    # committed turns saw the note; sequential drafts saw the earlier drafts
    notes = [p for p in base.prompts if NOTE_HEAD in p]
    assert notes
    if mode == "sequential":
        assert any("Draft the next step again" in p for p in base.prompts)


def test_rehearsal_budget_zero_is_the_base_policy(tmp_path, tiny):
    model, tok = tiny
    base = Scripted(model, tok)
    policy = RehearsalPolicy(base, budget=0)
    suite = BuiltinSuite()
    store = ResultStore(tmp_path, {})
    done = run_items([("test", t) for t in suite.tasks("test", 2)], lambda c: suite.make_env(), policy,
                     store, HarnessConfig(batch_size=2, max_steps=5))
    assert all(r.rehearsal_tokens == 0 for r in done)
    assert not any(NOTE_HEAD in p for p in base.prompts)


def test_rehearsal_end_to_end_tiny_model(tmp_path, tiny):
    """Unscripted: the random tiny model itself drafts, rehearses, commits (budget 2)."""
    model, tok = tiny
    base = ModelPolicy(model, tok, "tiny", GenConfig(max_new_tokens=10, max_response_tokens=6))
    suite = CountingSuite()
    CountingSuite.executed = 0
    store = ResultStore(tmp_path, {})
    done = run_items([("test", t) for t in suite.tasks("test", 2)], lambda c: suite.make_env(),
                     RehearsalPolicy(base, 2, "parallel"), store, HarnessConfig(batch_size=2, max_steps=2))
    assert len(done) == 2 and all(r.error is None for r in done)
    assert CountingSuite.executed == sum(r.real_calls for r in done)
    assert all(r.rehearsal_tokens >= 2 * 1 for r in done)


def test_rehearsal_rejects_bad_settings(tiny):
    model, tok = tiny
    base = ModelPolicy(model, tok, "tiny")
    with pytest.raises(ValueError, match="budget"):
        RehearsalPolicy(base, -1)
    with pytest.raises(ValueError, match="mode"):
        RehearsalPolicy(base, 1, "beam")


class TwoFaced(ModelPolicy):
    """Scripted decoder whose greedy turns (temperature 0) and sampled drafts (temperature > 0) differ:
    `greedy` / `draft` give the call text for each ("{tool}" is the episode's first tool). Tool
    prompts get `response`. Records (temperature, prompt text) of every assistant-turn decode."""

    def __init__(self, model, tok, greedy, draft, response='{"ok": true}'):
        super().__init__(model, tok, "two-faced", GenConfig(max_new_tokens=8, max_response_tokens=8))
        self.greedy, self.draft, self.response = greedy, draft, response
        self.turns = []

    def generate(self, prompts, max_new_tokens, temperature, markers=None, keys=None):
        out = []
        for p in prompts:
            text = self.tok.decode(p)
            if text.endswith("<tool_response>\n"):
                out.append((4, self.response))
                continue
            self.turns.append((temperature, text))
            if "</tool_response>" in text:
                out.append((2, "Done."))        # after one real response: answer
                continue
            tool = re.search(r'"name": "([a-z_]+)"', text).group(1)
            out.append((6, (self.greedy if temperature == 0 else self.draft).replace("{tool}", tool)))
        return out


GOOD = '<tool_call>\n{"name": "{tool}", "arguments": {}}\n</tool_call>'


@pytest.mark.parametrize("greedy,draft,expect_draft", [
    ('<tool_call>\n{"name": "no_such_tool", "arguments": {}}\n</tool_call>', GOOD, True),   # unknown tool
    ('<tool_call>\n{"name": "{tool}", "arguments": {\n</tool_call>', GOOD, True),          # malformed
    (GOOD, '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>', False),         # greedy fine
    (GOOD, GOOD, False),                                                                   # tie: greedy
])
def test_rehearsal_select_commits_the_candidate_the_world_model_favours(tmp_path, tiny, greedy, draft,
                                                                         expect_draft):
    model, tok = tiny
    base = TwoFaced(model, tok, greedy, draft)
    policy = RehearsalPolicy(base, budget=2, commit="select")
    suite = CountingSuite(level="easy", tools="task")
    CountingSuite.executed = 0
    tasks = suite.tasks("test", 2)
    store = ResultStore(tmp_path, {})
    done = run_items([("test", t) for t in tasks], lambda c: suite.make_env(), policy, store,
                     HarnessConfig(batch_size=2, max_steps=3))
    assert len(done) == 2 and all(r.error is None for r in done)
    # one committed turn with a call per episode, then the answer: exactly one real call each
    assert CountingSuite.executed == sum(r.real_calls for r in done)
    assert policy.selected_drafts == (2 if expect_draft else 0)
    # no note in context in select mode: every assistant-turn prompt is note-free
    assert not any(NOTE_HEAD in t for _, t in base.turns)
    # the committed turn was the greedy decode (temperature 0) and 2 drafts were sampled per turn
    first_turns = [t for t in base.turns if "</tool_response>" not in t[1]]
    assert sum(temp == 0 for temp, _ in first_turns) == 2 and sum(temp > 0 for temp, _ in first_turns) == 4
    if expect_draft:   # the drafted good call went to the environment: the builtin tool answered
        assert all(r.real_calls == 1 for r in done)


def test_rehearsal_select_avoids_a_predicted_error(tmp_path, tiny):
    """Greedy and drafts are all well-formed; the world model predicts an error for every call, so
    all candidates tie at -1 and the greedy turn is kept (rehearsal never prefers a draft blindly)."""
    model, tok = tiny
    base = TwoFaced(model, tok, GOOD, GOOD, response='{"error": "order not found"}')
    policy = RehearsalPolicy(base, budget=2, commit="select")
    suite = BuiltinSuite(level="easy", tools="task")
    store = ResultStore(tmp_path, {})
    run_items([("test", t) for t in suite.tasks("test", 2)], lambda c: suite.make_env(),
              policy, store, HarnessConfig(batch_size=2, max_steps=3))
    assert policy.selected_drafts == 0


def test_judge_and_error_detection():
    from fastrehearse.eval.rehearsal import judge, looks_like_error
    assert looks_like_error('{"error": "no such order"}') and looks_like_error("Error: bad arguments")
    assert looks_like_error('{"error_message": "x"}') and looks_like_error("  error during execution")
    assert not looks_like_error('{"status": "shipped"}') and not looks_like_error("The errors page")
    assert not looks_like_error("[1, 2]") and not looks_like_error("")
    call = {"type": "function", "function": {"name": "get_order", "arguments": {}}}
    names = {"get_order"}
    assert judge({"tool_calls": [call]}, ['{"status": "ok"}'], names) == 0
    assert judge({"tool_calls": [call]}, ['{"error": "x"}'], names) == -1
    assert judge({"tool_calls": [call, {"malformed": "bad json", "kind": "json"}]}, [], names) == -2
    assert judge({"tool_calls": [{"function": {"name": "nope", "arguments": {}}}]}, ["{}"], names) == -2
    assert judge({"content": "final answer"}, [], names) == 0


def test_rehearsal_rejects_bad_commit(tiny):
    model, tok = tiny
    with pytest.raises(ValueError, match="commit"):
        RehearsalPolicy(ModelPolicy(model, tok, "tiny"), 1, commit="vote")
