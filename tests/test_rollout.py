"""Rollout engine: role tags, KV-cache decode == re-forward, determinism, modes, malformed output.

Tiny random models (fastrehearse.model.load_model("tiny-*"), SmolLM2 tokenizer) emit tool calls only
rarely, so most tests bias them towards a scripted call / response / answer with a logits processor
(tests/_rollout_fixtures.py.ScriptedBias, ~1-2% deviation per token): episodes mix well-formed
calls with deviations that become malformed calls or truncated turns.
"""
import json
import math

import pytest
import torch

from fastrehearse.kernels.roles import Role
from fastrehearse.model import load_model
from fastrehearse.rollout import Prompt, RolloutConfig, RolloutEngine
from fastrehearse.rollout.engine.simulator import SimulatedResponse
from fastrehearse.rollout.text.template import ChatTemplate
from _rollout_fixtures import (CalcEnv, ScriptedBias, calc_tasks, llama3_style_tokenizer,
                                          tiny_llama)

STOPS = {"final_answer", "max_new_tokens", "max_turns", "max_episode_tokens", "malformed"}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def llama():
    model, tok = load_model("tiny-llama")
    return model, tok, ChatTemplate(tok)


@pytest.fixture(scope="module")
def llama3_style():
    tok = llama3_style_tokenizer()
    return tiny_llama(len(tok), seed=1), tok, ChatTemplate(tok)


class CountingEnv(CalcEnv):
    instances = []

    def __init__(self):
        super().__init__()
        CountingEnv.instances.append(self)


def run(model, tok, tmpl, *, seed=0, n_tasks=3, group=2, bias=15.0, parallel=False, **cfg):
    cfg = {"max_new_tokens": 48, "max_episode_tokens": 700, "max_turns": 3, **cfg}
    eng = RolloutEngine(model, tok, RolloutConfig(**cfg), template=tmpl,
                        logits_processor=ScriptedBias(tmpl, bias=bias, parallel=parallel))
    return eng, eng.rollout(calc_tasks(n_tasks), CountingEnv, group_size=group, seed=seed)


def runs_of(roles):
    """Maximal runs of equal roles: [(role, start, end)]."""
    out, s = [], 0
    for i in range(1, len(roles) + 1):
        if i == len(roles) or roles[i] != roles[s]:
            out.append((roles[s], s, i))
            s = i
    return out


def _is_error_run(text: str, texts: dict) -> bool:
    """A CONTEXT run holding malformed-call error texts (toolcall.malformed_response) between
    pieces of the template's own scaffolding."""
    pieces, n_err = [], 0
    while (i := text.find('{"error"')) >= 0:
        obj, end = json.JSONDecoder().raw_decode(text[i:])
        if set(obj) != {"error", "message"}:
            return False
        pieces.append(text[:i])
        text, n_err = text[i + end:], n_err + 1
    pieces.append(text)
    return n_err > 0 and all(p == "" or any(p in t for t in texts.values()) for p in pieces)


def check_episode(ep, tmpl, cfg):
    tok = tmpl.tokenizer
    n = len(ep.input_ids)
    assert n == len(ep.roles) == len(ep.rollout_logprobs) <= cfg.max_episode_tokens
    p = ep.metadata["prompt_tokens"]
    assert all(r == Role.CONTEXT for r in ep.roles[:p])
    # log-probs exactly on sampled tokens
    for r, lp in zip(ep.roles, ep.rollout_logprobs):
        assert (r in (Role.ACT, Role.REHEARSE)) == (not math.isnan(lp))
        assert math.isnan(lp) or lp <= 0
    texts = tmpl.scaffolding.texts
    tool_open_tails = {texts["assistant_to_tool"][-8:], texts["tool_to_tool"][-8:]}
    for role, s, e in runs_of(ep.roles):
        if s < p:
            continue
        before = tok.decode(ep.input_ids[max(0, s - 12):s])
        if role == Role.REHEARSE:  # only inside a tool turn: right after the tool-open scaffolding
            assert any(before.endswith(t) for t in tool_open_tails), (before, tok.decode(ep.input_ids[s:e]))
        elif role == Role.ACT:  # right after the assistant-open scaffolding
            assert before.endswith(texts["generation_prompt"][-8:]) or \
                before.endswith(texts["tool_to_assistant"][-8:]), before
        elif role == Role.CONTEXT:  # inserted scaffolding is (a tail of) the template's own text,
            # or scaffolding around a malformed call's forced error text (the engine's, not an env's)
            text = tok.decode(ep.input_ids[s:e])
            assert any(text in t for t in texts.values()) or _is_error_run(text, texts), text
        elif role == Role.OBSERVED:
            assert any(before.endswith(t) for t in tool_open_tails), before
    assert ep.metadata["stop_reason"] in STOPS
    modes = [c["mode"] for c in ep.metadata["calls"]]
    if Role.OBSERVED in ep.roles:  # only executed calls' responses; an error text is CONTEXT
        assert "real" in modes
    if Role.REHEARSE in ep.roles:
        assert "rehearse" in modes


@pytest.mark.parametrize("mode,parallel", [("rehearse", False), ("hybrid", False), ("hybrid", True),
                                           ("rehearse", True)])
def test_role_tags_many_seeds(llama, mode, parallel):
    model, tok, tmpl = llama
    totals = {"rehearse": 0, "real": 0, "error": 0}
    parallel_turns = 0
    for seed in range(2):
        CountingEnv.instances = []
        eng, res = run(model, tok, tmpl, seed=seed, mode=mode, hybrid_p=0.5, parallel=parallel,
                       parallel_tool_calls=parallel or seed % 2 == 0, max_new_tokens=80 if parallel else 48)
        assert len(res.episodes) == 6
        for ep in res.episodes:
            check_episode(ep, tmpl, eng.config)
            for c in ep.metadata["calls"]:
                totals[c["mode"]] += 1
            tool_runs = [r for r in runs_of(ep.roles) if r[0] in (Role.REHEARSE, Role.OBSERVED)]
            call_turns = ep.metadata["turns"] - (ep.metadata["stop_reason"] == "final_answer")
            parallel_turns += len(tool_runs) > call_turns  # two responses in one tool turn
        m = res.metrics
        assert m["decode_tokens"] == sum(m["role_tokens"].get(r, 0) for r in ("ACT", "REHEARSE"))
        assert m["prefill_tokens"] > 0 and m["tokens_per_s"] > 0
        if mode == "rehearse":  # rehearsal never touches the real environment
            assert all(not e.calls for e in CountingEnv.instances)
    assert totals["rehearse"] > 0
    if parallel:
        assert parallel_turns > 0
    if mode == "hybrid":
        assert totals["real"] > 0


def test_llama3_style_template_rollout(llama3_style):
    model, tok, tmpl = llama3_style
    for seed in range(3):
        eng, res = run(model, tok, tmpl, seed=seed, mode="hybrid", hybrid_p=0.5, measure_fidelity=True)
        for ep in res.episodes:
            check_episode(ep, tmpl, eng.config)
    assert res.metrics["calls"].get("rehearse", 0) + res.metrics["calls"].get("real", 0) > 0


def test_deterministic_for_a_seed(llama):
    model, tok, tmpl = llama
    kw = dict(mode="hybrid", temperature=0.8, top_p=0.9, bias=9.0, n_tasks=2)
    a = run(model, tok, tmpl, seed=3, **kw)[1].episodes
    b = run(model, tok, tmpl, seed=3, **kw)[1].episodes
    c = run(model, tok, tmpl, seed=4, **kw)[1].episodes
    assert [e.input_ids for e in a] == [e.input_ids for e in b]
    assert [e.rollout_logprobs for e in a] == [e.rollout_logprobs for e in b] or \
        all(x == y or (math.isnan(x) and math.isnan(y)) for ea, eb in zip(a, b)
            for x, y in zip(ea.rollout_logprobs, eb.rollout_logprobs))
    assert [e.input_ids for e in a] != [e.input_ids for e in c]


def reforward_logprobs(model, ep, processor, temperature):
    with torch.no_grad():
        logits = model(torch.tensor([ep.input_ids])).logits[0].float()
    out = []
    for t in range(1, len(ep.input_ids)):
        if math.isnan(ep.rollout_logprobs[t]):
            continue
        z = processor([ep.input_ids[:t]], [ep.roles[:t]], [Role(ep.roles[t])], logits[t - 1:t])[0]
        z = torch.log_softmax(z / temperature, -1)
        out.append((float(z[ep.input_ids[t]]), ep.rollout_logprobs[t]))
    return out


@pytest.mark.parametrize("spec", ["tiny-llama", "tiny-qwen3"])
def test_logprobs_equal_reforward(spec):
    """KV-cache decode with left padding, forced tokens fed in chunks (cache holes) and dropped rows
    gives the same log-probs as one plain forward of the finished episode."""
    model, tok = load_model(spec)
    tmpl = ChatTemplate(tok)
    checked = 0
    configs = [("hybrid", 0.7, 64), ("rehearse", 1.3, 1), ("real", 1.0, 8)]
    if spec != "tiny-llama":
        configs = configs[:1]
    for seed, (mode, temp, chunk) in enumerate(configs):
        eng, res = run(model, tok, tmpl, seed=seed, mode=mode, temperature=temp, top_p=0.95,
                       max_chunk=chunk, n_tasks=2, group=2)
        for ep in res.episodes:
            for ref, got in reforward_logprobs(model, ep, eng.logits_processor, temp):
                assert abs(ref - got) < 1e-4, (ref, got)
                checked += 1
    assert checked > (150 if spec == "tiny-llama" else 40)


def test_real_mode_inserts_observed_env_text(llama):
    model, tok, tmpl = llama
    _, res = run(model, tok, tmpl, seed=0, mode="real", n_tasks=2, group=2)
    found = 0
    for ep, traj in zip(res.episodes, res.trajectories):
        tool_msgs = [m for m in traj.messages if m["role"] == "tool"]
        obs = [r for r in runs_of(ep.roles) if r[0] == Role.OBSERVED]
        assert len(obs) == len(tool_msgs)
        for (_, s, e), m in zip(obs, tool_msgs):
            assert tok.decode(ep.input_ids[s:e]) == m["content"]
            found += 1
        assert len(traj.real_calls) == sum(c["mode"] == "real" for c in ep.metadata["calls"])
    assert found > 0


def test_fidelity_measured_in_both_mode(llama):
    model, tok, tmpl = llama
    _, res = run(model, tok, tmpl, seed=1, mode="rehearse", measure_fidelity=True)
    f = res.metrics["fidelity"]
    assert f["n"] > 0 and "add" in f["per_tool"]
    # the scripted rehearsal writes {"result": 5} for add(2, 3), which is what the env returns
    assert f["per_tool"]["add"]["exact"] > 0.5


def test_malformed_calls_are_outcomes(llama):
    model, tok, tmpl = llama

    class BadCall(ScriptedBias):
        def __init__(self, t):
            super().__init__(t)
            self.call_script = t.encode('<tool_call>\n{"name": "mul", "arguments": {}}\n</tool_call>'
                                        + t.assistant_end_markers[0])

    for outcome in ("error_response", "end_episode"):
        eng = RolloutEngine(model, tok, RolloutConfig(mode="real", on_malformed=outcome, max_new_tokens=40,
                                                      max_episode_tokens=600, max_turns=2),
                            template=tmpl, logits_processor=BadCall(tmpl))
        tasks = calc_tasks(2)
        res = eng.rollout(tasks, CalcEnv, group_size=2, seed=0)
        assert res.metrics["malformed"].get("unknown_tool", 0) > 0
        for ep, traj in zip(res.episodes, res.trajectories):
            check_episode(ep, tmpl, eng.config)
            # the engine reports the score and the malformed calls; the training reward of a
            # malformed episode is the trainer's (tests/test_algo_rewards.py)
            assert ep.reward == CalcEnv().score(tasks[ep.metadata["group"]], traj)
            if ep.metadata["malformed"]:
                if outcome == "end_episode":
                    assert ep.metadata["stop_reason"] == "malformed" and Role.OBSERVED not in ep.roles
                else:  # the error text is forced, tagged CONTEXT: no environment wrote it
                    assert "unknown_tool" in tok.decode([t for t, r in zip(ep.input_ids, ep.roles)
                                                         if r == Role.CONTEXT][ep.metadata["prompt_tokens"]:])
                    assert Role.OBSERVED not in ep.roles


def test_private_rehearsal_from_prefix(llama):
    """Test-time rehearsal hook: rows without an environment only rehearse (nothing executes)."""
    model, tok, tmpl = llama
    env = CountingEnv()
    reset = env.reset(calc_tasks(1)[0])
    pr = tmpl.render_prompt(reset.messages, reset.tools)
    eng = RolloutEngine(model, tok, RolloutConfig(mode="real", max_new_tokens=40, max_turns=1),
                        template=tmpl, logits_processor=ScriptedBias(tmpl))
    res = eng.generate([Prompt(pr.input_ids, pr.roles, reset.tools, seed=s) for s in range(4)])
    assert not env.calls
    assert all(c["mode"] == "rehearse" for ep in res.episodes for c in ep.metadata["calls"])
    assert res.metrics["calls"].get("rehearse", 0) > 0


class EchoSimulator:
    """A simulator that decodes nothing: every response is the call's name as JSON."""

    def __init__(self, tmpl):
        self.tmpl, self.calls = tmpl, []

    def respond(self, calls, generate):
        self.calls += calls
        out = []
        for c in calls:
            text = json.dumps({"called": json.loads(c.call)["name"]})
            out.append(SimulatedResponse(self.tmpl.encode(text), [math.nan] * len(self.tmpl.encode(text)),
                                         f" {text}\n"))
        return out


def test_simulator_hook_writes_the_rehearsed_responses(llama):
    """RolloutEngine(simulator=...): each rehearsed call goes to the simulator (the conversation so
    far, the tools, the call's text) and its tokens are copied into the episode as REHEARSE; the
    trajectory records its text, stripped."""
    model, tok, tmpl = llama
    sim = EchoSimulator(tmpl)
    eng = RolloutEngine(model, tok, RolloutConfig(mode="rehearse", max_new_tokens=48, max_episode_tokens=700,
                                                  max_turns=3),
                        template=tmpl, logits_processor=ScriptedBias(tmpl), simulator=sim)
    res = eng.rollout(calc_tasks(2), CountingEnv, group_size=2, seed=2)
    assert len(sim.calls) == res.metrics["calls"]["rehearse"] > 0
    assert all(json.loads(c.call)["name"] == "add" for c in sim.calls)
    assert all(c.tools and c.messages[-1]["role"] == "assistant" for c in sim.calls)
    want = tmpl.encode('{"called": "add"}')
    for ep, traj in zip(res.episodes, res.trajectories):
        rehearsed = [m["content"] for m in traj.messages if m["role"] == "tool"]
        assert all(t == '{"called": "add"}' for t in rehearsed)
        reh = [t for t, r in zip(ep.input_ids, ep.roles) if r == Role.REHEARSE]
        assert reh == want * len(rehearsed)


def test_simulator_must_answer_every_call(llama):
    model, tok, tmpl = llama

    class Silent:
        def respond(self, calls, generate):
            return []

    eng = RolloutEngine(model, tok, RolloutConfig(mode="rehearse", max_new_tokens=48, max_episode_tokens=700),
                        template=tmpl, logits_processor=ScriptedBias(tmpl, bias=1e4), simulator=Silent())
    with pytest.raises(ValueError, match=r"simulator.respond returned 0 responses for 2 calls"):
        eng.rollout(calc_tasks(1), CountingEnv, group_size=2, seed=0)


def test_episodes_pack_round_trip(llama):
    from fastrehearse.packing import pack
    model, tok, tmpl = llama
    _, res = run(model, tok, tmpl, seed=5, mode="hybrid")
    eps = res.episodes
    batches = pack(eps, max_tokens=1400)
    seen = set()
    for b in batches:
        cu = b.cu_seqlens.tolist()
        for j, ei in enumerate(b.episode_indices):
            ep = eps[ei]
            s, e = cu[j], cu[j + 1]
            assert b.input_ids[0, s:e].tolist() == ep.input_ids
            assert b.targets[s:e - 1].tolist() == ep.input_ids[1:]
            assert b.roles[s:e - 1].tolist() == ep.roles[1:] and b.roles[e - 1] == Role.CONTEXT
            old = b.old_logp[s:e - 1].tolist()
            assert all((math.isnan(x) and math.isnan(y)) or abs(x - y) < 1e-6
                       for x, y in zip(old, ep.rollout_logprobs[1:]))
            seen.add(ei)
    assert seen == set(range(len(eps)))


def test_builtin_suite_rollout_no_crash(llama):
    from fastrehearse.envs.builtin import BuiltinSuite
    model, tok, tmpl = llama
    suite = BuiltinSuite(level="easy", n_train=4, n_test=4)
    eng = RolloutEngine(model, tok, RolloutConfig(mode="hybrid", max_new_tokens=24, max_episode_tokens=1500,
                                                  measure_fidelity=True), template=tmpl)
    res = eng.rollout(suite.tasks("train", limit=2), suite, group_size=2, seed=0)
    for ep in res.episodes:
        check_episode(ep, tmpl, eng.config)
        assert 0.0 <= ep.reward <= 1.0


def test_limits_and_bad_config(llama):
    model, tok, tmpl = llama
    eng, res = run(model, tok, tmpl, seed=0, bias=0.0, max_new_tokens=400, max_episode_tokens=260)
    for ep in res.episodes:
        assert len(ep.input_ids) <= 260
    for bad in (dict(mode="dream"), dict(hybrid_p=1.5), dict(top_p=0.0), dict(max_turns=0),
                dict(on_malformed="ignore"), dict(temperature=-1.0)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            RolloutEngine(model, tok, RolloutConfig(**bad), template=tmpl)
    with pytest.raises(ValueError, match="group_size"):
        eng.rollout(calc_tasks(1), CalcEnv, group_size=0)
