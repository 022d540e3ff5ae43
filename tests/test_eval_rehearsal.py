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
