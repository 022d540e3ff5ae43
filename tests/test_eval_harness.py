"""Eval harness: gold replay, wrong outputs, resumability, the CLI end to end with a tiny model."""
import json

import pytest

from fastrehearse.envs.base import ToolCall
from fastrehearse.envs.builtin import BuiltinSuite
from fastrehearse.eval import cli
from fastrehearse.eval.harness import HarnessConfig, run_items
from fastrehearse.eval.policies import GoldPolicy
from fastrehearse.eval.results import ResultStore


def _run(policy, tasks, out, cfg=None, config=None):
    suite = BuiltinSuite()
    store = ResultStore(out, config or {"policy": getattr(policy, "name", "x")})
    done = run_items([("test", t) for t in tasks], lambda c: suite.make_env(), policy, store,
                     cfg or HarnessConfig(batch_size=4))
    return store, done


def test_gold_builtin_scores_one(tmp_path):
    tasks = BuiltinSuite(level="all").tasks("test", 24)
    store, done = _run(GoldPolicy(), tasks, tmp_path)
    assert len(done) == 24
    assert all(r.score == 1.0 and r.error is None for r in done), [(r.id, r.score, r.error) for r in done]
    # every gold call went through env.execute
    assert sum(r.real_calls for r in done) == sum(
        len(m.get("tool_calls") or []) for t in tasks for m in t.gold if m["role"] == "assistant")


class WrongArgs(GoldPolicy):
    """Gold with every id-like string argument corrupted: calls hit the wrong (missing) records."""
    name = "wrong"

    def act(self, states):
        out = super().act(states)
        for msg in out:
            for tc in msg.get("tool_calls") or []:
                args = tc["function"]["arguments"]
                for k, v in list(args.items()):
                    if isinstance(v, str):
                        args[k] = v + "X"
                    elif isinstance(v, (int, float)) and not isinstance(v, bool):
                        args[k] = v + 7
            if not msg.get("tool_calls"):
                msg["content"] = "I could not find it."
        return out


class NoCalls:
    name = "silent"

    def act(self, states):
        return [{"role": "assistant", "content": "42"} for _ in states]


@pytest.mark.parametrize("policy", [WrongArgs(), NoCalls()])
def test_wrong_outputs_score_zero(tmp_path, policy):
    tasks = BuiltinSuite(level="mixed").tasks("test", 9)
    _, done = _run(policy, tasks, tmp_path)
    assert [r.score for r in done] == [0.0] * 9


def test_resume_skips_finished_items(tmp_path):
    tasks = BuiltinSuite().tasks("test", 6)
    calls = []

    class Counting(GoldPolicy):
        def act(self, states):
            calls.extend(st.task.id for st in states)
            return super().act(states)

    _run(Counting(), tasks[:3], tmp_path)
    first = set(calls)
    assert first == {t.id for t in tasks[:3]}
    calls.clear()
    # a line cut short by a crash is ignored: that item runs again
    with open(tmp_path / "items.jsonl", "a") as f:
        f.write('{"id": "' + tasks[3].id + '", "categ')
    store, done = _run(Counting(), tasks, tmp_path)
    assert set(calls) == {t.id for t in tasks[3:]}
    assert {r.id for r in done} == {t.id for t in tasks[3:]}
    assert len(store.items()) == 6
    calls.clear()
    _, done = _run(Counting(), tasks, tmp_path)
    assert done == [] and calls == []


def test_resume_refuses_other_configuration(tmp_path):
    ResultStore(tmp_path, {"policy": "gold", "drift": None})
    with pytest.raises(ValueError, match="different configuration"):
        ResultStore(tmp_path, {"policy": "gold", "drift": "rename"})


def test_env_errors_and_policy_crash_are_outcomes(tmp_path):
    tasks = BuiltinSuite().tasks("test", 3)

    class Boom:
        name = "boom"

        def act(self, states):
            raise RuntimeError("decoder exploded")

    _, done = _run(Boom(), tasks, tmp_path)
    assert len(done) == 3 and all(r.score == 0.0 and "decoder exploded" in r.error for r in done)


def test_malformed_calls_are_counted_not_fatal(tmp_path):
    class Malformed:
        name = "bad"

        def act(self, states):
            return [{"role": "assistant", "content": "", "tool_calls": [{"malformed": "bad JSON"}]}
                    if st.steps == 0 else {"role": "assistant", "content": "done"} for st in states]

    _, done = _run(Malformed(), BuiltinSuite().tasks("test", 2), tmp_path)
    assert [r.malformed for r in done] == [1, 1] and [r.real_calls for r in done] == [0, 0]


def test_cli_gold_builtin(tmp_path, capsys):
    out = tmp_path / "gold"
    assert cli.main(["--suite", "builtin", "--policy", "gold", "--limit", "10", "--out", str(out),
                     "--quiet"]) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["suite"] == "builtin" and res["policy"] == "gold"
    assert res["categories"]["test"] == pytest.approx({**res["categories"]["test"], "accuracy": 1.0, "n": 10})
    assert res["overall"] == 1.0
    assert (out / "results.md").read_text().startswith("### builtin")
    assert (out / "accuracy.png").stat().st_size > 1000
    # rerun with more items resumes the first 10
    assert cli.main(["--suite", "builtin", "--policy", "gold", "--limit", "12", "--out", str(out),
                     "--quiet"]) == 0
    assert len((out / "items.jsonl").read_text().splitlines()) == 12


def test_builtin_easy_answer_category_checks_the_final_answer(tmp_path):
    """test:easy:task grades the spelled-out call only; test:easy:task:answer also needs the tool's
    result in the final answer (what an API-drift row needs to see a misread response)."""
    from fastrehearse.eval import suites

    class VagueAnswer(GoldPolicy):
        name = "vague"

        def act(self, states):
            out = super().act(states)
            for msg in out:
                if not msg.get("tool_calls"):
                    msg["content"] = "I called the tool for you."
            return out

    cats = ["test:easy:task", "test:easy:task:answer"]
    sr = suites.build("builtin", cats, limit=6)
    assert [c for c, _ in sr.items] == [cats[0]] * 6 + [cats[1]] * 6
    for policy, want in ((GoldPolicy(), {cats[0]: 1.0, cats[1]: 1.0}), (VagueAnswer(), {cats[0]: 1.0, cats[1]: 0.0})):
        done = run_items(sr.items, sr.make_env, policy, ResultStore(tmp_path / policy.name, {}),
                         HarnessConfig(batch_size=4))
        got = {c: [r.score for r in done if r.category == c] for c in cats}
        assert got == {c: [want[c]] * 6 for c in cats}, (policy.name, got)
    with pytest.raises(ValueError, match="split\\[:level"):
        suites.build("builtin", ["test:easy:task:bogus"], limit=1)


def test_cli_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="--rehearsal-budget"):
        cli.main(["--suite", "builtin", "--policy", "gold", "--rehearsal-budget", "2", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="--drift"):
        cli.main(["--suite", "builtin", "--policy", "gold", "--drift", "explode", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="--categories"):
        cli.main(["--suite", "builtin", "--policy", "gold", "--categories", "dev", "--out", str(tmp_path)])


@pytest.mark.parametrize("commit", ["note", "select"])
def test_cli_tiny_model_builtin_with_rehearsal_and_drift(tmp_path, commit):
    """A random tiny model end to end: scores near 0 are fine; no crash, valid results, tokens counted."""
    out = tmp_path / "tiny"
    assert cli.main(["--suite", "builtin", "--policy", "tiny-llama", "--limit", "2", "--max-steps", "2",
                     "--max-new-tokens", "12", "--max-response-tokens", "8", "--rehearsal-budget", "2",
                     "--rehearsal-commit", commit, "--drift", "all", "--out", str(out), "--quiet"]) == 0
    res = json.loads((out / "results.json").read_text())
    c = res["categories"]["test"]
    assert c["n"] == 2 and 0.0 <= c["accuracy"] <= 1.0
    assert c["mean_gen_tokens"] > 0 and c["mean_rehearsal_tokens"] > 0
    assert res["rehearsal"]["budget"] == 2 and res["drift"] == "rename,errors,units,formats"
    assert res["rehearsal"]["commit"] == commit


def test_prefix_cache_reuse_matches_fresh_decode():
    """Prompts that run alone reuse their episode's KV cache up to the common prefix; greedy
    outputs equal a fresh decode, and the reused tokens are not prefilled again."""
    import torch

    from fastrehearse.eval.policies import GenConfig, ModelPolicy
    from fastrehearse.model import load_model

    model, tok = load_model("tiny-llama", seed=1)
    g = torch.Generator().manual_seed(0)
    base = torch.randint(200, 40000, (300,), generator=g).tolist()
    prompts = [base + [11, 12], base + [11, 12, 13, 14, 15], base[:120] + [7], base + [11]]
    reuse = ModelPolicy(model, tok, "a", GenConfig(pad_cells=1))       # every prompt alone
    fresh = ModelPolicy(model, tok, "b", GenConfig(pad_cells=1))
    got = [reuse.generate([p], 12, 0.0, keys=["ep"])[0] for p in prompts]
    want = [fresh.generate([p], 12, 0.0)[0] for p in prompts]
    assert got == want
    # 2nd prompt reuses 302 tokens, 3rd 120 (its common prefix), 4th 120 (the cache was cropped)
    assert reuse.prefill_tokens_saved == 302 + 120 + 120 and fresh.prefill_tokens_saved == 0


def test_deadline_stops_new_items_and_rerun_resumes(tmp_path):
    import time

    tasks = BuiltinSuite().tasks("test", 3)
    _, done = _run(GoldPolicy(), tasks, tmp_path, HarnessConfig(batch_size=1, deadline=time.perf_counter() - 1))
    assert done == []
    _, done = _run(GoldPolicy(), tasks, tmp_path, HarnessConfig(batch_size=1))
    assert len(done) == 3 and all("transcript" in r.extra for r in done)
