"""API drift: each perturbation changes responses exactly as specified; state and scoring are untouched."""
import json

import pytest

from fastrehearse.envs.base import ResetResult, Task, ToolCall, ToolEnv, ToolResult, Trajectory
from fastrehearse.envs.builtin import BuiltinSuite
from fastrehearse.eval.drift import DriftEnv, DriftSpec, rename_key
from fastrehearse.eval.harness import HarnessConfig, run_items
from fastrehearse.eval.results import ResultStore, per_category
from fastrehearse.eval.runner import EvalSettings, eval_engine
from fastrehearse.kernels.roles import Role
from fastrehearse.model import load_tokenizer
from fastrehearse.rollout.engine.policy import GoldPolicy, ScriptedPolicy


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("smollm2")


def _engine(tok, model=None, **kw):
    return eval_engine(model, tok, EvalSettings(max_turns=12, max_episode_tokens=1 << 20), **kw)


class Canned(ToolEnv):
    """Answers each tool with a fixed response; counts executions."""

    def __init__(self, responses):
        self.responses = responses
        self.executed = []

    def reset(self, task):
        return ResetResult(tools=[{"type": "function", "function": {"name": n, "parameters": {}}}
                                  for n in self.responses], messages=[{"role": "user", "content": "hi"}])

    def execute(self, call):
        self.executed.append(call.name)
        return self.responses[call.name]

    def score(self, task, trajectory):
        return 1.0


RESP = {
    "get_balance": ToolResult(json.dumps({"account_id": "AC1", "balance": 12.5, "currency": "USD",
                                          "opened": "2024-03-07", "active": True})),
    "route": ToolResult(json.dumps({"distance_km": 3.2, "legs": [{"distance": 1.5, "total_fee": 2}]})),
    "fail": ToolResult(json.dumps({"error": "Account AC9 not found."}), ok=False, error_kind="not_found"),
    "text": ToolResult("plain text reply"),
    "pyrepr": ToolResult(str({"file_name": "a.txt", "size": 3})),
}
TASK = Task(id="t1", split="test", payload={})


def _env(spec):
    env = DriftEnv(Canned(RESP), DriftSpec.parse(spec))
    env.reset(TASK)
    return env


def _json(env, name):
    return json.loads(env.execute(ToolCall(name, {})).content)


def test_parse_and_describe():
    s = DriftSpec.parse("rename:balance=funds;currency=ccy,errors,remove:route,seed:3")
    assert s.rename_map == {"balance": "funds", "currency": "ccy"} and s.errors and s.remove
    assert s.remove_tool == "route" and s.seed == 3 and not s.units
    assert DriftSpec.parse("all").describe() == "rename,errors,units,formats"
    assert DriftSpec.parse(None) is None and DriftSpec.parse("none") is None
    for bad in ("explode", "rename:balance", "seed:x", "units:cents"):
        with pytest.raises(ValueError, match="--drift"):
            DriftSpec.parse(bad)


def test_rename_default_rule_and_map():
    assert rename_key("account_id", {}) == "accountId" and rename_key("balance", {}) == "balance_v2"
    assert _json(_env("rename"), "get_balance") == {"accountId": "AC1", "balance_v2": 12.5,
                                                    "currency_v2": "USD", "opened_v2": "2024-03-07",
                                                    "active_v2": True}
    assert _json(_env("rename:balance=funds"), "get_balance") == {
        "account_id": "AC1", "funds": 12.5, "currency": "USD", "opened": "2024-03-07", "active": True}
    # nested keys too; Python-literal responses (BFCL's str(dict)) are understood
    assert _json(_env("rename"), "route") == {"distanceKm": 3.2, "legs_v2": [{"distance_v2": 1.5, "totalFee": 2}]}
    assert _json(_env("rename"), "pyrepr") == {"fileName": "a.txt", "size_v2": 3}


def test_units_and_formats():
    assert _json(_env("units"), "get_balance")["balance_cents"] == 1250      # dollars -> cents, unit named
    assert _json(_env("units"), "route") == {"distance_m": 3200, "legs": [{"distance_m": 1500, "total_fee_cents": 200}]}
    assert _json(_env("units,rename"), "get_balance")["balanceCents"] == 1250   # still visible after rename
    f = _json(_env("formats"), "get_balance")
    assert f["opened"] == "07/03/2024" and f["active"] == "yes" and f["balance"] == "12.50"
    assert f["account_id"] == "AC1"


def test_units_drift_is_solvable_on_builtin():
    """The `units` drift renames the key to name the unit, and an answer in either unit passes:
    read off the response (cents) or converted (dollars); cents under an unchanged key graded in
    dollars would tell the agent nothing and no answer could pass. A wrong value, or a count that
    happens to be rescaled, still fails."""
    suite = BuiltinSuite(level="easy", easy_answer=True)
    task = next(t for t in suite.tasks("test", 60) if t.payload["required_calls"][0]["name"] == "get_balance")
    call = task.payload["required_calls"][0]
    dollars = task.payload["answer"]["value"]
    env = DriftEnv(suite.make_env(), DriftSpec.parse("units"))
    env.reset(task)
    shown = json.loads(env.execute(ToolCall(call["name"], call["arguments"])).content)
    cents = next(v for k, v in shown.items() if k.startswith("balance"))
    assert cents == round(dollars * 100)
    msgs = [{"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]},
            {"role": "tool", "content": json.dumps(shown)}]

    def score(answer):
        return env.score(task, Trajectory(messages=msgs + [{"role": "assistant", "content": answer}]))
    assert score(f"The balance is {cents} cents.") == 1.0          # graded in dollars only: 0
    assert score(f"The balance is {cents:,} cents.") == 1.0
    assert score(f"The balance is {dollars:.2f} USD.") == 1.0
    assert score(f"The balance is {cents + 1} cents.") == 0.0
    assert score("I do not know.") == 0.0
    assert "balance" not in shown and shown["balance_cents"] == cents   # the unit is in the key
    # a number of the answer that the drift did not produce is never rescaled
    stock = next(t for t in suite.tasks("test", 60) if t.payload["required_calls"][0]["name"] == "check_stock")
    env.reset(stock)
    c = stock.payload["required_calls"][0]
    env.execute(ToolCall(c["name"], c["arguments"]))
    assert env.scaled == []


def test_errors_reworded():
    env = _env("errors")
    r = env.execute(ToolCall("fail", {}))
    assert not r.ok and r.error_kind == "not_found"
    assert json.loads(r.content) == {"error": {"code": "E_NOT_FOUND", "detail": "account ac9 not found"}}
    # successful responses are untouched by `errors`
    assert env.execute(ToolCall("get_balance", {})).content == RESP["get_balance"].content


def test_non_json_passes_through():
    assert _env("all").execute(ToolCall("text", {})).content == "plain text reply"


def test_removed_tool():
    inner = Canned(RESP)
    env = DriftEnv(inner, DriftSpec.parse("remove:route"))
    res = env.reset(TASK)
    assert "route" not in [t["function"]["name"] for t in res.tools] and len(res.tools) == len(RESP) - 1
    r = env.execute(ToolCall("route", {}))
    assert not r.ok and r.error_kind == "unknown_tool" and inner.executed == []
    # seeded choice: deterministic per task, always one of the tools
    e1 = DriftEnv(Canned(RESP), DriftSpec.parse("remove,seed:1"))
    e1.reset(TASK)
    e2 = DriftEnv(Canned(RESP), DriftSpec.parse("remove,seed:1"))
    e2.reset(TASK)
    assert e1.removed == e2.removed and e1.removed in RESP


def test_drift_on_builtin_keeps_state_and_scoring(tmp_path, tok):
    """Gold replay under response drift still scores 1.0 (the real env state and checker are
    untouched) while the agent saw different responses; removing a needed tool breaks the task."""
    suite = BuiltinSuite()
    tasks = suite.tasks("test", 8)
    spec = DriftSpec.parse("rename,units,formats,errors")
    envs = []

    def make(c):
        envs.append(DriftEnv(suite.make_env(), spec))
        return envs[-1]

    done = run_items([("test", t) for t in tasks], make, _engine(tok), GoldPolicy(),
                     ResultStore(tmp_path / "a", {}), HarnessConfig(batch_size=4))
    assert [r.score for r in done] == [1.0] * 8
    assert sum(e.stats["changed"] for e in envs) > 0
    assert sum(e.stats["changed"] for e in envs) == sum(e.stats["responses"] for e in envs)
    # each item records what the drift did; results.json sums it per category
    assert sorted(json.dumps(r.extra["drift"], sort_keys=True) for r in done) == \
        sorted(json.dumps(e.stats, sort_keys=True) for e in envs)
    agg = per_category(done)["test"]["drift"]
    assert agg["changed"] == sum(e.stats["changed"] for e in envs) > 0
    assert agg["removed_tool_calls"] == 0 and agg["items_calling_removed_tool"] == 0

    def make_removed(c):
        return DriftEnv(suite.make_env(), DriftSpec.parse("remove:get_balance"))

    uses = [t for t in tasks if any(tc["function"]["name"] == "get_balance"
                                    for m in t.gold for tc in m.get("tool_calls") or [])]
    assert uses
    done = run_items([("test", t) for t in uses], make_removed, _engine(tok), GoldPolicy(),
                     ResultStore(tmp_path / "b", {}), HarnessConfig(batch_size=4))
    assert all(r.score == 0.0 and r.error is None for r in done)
    assert all(r.malformed >= 1 for r in done)        # the driver refused the unknown tool
    assert all(r.extra["drift"]["removed_tool_calls"] >= 1 for r in done)
    assert per_category(done)["test"]["drift"]["items_calling_removed_tool"] == len(uses)


class ForceResponse:
    """Logits processor: every rehearsed response is exactly `text` (+ the tool-turn end marker),
    a world model that memorized the pre-drift real response."""

    def __init__(self, tok, text, marker):
        self.target = tok.encode(text + marker, add_special_tokens=False)

    def __call__(self, contexts, context_roles, sample_roles, logits):
        logits = logits.clone()
        for i, (roles, role) in enumerate(zip(context_roles, sample_roles)):
            if role != Role.REHEARSE:
                continue
            k = 0
            while k < len(roles) and roles[-1 - k] == int(Role.REHEARSE):
                k += 1
            logits[i] = float("-inf")
            logits[i, self.target[min(k, len(self.target) - 1)]] = 0.0
        return logits


def test_fidelity_under_drift(tmp_path, tok):
    """World-model fidelity (the rehearse-mode pass, training's definition): a model whose rehearsed
    response is the *pre-drift* real response matches exactly without drift and loses the renamed
    fields under drift."""
    from fastrehearse.model import load_model
    from fastrehearse.rollout import RolloutConfig, RolloutEngine

    model, tok = load_model("tiny-llama")
    call = '<tool_call>\n{"name": "get_balance", "arguments": {}}\n</tool_call>'
    policy = ScriptedPolicy(lambda r: call if r.turn == 0 else "Done.")

    def run(spec, sub):
        engine = RolloutEngine(model, tok, RolloutConfig(mode="rehearse", measure_fidelity=True, temperature=0.0,
                                                         max_new_tokens=64, max_turns=4))
        engine.logits_processor = ForceResponse(tok, RESP["get_balance"].content, engine.template.tool_end_markers[0])
        make = (lambda c: Canned(RESP)) if spec is None else (lambda c: DriftEnv(Canned(RESP), DriftSpec.parse(spec)))
        done = run_items([("c", TASK)], make, engine, policy, ResultStore(tmp_path / sub, {}),
                         HarnessConfig(batch_size=1))
        assert done[0].error is None, done[0].error
        return done[0].fidelity

    assert run(None, "a") == {"exact": 1.0, "field_f1": 1.0, "calls": 1.0}
    assert run("rename", "b") == {"exact": 0.0, "field_f1": 0.0, "calls": 1.0}
    f = run("rename:balance=funds", "c")     # 4 of 5 fields still match
    assert f["exact"] == 0.0 and f["field_f1"] == pytest.approx(0.8)


def test_drift_env_forwards_every_protocol_member():
    """Every class-level protocol member of ToolEnv reads through to the wrapped env (a member the
    wrapper does not forward silently takes ToolEnv's default: e.g. validates_calls False made the
    engine re-check BFCL calls by schema under drift)."""
    class Inner(Canned):
        tools = [{"type": "function", "function": {"name": "late_tool", "parameters": {}}}]
        finished = True
        control_tools = frozenset({"done"})
        validates_calls = True
        grades_calls_only = True

        def next_user_message(self, reply=None):
            return {"role": "user", "content": "next"}

        def drift_stats(self):
            return {"x": 1}

    inner = Inner(RESP)
    env = DriftEnv(inner, DriftSpec.parse("rename"))
    members = [k for k, v in vars(ToolEnv).items()
               if not k.startswith("_") and not callable(v) and not isinstance(v, (staticmethod, classmethod))]
    assert set(members) >= {"tools", "finished", "control_tools", "validates_calls", "grades_calls_only"}
    for name in members:
        assert getattr(env, name) == getattr(inner, name), name
    assert env.next_user_message({"role": "assistant", "content": "hi"}) == {"role": "user", "content": "next"}


def test_fidelity_pass_resumes_after_a_kill(tmp_path):
    """The fidelity pass keeps nothing on disk until it ends. A run killed after scoring but before
    that pass ended must not resume with every item 'done' and no fidelity at all (a bench reads
    that as 'no calls made'): the resumed pass covers the items scored before."""
    from fastrehearse.eval.runner import evaluate_items
    from fastrehearse.model import load_model

    model, tok = load_model("tiny-llama")
    call = '<tool_call>\n{"name": "get_balance", "arguments": {}}\n</tool_call>'
    policy = ScriptedPolicy(lambda r: call if r.turn == 0 else "Done.")
    items = [("c", TASK)]
    s = EvalSettings(max_turns=4, max_new_tokens=16, batch_size=1, fidelity=True)

    def run(sub, settings):
        return evaluate_items(items, lambda c: Canned(RESP), model, tok, policy,
                              ResultStore(tmp_path / sub, {}), settings)

    fresh = run("fresh", s)[0].fidelity
    assert fresh is not None and fresh["calls"] == 1.0
    run("killed", EvalSettings(**{**s.__dict__, "fidelity": False}))   # scored, pass never ran
    assert ResultStore(tmp_path / "killed", {}).items()[0].fidelity is None
    run("killed", s)                                                    # the resume
    assert ResultStore(tmp_path / "killed", {}).items()[0].fidelity == fresh


def test_cli_resume_runs_the_missing_fidelity_pass(tmp_path, monkeypatch):
    """`fastrehearse eval --measure-fidelity` on a directory whose items are all scored but lack
    fidelity (killed during the fidelity pass) must run the evaluation again, not just rewrite
    results.json without fidelity; without --measure-fidelity nothing runs."""
    from fastrehearse.eval import cli

    base = ["--suite", "builtin", "--categories", "test:easy", "--limit", "2", "--policy", "tiny-llama",
            "--max-steps", "1", "--max-new-tokens", "4", "--quiet"]
    for flags, sub in ((["--measure-fidelity"], "fid"), ([], "plain")):
        args = cli.build_parser().parse_args(base + flags + ["--out", str(tmp_path / sub)])
        cli.run(args)      # tiny-llama makes no call: every item is scored without fidelity
        calls = []
        monkeypatch.setattr(cli, "evaluate_items", lambda *a, **k: calls.append(a[0]) or [])
        cli.run(args)
        monkeypatch.undo()
        assert len(calls) == (1 if flags else 0), sub
    # a run scored without the pass, resumed with it (the bench's light eval made full): the pass runs
    args = cli.build_parser().parse_args(base + ["--measure-fidelity", "--out", str(tmp_path / "plain")])
    calls = []
    monkeypatch.setattr(cli, "evaluate_items", lambda *a, **k: calls.append(a[0]) or [])
    cli.run(args)
    assert len(calls) == 1
