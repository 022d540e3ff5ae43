"""The separate-simulator baseline of benchmarks/bench_rollout.py (benchmarks/_simulator.py, on the
engine's simulator hook): a fresh simulator prompt per rehearsed call costs more prefill than inline
rehearsal, and the benchmark's own separate mode runs (tiny random Llama, gold-forced turns)."""
import sys
from pathlib import Path

import pytest

from fastrehearse.envs.builtin import BuiltinSuite
from fastrehearse.kernels.roles import Role
from fastrehearse.model import load_model
from fastrehearse.rollout import ChatTemplate, RolloutConfig, RolloutEngine
from _rollout_fixtures import CalcEnv, ScriptedBias, calc_tasks

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_rollout  # noqa: E402
from _simulator import SeparateSimulator  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def llama():
    model, tok = load_model("tiny-llama")
    return model, tok, ChatTemplate(tok)


def run(model, tok, tmpl, simulator=None):
    cfg = RolloutConfig(mode="rehearse", max_new_tokens=48, max_episode_tokens=700, max_turns=3)
    eng = RolloutEngine(model, tok, cfg, template=tmpl, logits_processor=ScriptedBias(tmpl),
                        simulator=simulator)
    return eng, eng.rollout(calc_tasks(3), CalcEnv, group_size=2, seed=2)


def test_separate_simulator_baseline_costs_more_prefill(llama):
    model, tok, tmpl = llama
    _, inline = run(model, tok, tmpl)
    sim = SeparateSimulator(tmpl)
    eng, sep = run(model, tok, tmpl, sim)
    assert sim.prompts > 0 and sim.prompts == sep.metrics["calls"]["rehearse"]
    assert sep.metrics["prefill_tokens"] > inline.metrics["prefill_tokens"]
    for ep in sep.episodes:
        assert len(ep.input_ids) == len(ep.roles) <= eng.config.max_episode_tokens
    assert any(Role.REHEARSE in ep.roles for ep in sep.episodes)


def test_bench_rollout_separate_mode_runs(llama):
    """The benchmark's run_mode, both modes on one builtin task: the same gold-forced episode, the
    separate one with one simulator prompt per rehearsed call and more prefill."""
    model, tok, tmpl = llama
    suite = BuiltinSuite(level="mixed", n_train=8, n_test=8)
    tasks = suite.tasks("train", limit=1)
    kw = dict(model=model, tok=tok, tmpl=tmpl, suite=suite, tasks=tasks, batch=1, group=1, seed=0)
    inline = bench_rollout.run_mode(rehearsal="inline", **kw)
    sep = bench_rollout.run_mode(rehearsal="separate", **kw)
    assert inline["simulator_prompts"] == 0
    assert sep["simulator_prompts"] == sep["rehearsed_calls"] > 0
    assert sep["prefill_tokens"] > inline["prefill_tokens"]
    with pytest.raises(ValueError, match="rehearsal must be one of"):
        bench_rollout.run_mode(rehearsal="simulator", **kw)
