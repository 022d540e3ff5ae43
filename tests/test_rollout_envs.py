"""The engine end to end on the builtin suite driven through gold trajectories, fidelity scoring and
the sampler."""
import math

import pytest
import torch

from fastrehearse.envs.builtin import BuiltinSuite
from fastrehearse.kernels.roles import Role
from fastrehearse.model import load_model
from fastrehearse.rollout import RolloutConfig, RolloutEngine
from fastrehearse.rollout.backends.sampling import sample
from fastrehearse.rollout.engine.fidelity import aggregate, json_fields, score_pair
from fastrehearse.rollout.text.template import ChatTemplate, assistant_text
from _rollout_fixtures import ScriptedTurns


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def llama():
    model, tok = load_model("tiny-llama")
    return model, tok, ChatTemplate(tok)



@pytest.mark.parametrize("mode", ["real", "rehearse", "hybrid"])
def test_gold_trajectories_score_one_through_the_engine(llama, mode):
    """Forcing each task's gold turns (and, when rehearsing, the gold tool responses) through the
    engine must give reward 1.0: template, stops, parser, env execution, trajectory and scoring
    agree end to end. Rehearsed gold responses match the real ones: fidelity exact = 1."""
    model, tok, tmpl = llama
    suite = BuiltinSuite(level="mixed", n_train=6, n_test=6)
    tasks = suite.tasks("train", limit=2)
    fid = []
    for task in tasks:
        acts = [assistant_text(m) for m in task.gold if m["role"] == "assistant"]
        tools = [m["content"] for m in task.gold if m["role"] == "tool"]
        eng = RolloutEngine(model, tok, RolloutConfig(mode=mode, hybrid_p=0.5, measure_fidelity=True,
                                                      max_new_tokens=160, max_episode_tokens=4096,
                                                      max_turns=8),
                            template=tmpl, logits_processor=ScriptedTurns(tmpl, acts, tools))
        res = eng.rollout([task], suite, group_size=2, seed=1)
        for ep in res.episodes:
            assert ep.metadata["stop_reason"] == "final_answer", ep.metadata
            assert ep.reward == 1.0, (task.id, ep.metadata)
            assert not ep.metadata["malformed"]
            n_calls = sum(len(m.get("tool_calls") or []) for m in task.gold if m["role"] == "assistant")
            assert len(ep.metadata["calls"]) == n_calls
            if mode == "real":
                assert Role.REHEARSE not in ep.roles
            if mode == "rehearse":
                assert Role.OBSERVED not in ep.roles
        fid.append(res.metrics["fidelity"])
    if mode != "real":
        assert sum(f["n"] for f in fid) > 0
        assert all(f["exact"] == 1.0 for f in fid if f["n"])


def test_fidelity_scores():
    assert score_pair("t", '{"a": 1, "b": [1, 2]}', '{"b": [1, 2], "a": 1}').exact == 1.0
    s = score_pair("t", '{"a": 1, "b": 3}', '{"a": 1, "b": 2, "c": 5}')
    # common {a}; precision 1/2, recall 1/3 -> F1 = 0.4
    assert s.exact == 0.0 and abs(s.field_f1 - 0.4) < 1e-12
    assert score_pair("t", "not json", '{"a": 1}').field_f1 == 0.0
    assert score_pair("t", " ok ", "ok").exact == 1.0 and score_pair("t", "ok", "no").field_f1 == 0.0
    assert json_fields({"a": {"b": [1, {"c": None}]}, "d": {}}) == {
        ("$.a.b[0]", "1"): 1, ("$.a.b[1].c", "null"): 1, ("$.d", "{}"): 1}
    agg = aggregate([score_pair("x", "1", "1"), score_pair("x", "1", "2"), score_pair("y", "{}", "{}")])
    assert agg["n"] == 3 and abs(agg["exact"] - 2 / 3) < 1e-12
    assert agg["per_tool"]["x"] == {"n": 2, "exact": 0.5, "field_f1": 0.5}
    assert aggregate([])["exact"] is None


def test_sampler_distribution_and_logprobs():
    torch.manual_seed(0)
    logits = torch.randn(3, 11) * 2
    n = 20000
    g = torch.Generator().manual_seed(0)
    for temp, top_p in [(1.0, 1.0), (0.7, 0.8)]:
        toks, _ = sample(logits.repeat(n, 1), temp, top_p, torch.rand(3 * n, generator=g))
        counts = torch.zeros(3, 11).index_put_((torch.arange(3).repeat(n), toks), torch.ones(3 * n),
                                                accumulate=True)
        ref = torch.softmax(logits.double() / temp, -1)
        if top_p < 1:
            sp, si = ref.sort(-1, descending=True)
            keep = (sp.cumsum(-1) - sp) < top_p
            mask = torch.zeros_like(ref, dtype=torch.bool).scatter(1, si, keep)
            ref = torch.where(mask, ref, 0.0)
            ref = ref / ref.sum(-1, keepdim=True)
        emp = counts / counts.sum(-1, keepdim=True)
        assert (emp - ref).abs().max() < 0.02, (emp - ref).abs().max()
        assert (counts[ref == 0] == 0).all()  # nothing outside the nucleus
    tok, lp = sample(logits, 0.5, 1.0, torch.full((3,), 0.3))
    assert torch.allclose(lp, torch.log_softmax(logits / 0.5, -1).gather(1, tok[:, None]).squeeze(1))
    tok, lp = sample(logits, 0.0, 1.0, torch.zeros(3))
    assert (tok == logits.argmax(-1)).all()
    for bad, kw in [("temperature", dict(temperature=-1.0, top_p=1.0)), ("top_p", dict(temperature=1.0, top_p=0.0))]:
        with pytest.raises(ValueError, match=bad):
            sample(logits, uniforms=torch.zeros(3), **kw)


@pytest.mark.slow
def test_real_smollm2_rollout_logprobs_and_gold():
    """The real SmolLM2-135M: free sampling in hybrid mode (role tags consistent, log-probs equal a
    re-forward) and one gold-forced rehearse episode scoring 1.0."""
    model, tok = load_model("smollm2")
    tmpl = ChatTemplate(tok)
    suite = BuiltinSuite(level="easy", n_train=4, n_test=4)
    tasks = suite.tasks("train", limit=2)
    eng = RolloutEngine(model, tok, RolloutConfig(mode="hybrid", temperature=0.9, max_new_tokens=32,
                                                  max_episode_tokens=2048), template=tmpl)
    res = eng.rollout(tasks[1:], suite, group_size=1, seed=0)
    for ep in res.episodes:
        with torch.no_grad():
            logits = model(torch.tensor([ep.input_ids])).logits[0].float()
        ref = torch.log_softmax(logits / 0.9, -1)
        for t in range(1, len(ep.input_ids)):
            lp = ep.rollout_logprobs[t]
            assert (ep.roles[t] in (Role.ACT, Role.REHEARSE)) == (not math.isnan(lp))
            if not math.isnan(lp):
                assert abs(float(ref[t - 1, ep.input_ids[t]]) - lp) < 1e-4
    task = tasks[0]
    acts = [assistant_text(m) for m in task.gold if m["role"] == "assistant"]
    tools = [m["content"] for m in task.gold if m["role"] == "tool"]
    eng = RolloutEngine(model, tok, RolloutConfig(mode="rehearse", max_new_tokens=120), template=tmpl,
                        logits_processor=ScriptedTurns(tmpl, acts, tools))
    ep = eng.rollout([task], suite, seed=0).episodes[0]
    assert ep.reward == 1.0 and ep.metadata["stop_reason"] == "final_answer"
