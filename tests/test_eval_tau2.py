"""tau2-bench telecom (solo mode) through the eval harness, graded by tau2's own evaluator."""
import json

import pytest

pytest.importorskip("tau2")

from fastrehearse.eval import cli  # noqa: E402


def _res(out):
    return json.loads((out / "results.json").read_text())


def test_tau2_gold_scores_one_and_no_calls_scores_zero(tmp_path):
    out = tmp_path / "gold"
    assert cli.main(["--suite", "tau2", "--policy", "gold", "--limit", "3", "--out", str(out), "--quiet"]) == 0
    res = _res(out)
    assert res["categories"]["telecom"]["n"] == 3 and res["categories"]["telecom"]["accuracy"] == 1.0

    # deliberately wrong: the gold calls of *another* task (valid calls, wrong fixes) score 0
    from fastrehearse.envs import get_suite
    from fastrehearse.eval.harness import HarnessConfig, run_items
    from fastrehearse.eval.policies import GoldPolicy
    from fastrehearse.eval.results import ResultStore

    suite = get_suite("tau2")
    tasks = suite.tasks("telecom", 3)

    class Shifted(GoldPolicy):
        def act(self, states):
            for st in states:
                if "swapped" not in st.scratch:
                    i = [t.id for t in tasks].index(st.task.id)
                    st.scratch["swapped"] = tasks[(i + 1) % len(tasks)].gold
                st.task = type(st.task)(st.task.id, st.task.split, st.task.payload, st.scratch["swapped"])
            return super().act(states)

    class Silent:
        name = "silent"

        def act(self, states):
            return [{"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "done", "arguments": {}}}]} for _ in states]

    for pol in (Shifted(), Silent()):
        done = run_items([("telecom", t) for t in tasks], lambda c: suite.make_env(), pol,
                         ResultStore(tmp_path / type(pol).__name__, {}), HarnessConfig(batch_size=3))
        assert [r.score for r in done] == [0.0] * 3, pol.name


def test_tau2_tiny_model_two_tasks(tmp_path):
    out = tmp_path / "tiny"
    assert cli.main(["--suite", "tau2", "--policy", "tiny-llama", "--limit", "2", "--max-steps", "2",
                     "--max-new-tokens", "16", "--out", str(out), "--quiet"]) == 0
    res = _res(out)
    c = res["categories"]["telecom"]
    assert c["n"] == 2 and 0.0 <= c["accuracy"] <= 1.0 and c["errors"] == 0
    assert c["mean_gen_tokens"] > 0 and res["overall"] == c["accuracy"]
