"""Real benchmarks through the engine: the gold policy scores 1.0 on BFCL multi-turn (all four
categories: a fast sample here, every entry in the slow sweep), the builtin suite and the tau2
telecom sample; wrong trajectories score 0; a BFCL episode sampled by a tiny fp32 model holds every
user turn as CONTEXT and its packed log-probs equal a re-forward of the packed row."""
import math

import pytest
import torch

from fastrehearse.envs.builtin import BuiltinSuite
from fastrehearse.kernels.roles import Role
from fastrehearse.rollout import RolloutConfig, RolloutEngine
from fastrehearse.rollout.engine.policy import GoldPolicy, ScriptedPolicy
from fastrehearse.rollout.text.template import assistant_text
from _rollout_fixtures import smollm2_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

# Gold BFCL trajectories make one call per assistant turn: two long_context entries (38, 46) take 35
# turns within one user turn, beyond BFCL's 20-step limit, so the gold runs allow 40.
GOLD_CFG = dict(mode="real", max_turns=40, max_episode_tokens=200_000)


def gold_engine(**cfg):
    # model=None: the gold policy forces every turn and every call runs for real: nothing is sampled.
    return RolloutEngine(None, smollm2_tokenizer(), RolloutConfig(**{**GOLD_CFG, **cfg}))


def assert_all_one(res, tasks):
    bad = [(e.task_id, e.reward, e.metadata["stop_reason"], e.metadata.get("error"), e.metadata["malformed"])
           for e in res.episodes if e.reward != 1.0]
    assert not bad, bad
    assert len(res.episodes) == len(tasks) and res.metrics["forced_turns"] > 0


@pytest.fixture(scope="module")
def bfcl():
    pytest.importorskip("bfcl_eval")
    from fastrehearse.envs.bfcl import BfclSuite
    return BfclSuite()


def test_bfcl_gold_sample_all_categories(bfcl):
    """The first 5 entries of each category plus the entries that need care (miss_func_49 calls a
    held-out function before its turn; long_context_38 takes 35 steps in one turn)."""
    tasks = bfcl.tasks("multi_turn", limit=20)
    tasks += [bfcl.tasks("miss_func", limit=50)[49], bfcl.tasks("long_context", limit=39)[38]]
    assert [t.id for t in tasks[-2:]] == ["multi_turn_miss_func_49", "multi_turn_long_context_38"]
    assert {t.split for t in tasks} == {"multi_turn_base", "multi_turn_miss_func",
                                        "multi_turn_miss_param", "multi_turn_long_context"}
    res = gold_engine().rollout(tasks, bfcl, policy=GoldPolicy())
    assert_all_one(res, tasks)
    for t, ep, traj in zip(tasks, res.episodes, res.trajectories):
        n_turns = len(t.payload["ground_truth"])
        assert ep.metadata["user_turns"] == n_turns - 1 and ep.metadata["stop_reason"] == "final_answer"
        assert [m for m in traj.messages if m["role"] == "user"] == t.payload["user_turns"]
        if t.split == "multi_turn_miss_func":
            assert ep.metadata["tools_changed"]


@pytest.mark.slow
def test_bfcl_gold_every_entry(bfcl):
    """All 800 multi-turn entries (13 minutes measured on the shared 2-core box, niced)."""
    tasks = bfcl.tasks("multi_turn")
    assert len(tasks) == 800
    eng = gold_engine()
    for i in range(0, len(tasks), 100):
        assert_all_one(eng.rollout(tasks[i:i + 100], bfcl, policy=GoldPolicy()), tasks[i:i + 100])


def test_bfcl_wrong_trajectories_score_zero(bfcl):
    """The gold with one call dropped, and the gold that stops after the first user turn."""
    task = bfcl.tasks("base", limit=1)[0]
    gold = [m for m in task.gold if m["role"] == "assistant"]
    dropped = [assistant_text(m) for i, m in enumerate(gold) if i != 0]
    res = gold_engine().rollout([task, task], bfcl, policy=ScriptedPolicy(
        lambda r: dropped[r.turn] if r.row == 0 else assistant_text(gold[r.turn])))
    assert res.episodes[1].reward == 1.0
    assert res.episodes[0].reward == 0.0
    first_turn = [assistant_text(m) for m in gold[:gold.index(next(m for m in gold if not m.get("tool_calls"))) + 1]]
    cut = gold_engine(max_turns=len(first_turn)).rollout(
        [task], bfcl, policy=ScriptedPolicy(first_turn + ["<tool_call>\n{bad\n</tool_call>"] * 50))
    assert cut.episodes[0].reward == 0.0 and cut.episodes[0].metadata["stop_reason"] == "max_turns"


def test_builtin_gold_and_wrong_answer():
    suite = BuiltinSuite(level="all", n_train=16, n_test=16)
    tasks = suite.tasks("test")
    res = gold_engine(max_turns=8).rollout(tasks, suite, policy=GoldPolicy())
    assert_all_one(res, tasks)
    # the same calls with a wrong final answer (level >= 1 checks the answer)
    hard = [t for t in tasks if "-L3-" in t.id][:2]

    def wrong(req):
        gold = [m for m in req.task.gold if m["role"] == "assistant"]
        m = gold[req.turn] if req.turn < len(gold) else {"content": ""}
        return assistant_text(m) if m.get("tool_calls") else "I do not know."
    res = gold_engine(max_turns=8).rollout(hard, suite, policy=ScriptedPolicy(wrong))
    assert [e.reward for e in res.episodes] == [0.0, 0.0]


@pytest.fixture(scope="module")
def telecom():
    pytest.importorskip("tau2")
    from fastrehearse.envs.tau2 import Tau2Suite, gold_messages
    suite = Tau2Suite(with_gold=False)
    tasks = suite.tasks("telecom")
    sample = tasks[::19] + [tasks[37]]     # the sample tests/test_env_tau2.py replays
    for t in sample:
        t.gold = gold_messages(t.payload["tau2_task"], "telecom", True)
    return suite, sample


def test_tau2_telecom_gold_sample_and_wrong(telecom):
    suite, tasks = telecom
    res = gold_engine(max_turns=30).rollout(tasks, suite, policy=GoldPolicy())
    assert_all_one(res, tasks)
    assert {e.metadata["stop_reason"] for e in res.episodes} == {"finished"}   # the `done` tool
    # wrong: the gold actions but a text reply instead of `done` (tau2 solo: an agent error)
    def no_done(req):
        gold = [m for m in req.task.gold if m["role"] == "assistant"]
        m = gold[req.turn]
        return "I am done." if m["tool_calls"][0]["function"]["name"] == "done" else assistant_text(m)
    res = gold_engine(max_turns=30).rollout(tasks[:2], suite, policy=ScriptedPolicy(no_done))
    assert [e.reward for e in res.episodes] == [0.0, 0.0]


# ----------------------------------------------------------------------------------------------
# token in / token out across user turns, checked against a packed re-forward


class EndAfter:
    """Logits processor: after `n` ACT tokens of a turn, push the end-of-turn token (+bias), so a
    tiny random model ends its replies and the episode walks through every user turn. A pure
    function of (context, roles), as the engine requires; the re-forward below applies it too."""

    def __init__(self, end_id, n=3, bias=12.0):
        self.end_id, self.n, self.bias = end_id, n, bias

    def adjust(self, roles, logits_row):
        k = 0
        while k < len(roles) and roles[-1 - k] == Role.ACT:
            k += 1
        if k >= self.n:
            logits_row = logits_row.clone()
            logits_row[self.end_id] += self.bias
        return logits_row

    def __call__(self, contexts, context_roles, sample_roles, logits):
        return torch.stack([self.adjust(r, l) for r, l in zip(context_roles, logits)])


def test_bfcl_episode_user_turns_and_packed_logprobs(bfcl):
    from fastrehearse.model import load_model
    from fastrehearse.model.adapter import hidden_states
    from fastrehearse.packing import pack

    model, tok = load_model("tiny-llama")          # fp32
    tasks = bfcl.tasks("miss_func", limit=2)
    end_id = tok.convert_tokens_to_ids("<|im_end|>")
    proc = EndAfter(end_id)
    # gold turns with calls are forced (real tool responses follow); every text reply is sampled
    def calls_forced(req):
        gold = [m for m in req.task.gold if m["role"] == "assistant"]
        m = gold[req.turn] if req.turn < len(gold) else None
        return assistant_text(m) if m and m.get("tool_calls") else None
    temp = 0.9
    eng = RolloutEngine(model, tok, RolloutConfig(mode="real", temperature=temp, max_new_tokens=32,
                                                  max_turns=40, max_episode_tokens=16384),
                        logits_processor=proc)
    res = eng.rollout(tasks, bfcl, group_size=1, seed=3, policy=ScriptedPolicy(calls_forced))
    for t, ep, traj in zip(tasks, res.episodes, res.trajectories):
        assert ep.metadata["stop_reason"] == "final_answer", ep.metadata
        assert ep.metadata["user_turns"] == len(t.payload["user_turns"]) > 0
        # every user turn is in the token sequence, as CONTEXT, in order
        pos = ep.metadata["prompt_tokens"]
        for u in t.payload["user_turns"]:
            ids = tok.encode(u["content"], add_special_tokens=False)
            k = next(i for i in range(pos, len(ep.input_ids)) if ep.input_ids[i:i + len(ids)] == ids)
            assert set(ep.roles[k:k + len(ids)]) == {int(Role.CONTEXT)}
            pos = k + len(ids)
        sampled = [i for i, lp in enumerate(ep.rollout_logprobs) if not math.isnan(lp)]
        assert len(sampled) >= 3 * (ep.metadata["user_turns"] + 1)
        assert all(ep.roles[i] == Role.ACT for i in sampled)
    # pack both episodes into one row and re-forward it (varlen attention, explicit boundaries)
    (batch,) = pack(res.episodes, max_tokens=sum(map(len, res.episodes)))
    with torch.no_grad():
        h = hidden_states(model, batch)
        w = model.get_output_embeddings().weight
    checked = 0
    for t in range(batch.num_tokens):
        old = float(batch.old_logp[t])
        if math.isnan(old):
            continue
        e = int(batch.seq_ids[t])              # index into res.episodes
        ep = res.episodes[e]
        j = t - int(batch.cu_seqlens[batch.episode_indices.index(e)]) + 1   # target index in ep
        with torch.no_grad():
            logits = proc.adjust(ep.roles[:j], (h[t] @ w.T).float())
        ref = torch.log_softmax(logits / temp, -1)[ep.input_ids[j]]
        assert abs(float(ref) - old) < 1e-4, (t, float(ref), old)
        checked += 1
    assert checked == sum(sum(not math.isnan(x) for x in ep.rollout_logprobs) for ep in res.episodes)


def test_tau2_conversational_user_turns_through_the_engine(monkeypatch):
    """tau2 mock in conversational mode: the user simulator (a scripted OpenAI-compatible server on
    loopback) answers the agent's text replies through the engine: its first message is in the
    prompt, its second a user turn forced as CONTEXT after the agent's closing reply, its stop ends
    the episode; tau2's evaluator gives the gold run (plus one empty closing reply) 1.0."""
    pytest.importorskip("tau2")
    from fastrehearse.envs.tau2 import Tau2Suite
    from test_env_tau2_usersim import ScriptedUser     # the scripted simulator of the env tests
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    sim = ScriptedUser(["Hi, I need help with my reservation.", "Thanks! Anything else I should know?",
                        "###STOP###"])
    try:
        suite = Tau2Suite(user_url=sim.url, user_model="openai/scripted-user", solo=False)
        task = suite.tasks("mock", limit=1)[0]
        res = gold_engine(max_turns=10).rollout([task], suite, policy=GoldPolicy())
        ep, traj = res.episodes[0], res.trajectories[0]
        assert ep.reward == 1.0 and ep.metadata["stop_reason"] == "final_answer", ep.metadata
        assert ep.metadata["user_turns"] == 1
        # the simulator received the agent's closing reply as the engine wrote it
        closing = [m for m in task.gold if m["role"] == "assistant"][-1]["content"]
        assert sim.requests[1][1]["messages"][-1]["content"] == closing
        assert [m["role"] for m in traj.messages][-3:] == ["assistant", "user", "assistant"]
        tok = smollm2_tokenizer()
        n = ep.metadata["prompt_tokens"]
        for text, lo, hi in (("Hi, I need help with my reservation.", 0, n),
                             ("Thanks! Anything else I should know?", n, len(ep.input_ids))):
            ids = tok.encode(text, add_special_tokens=False)
            k = next(i for i in range(lo, hi) if ep.input_ids[i:i + len(ids)] == ids)
            assert set(ep.roles[k:k + len(ids)]) == {int(Role.CONTEXT)}
    finally:
        sim.close()
