"""Teacher-forced metrics (fastrehearse/eval/teacher_forced.py): the summed log-prob equals a
hand computation from the model's own logits; the fidelity split scores schema, echoed and hidden
fields apart; the rehearsal pass runs through the engine on a tiny model; the CLI refuses bad input."""
from __future__ import annotations

import json

import pytest
import torch

from fastrehearse.envs.builtin import BuiltinSuite
from fastrehearse.envs.builtin.tools import RESPONSES
from fastrehearse.eval.teacher_forced import fidelity_split, gold_logprobs, main, rehearsal_fidelity, summarize
from fastrehearse.kernels.roles import Role
from fastrehearse.model.loader import load_model
from fastrehearse.rollout.text.template import ChatTemplate

pytestmark = pytest.mark.usefixtures("one_thread")
SUITE = BuiltinSuite(level="easy@-accounts", tools="task", easy_answer=True)


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-llama")


def test_logprobs_equal_a_full_forward_per_item(tiny):
    """The shared-prefix, batched, right-padded computation equals one plain forward per item."""
    model, tok = tiny
    tasks = SUITE.tasks("test", 7)         # several tasks per tool: shared prefixes, padded batches
    assert len({t.payload["tools"][0] for t in tasks}) < len(tasks)
    rows = gold_logprobs(model, tok, SUITE, tasks, batch_size=2)
    tmpl = ChatTemplate(tok)
    for task, row in zip(tasks, rows):
        env = SUITE.make_env()
        reset = env.reset(task)
        msgs = list(reset.messages) + list(task.gold)
        r = tmpl.render(msgs, reset.tools, tool_roles=Role.OBSERVED)
        with torch.no_grad():
            lp = torch.log_softmax(model(input_ids=torch.tensor([r.input_ids])).logits[0].double(), -1)

        def want(spans):
            return sum(float(lp[t - 1, r.input_ids[t]]) for s, e in spans for t in range(s, e))
        answer = [(s, e) for s, e, role, mi in r.spans if mi == len(msgs) - 1]
        tools = [(s, e) for s, e, role, mi in r.spans if role == int(Role.OBSERVED)]
        assert row["id"] == task.id and row["answer_tokens"] == sum(e - s for s, e in answer)
        assert row["answer_logprob"] == pytest.approx(want(answer), rel=1e-4, abs=1e-3)
        assert row["response_logprob"] == pytest.approx(want(tools), rel=1e-4, abs=1e-3)
        assert tok.decode(r.input_ids[answer[0][0]:answer[0][1]]).strip() == task.gold[-1]["content"].strip()


def test_fidelity_split_hand_computed():
    spec = RESPONSES["get_balance"]
    real = '{"account_id":"AC1","balance":12.5,"currency":"USD"}'
    args = {"account_id": "AC1"}
    assert fidelity_split(args, real, real, spec) == {"schema": 1.0, "echo": 1.0, "hidden": 1.0}
    # right format and echo, wrong balance: hidden 1 of 2 leaves (currency right)
    assert fidelity_split(args, '{"account_id":"AC1","balance":3,"currency":"USD"}', real, spec) == \
        {"schema": 1.0, "echo": 1.0, "hidden": 0.5}
    # a missing key: schema 2/3; echo wrong
    assert fidelity_split(args, '{"account_id":"AC2","balance":12.5}', real, spec) == \
        {"schema": pytest.approx(2 / 3), "echo": 0.0, "hidden": 0.5}
    assert fidelity_split(args, "not json", real, spec) == {"schema": 0.0, "echo": 0.0, "hidden": 0.0}
    assert fidelity_split(args, None, real, spec) == {"schema": 0.0, "echo": 0.0, "hidden": 0.0}
    # lists: key paths ignore positions; leaves compared with their index
    ev = '{"date":"2026-01-02","events":[{"event_id":"EV1","title":"a"}]}'
    got = fidelity_split({"date": "2026-01-02"}, '{"date":"2026-01-02","events":[{"event_id":"EV9","title":"a"}]}',
                         ev, RESPONSES["list_events"])
    assert got == {"schema": 1.0, "echo": 1.0, "hidden": 0.5}


def test_rehearsal_pass_through_the_engine_and_summary(tiny):
    model, tok = tiny
    tasks = SUITE.tasks("test", 3)
    rows = rehearsal_fidelity(model, tok, SUITE, tasks, max_new_tokens=8)
    assert [r["id"] for r in rows] == [t.id for t in tasks]
    for r in rows:
        assert r["calls"] == 1 and r["error"] is None and 0.0 <= r["field_f1"] <= 1.0
        # every builtin response has a predictable field (an echo) and these first calls a hidden one
        assert 0.0 <= r["rule_predictable"] <= 1.0 and 0.0 <= r["rule_hidden"] <= 1.0
    lp = gold_logprobs(model, tok, SUITE, tasks)
    s = summarize(lp, rows)
    assert s["n_logprob"] == 3 and s["answer_logprob_per_token"] == pytest.approx(
        sum(r["answer_logprob"] for r in lp) / sum(r["answer_tokens"] for r in lp))


def test_cli_writes_items_and_refuses_bad_input(tmp_path, capsys):
    out = tmp_path / "tf.json"
    assert main(["--model", "tiny-llama", "--level", "easy@accounts", "--n", "2", "--n-rehearsal", "1",
                 "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert len(res["logprob_items"]) == 2 and len(res["rehearsal_items"]) == 1
    assert all("accounts" in r["id"] for r in res["logprob_items"])
    for bad in (["--n", "0"], ["--level", "easy@nope"], ["--suite", "bfcl"]):
        with pytest.raises(SystemExit):
            main(["--model", "tiny-llama", "--out", str(tmp_path / "x.json"), *bad])
    assert not (tmp_path / "x.json").exists()


def test_value_tokens_are_the_answer_value_only(tiny):
    model, tok = tiny
    from fastrehearse.eval.teacher_forced import _render_gold, value_span
    tmpl = ChatTemplate(tok)
    seen = set()
    for task in SUITE.tasks("test", 12):
        seq, answer, _, _, value = _render_gold(tmpl, SUITE, task)
        (s, e), = value
        assert answer[-1][0] <= s < e <= answer[-1][1]
        text, spec = tok.decode(seq[s:e]).strip(), task.payload["answer"]
        want = spec["value"] if spec["kind"] != "number" else None
        assert (want is None and abs(float(text.replace(",", "")) - spec["value"]) <= 0.01) or text.lower() == want.lower()
        seen.add(spec["kind"])
    assert seen == {"number", "token", "choice"}
    row = gold_logprobs(model, tok, SUITE, SUITE.tasks("test", 1))[0]
    assert row["value_tokens"] > 0 and row["value_logprob"] < 0
    assert value_span(tok, [1, 2], (0, 2), None) == []
