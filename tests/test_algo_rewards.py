"""Reward modes per role (fastrehearse/algo/rewards.py, envs/builtin/scoring.py): hand-built
episodes pin `real`, `consistent` and `calls`, the world-model reward and the hybrid ACT strata;
one run of the trainer's `rollout()` (real engine, tiny model forced through a rehearsed world)
checks that calls, rehearsed responses and fidelity entries pair up on the engine's own output."""
from __future__ import annotations

import json

import pytest

from fastrehearse.algo import compute_advantages
from fastrehearse.algo.rewards import (WorldRewardConfig, assign_rewards, check_task_reward, format_score,
                                       reward_row, score_rehearsals, stratum_of)
from fastrehearse.data import Episode
from fastrehearse.envs.base import Trajectory
from fastrehearse.envs.builtin import BuiltinSuite
from fastrehearse.envs.builtin.tools import RESPONSES
from fastrehearse.envs.replay import exchanges_of
from fastrehearse.kernels.roles import Role

EASY = BuiltinSuite(level="easy", easy_answer=True)
ALL = BuiltinSuite(level="all", easy_answer=True)


def _easy(tool: str):
    return next(t for t in (EASY.task("train", i) for i in range(200)) if t.payload["required_calls"][0]["name"] == tool)


def _call(name, args):
    return {"role": "assistant", "content": "", "tool_calls": [{"type": "function",
                                                               "function": {"name": name, "arguments": args}}]}


def _traj(task, response: dict | str, answer: str, rehearsed=True) -> Trajectory:
    call = task.payload["required_calls"][0]
    content = response if isinstance(response, str) else json.dumps(response)
    msgs = [_call(call["name"], call["arguments"]), {"role": "tool", "content": content, "rehearsed": rehearsed},
            {"role": "assistant", "content": answer}]
    return Trajectory(messages=msgs, final_answer=answer)


def _modes(task, traj):
    return {m: EASY.task_reward(task, traj, m) for m in ("real", "calls", "consistent")}


def test_faithful_report_of_a_rehearsed_world_scores_1_consistent_0_real():
    """A faithful report of a rehearsed world: the world model says 1234.56, the real balance differs, the policy
    reports what it saw."""
    task = _easy("get_balance")
    aid = task.payload["required_calls"][0]["arguments"]["account_id"]
    real = task.payload["answer"]["value"]
    assert abs(real - 1234.56) > 0.01
    traj = _traj(task, {"account_id": aid, "balance": 1234.56, "currency": "USD"}, "The balance is 1234.56 USD.")
    assert _modes(task, traj) == {"real": 0.0, "calls": 1.0, "consistent": 1.0}
    # reporting the real value the episode never showed: right for `real`, wrong for `consistent`
    traj = _traj(task, {"account_id": aid, "balance": 1234.56, "currency": "USD"}, f"It is {real:.2f} USD.")
    assert _modes(task, traj) == {"real": 1.0, "calls": 1.0, "consistent": 0.0}


@pytest.mark.parametrize("tool,response,answer,want", [
    ("check_stock", {"in_stock": 7}, "7 units.", 1.0),
    ("check_stock", {"in_stock": "7"}, "7 units.", 1.0),                # a numeric string is the value
    ("check_stock", {"in_stock": 7}, "8 units.", 0.0),
    ("get_order_status", {"status": "Shipped"}, "The order is shipped.", 1.0),   # the option, any case
    ("get_order_status", {"status": "shipped"}, "Shipped, then delivered.", 0.0),  # names two options
    ("get_order_status", {"status": "lost"}, "The order is lost.", 0.0),   # not an allowed status
    ("list_events", {"events": [{"title": "a"}, {"title": "b"}]}, "There are 2 events.", 1.0),
    ("list_events", {"events": "two"}, "There are 2 events.", 0.0),
    ("find_customer", {"customer_id": "CU1"}, "The id is CU1.", 1.0),
    ("get_balance", {"error": "account not found"}, "It is 5.", 0.0),      # the episode's world failed it
    ("get_balance", "not json", "It is 5.", 0.0),
])
def test_consistent_answer_kinds(tool, response, answer, want):
    task = _easy(tool)
    assert EASY.task_reward(task, _traj(task, response, answer), "consistent") == want


def test_a_pasted_tool_response_is_not_an_answer():
    """A final message that copies a tool response back (the calls-only arm of the v3 learning run
    learned this) fails the answer check in every mode that has one; before 2026-12-06 it passed
    whenever the value was a word in the paste or a number after `": "`. Quoting the value in a
    sentence still passes."""
    task = _easy("get_order_status")
    oid = task.payload["required_calls"][0]["arguments"]["order_id"]
    status = task.payload["answer"]["value"]
    content = json.dumps({"order_id": oid, "status": status}, separators=(",", ":"))
    for answer in (f"<tool_response>\n{content}\n</tool_response>",          # verbatim, in tags
                   json.dumps({"order_id": oid, "status": status}, indent=2),  # re-spaced: same object
                   f"Result: {content}"):
        assert _modes(task, _traj(task, content, answer, rehearsed=False)) == {"real": 0.0, "calls": 1.0, "consistent": 0.0}
    assert _modes(task, _traj(task, content, f"The order is {status}.", rehearsed=False)) == \
        {"real": 1.0, "calls": 1.0, "consistent": 1.0}
    task = _easy("get_balance")
    aid = task.payload["required_calls"][0]["arguments"]["account_id"]
    response = {"account_id": aid, "balance": 1234.56, "currency": "USD"}
    assert EASY.task_reward(task, _traj(task, response, json.dumps(response)), "consistent") == 0.0
    assert EASY.task_reward(task, _traj(task, response, "The balance is 1234.56 USD."), "consistent") == 1.0


def test_consistent_calls_are_gold_calls_without_execution():
    task = _easy("check_stock")
    sku = task.payload["required_calls"][0]["arguments"]["sku"]
    resp = {"sku": sku, "in_stock": 3}
    ok = _traj(task, resp, "3 units")
    assert EASY.task_reward(task, ok, "consistent") == 1.0
    wrong = Trajectory(messages=[_call("check_stock", {"sku": "SK0000"}), {"role": "tool", "content": json.dumps(resp)},
                                 {"role": "assistant", "content": "3 units"}])
    assert EASY.task_reward(task, wrong, "consistent") == 0.0
    lower = Trajectory(messages=[_call("check_stock", {"sku": sku.lower()}), {"role": "tool", "content": json.dumps(resp)},
                                 {"role": "assistant", "content": "3 units"}])   # ids case-insensitive, as `real`
    assert EASY.task_reward(task, lower, "consistent") == 1.0
    none = Trajectory(messages=[{"role": "assistant", "content": "3 units"}])
    assert EASY.task_reward(task, none, "consistent") == 0.0


def test_consistent_state_counts_only_successful_writes_and_refuses_extra_ones():
    task = next(t for t in (ALL.task("train", i) for i in range(400)) if t.payload["template"] == "transfer_between_owners")
    gold = task.gold
    assert ALL.task_reward(task, Trajectory(messages=gold), "consistent") == 1.0
    t_call = next(m for m in gold if m.get("tool_calls") and m["tool_calls"][0]["function"]["name"] == "transfer")
    extra_ok = gold[:-1] + [t_call, {"role": "tool", "content": '{"transfer_id":"TR9","amount":1}'}, gold[-1]]
    assert ALL.task_reward(task, Trajectory(messages=extra_ok), "consistent") == 0.0
    extra_failed = gold[:-1] + [t_call, {"role": "tool", "content": '{"error":"insufficient funds"}'}, gold[-1]]
    assert ALL.task_reward(task, Trajectory(messages=extra_failed), "consistent") == 1.0


def test_every_gold_trajectory_scores_1_in_every_mode():
    for i in range(60):
        task = ALL.task("train", i)
        for mode in ("real", "calls", "consistent"):
            assert ALL.task_reward(task, Trajectory(messages=task.gold), mode) == 1.0, (task.id, mode)


def test_order_shortage_answer_from_the_stock_check_or_the_failed_order():
    task = next(t for t in (ALL.task("train", i) for i in range(600))
                if t.payload["template"] == "order_product" and t.payload["answer"]["kind"] == "number")
    calls = [m for m in task.gold if m.get("tool_calls")]
    find_c, search = calls[0], calls[1]
    tools = [m for m in task.gold if m["role"] == "tool"]
    sku = search["tool_calls"][0]["function"]["arguments"]["query"]
    base = [find_c, tools[0], search, tools[1]]
    via_error = base + [_call("place_order", {"customer_id": "CU1", "sku": sku, "quantity": 9}),
                        {"role": "tool", "content": '{"error":"only 4 units in stock"}'},
                        {"role": "assistant", "content": "Only 4 units are in stock."}]
    assert ALL.task_reward(task, Trajectory(messages=via_error), "consistent") == 1.0


def test_exchanges_pair_responses_with_calls_past_a_malformed_block():
    raw = ('<tool_call>{"name": "get_balance", "arguments": {"bad": 1}}</tool_call>'
           '<tool_call>{"name": "get_balance", "arguments": {"account_id": "AC1"}}</tool_call>')
    msgs = [{"role": "assistant", "content": "", "raw_text": raw,
             "tool_calls": [{"type": "function", "function": {"name": "get_balance", "arguments": {"account_id": "AC1"}}}]},
            {"role": "tool", "content": '{"error": "bad_arguments", "message": "x"}', "rehearsed": False},
            {"role": "tool", "content": '{"balance": 5}', "rehearsed": True},
            {"role": "assistant", "content": "5"}]
    ex = exchanges_of(msgs)
    assert [(e.name, e.arguments, e.content, e.rehearsed) for e in ex] == [
        ("get_balance", {"account_id": "AC1"}, '{"balance": 5}', True)]


def test_format_score_hand_computed():
    spec = RESPONSES["get_balance"]   # keys account_id, balance, currency; echo account_id
    args = {"account_id": "AC12"}
    assert format_score(args, '{"account_id":"ac12","balance":3.5,"currency":"USD"}', spec) == 1.0
    # keys {account_id, balance} of 3 -> 2/3; echo wrong -> 0; parses 1: (1 + 2/3 + 0) / 3
    assert format_score(args, '{"account_id":"AC99","balance":3.5}', spec) == pytest.approx((1 + 2 / 3) / 3)
    # an extra key: Jaccard 3/4
    assert format_score(args, '{"account_id":"AC12","balance":1,"currency":"USD","x":1}', spec) == \
        pytest.approx((1 + 0.75 + 1) / 3)
    assert format_score(args, '{"error":"not found"}', spec) == pytest.approx(1 / 3)
    assert format_score(args, "balance is 5", spec) == 0.0
    assert format_score(args, '[1, 2]', spec) == 0.0
    # no spec: parses + same-name echo
    assert format_score({"q": "a"}, '{"q": "A", "r": 1}', None) == 1.0
    assert format_score({"q": "a"}, '{"q": "b"}', None) == 0.5
    assert format_score({"q": "a"}, '{"r": 1}', None) == 1.0


def test_world_reward_mixes_format_and_grounded_terms():
    from fastrehearse.envs.replay import Exchange
    ex = [Exchange("get_balance", {"account_id": "AC12"}, '{"account_id":"AC12","balance":1,"currency":"USD"}', True),
          Exchange("get_balance", {"account_id": "AC12"}, "oops", True),
          Exchange("check_stock", {"sku": "S"}, '{"sku":"S","in_stock":1}', False)]   # real: not scored
    cfg = WorldRewardConfig(mode="world", format_weight=1.0, grounded_weight=3.0)
    fid = [{"tool": "get_balance", "field_f1": 0.5, "exact": 0.0}, {"tool": "get_balance", "field_f1": 0.0, "exact": 0.0}]
    s = score_rehearsals(ex, fid, cut=1, spec_of=RESPONSES.get, cfg=cfg)
    assert [x.reward for x in s] == [pytest.approx((1 * 1.0 + 3 * 0.5) / 4), 0.0, 0.0]
    s = score_rehearsals(ex, [], cut=0, spec_of=RESPONSES.get, cfg=cfg)    # nothing measured: F only
    assert [x.reward for x in s] == [1.0, 0.0]
    with pytest.raises(ValueError, match="fidelity entries"):
        score_rehearsals(ex, fid[:1], cut=0, spec_of=RESPONSES.get, cfg=cfg)
    with pytest.raises(ValueError):
        WorldRewardConfig(format_weight=0)
    with pytest.raises(ValueError):
        WorldRewardConfig().grounded_weight = -1.0


def _episode(task_id, roles, reward, group=0, **meta):
    return Episode(input_ids=list(range(len(roles))), roles=roles, task_id=task_id, reward=reward,
                   metadata={"group": group, **meta})


def test_assign_rewards_then_advantages_per_role():
    """Two rehearse episodes of one EASY task: ACT gets the consistent task reward with the group
    baseline; REHEARSE its own world reward with its own baseline."""
    task = _easy("get_balance")
    aid = task.payload["required_calls"][0]["arguments"]["account_id"]
    good = _traj(task, {"account_id": aid, "balance": 1234.56, "currency": "USD"}, "1234.56 USD")
    bad = _traj(task, '{"balance": 1234.56}', "999.00 USD")    # parses, 1 of 3 keys, no echo; answer off
    A, R, C = int(Role.ACT), int(Role.REHEARSE), int(Role.CONTEXT)
    eps = [_episode(task.id, [C, A, R, R, A], 0.0, calls=[{"name": "get_balance", "mode": "rehearse"}]),
           _episode(task.id, [C, A, R, A], 0.0, calls=[{"name": "get_balance", "mode": "rehearse"}])]
    given = [(e.reward, dict(e.role_rewards), dict(e.metadata)) for e in eps]
    eps2 = assign_rewards(eps, [good, bad], [task], EASY, task_reward="consistent",
                          world=WorldRewardConfig(mode="world"), rollout_mode="rehearse")
    assert [(e.reward, dict(e.role_rewards), dict(e.metadata)) for e in eps] == given   # not changed
    eps = eps2
    assert [e.reward for e in eps] == [1.0, 0.0]
    assert [e.metadata["reward_real"] for e in eps] == [0.0, 0.0]
    w_bad = (1 + 1 / 3 + 0) / 3
    assert eps[0].role_rewards[R] == 1.0 and eps[1].role_rewards[R] == pytest.approx(w_bad)
    adv, _ = compute_advantages(eps)
    assert adv[0] == [0.0, 0.5, pytest.approx((1 - w_bad) / 2), pytest.approx((1 - w_bad) / 2), 0.5]
    assert adv[1] == [0.0, -0.5, pytest.approx(-(1 - w_bad) / 2), -0.5]
    row = reward_row(eps)
    assert row["reward_real"] == 0.0 and row["world_reward"] == pytest.approx((1 + w_bad) / 2)


def test_malformed_keeps_malformed_reward_and_errors_are_left_alone():
    task = _easy("get_balance")
    aid = task.payload["required_calls"][0]["arguments"]["account_id"]
    traj = _traj(task, {"account_id": aid, "balance": 1.0, "currency": "USD"}, "1.00")
    A = int(Role.ACT)
    eps = [_episode(task.id, [A], 1.0, malformed={"bad_json": 1}), _episode(task.id, [A], 0.0, error="score: boom")]
    eps = assign_rewards(eps, [traj, traj], [task], EASY, task_reward="consistent")
    assert eps[0].reward == 0.0 and eps[0].metadata["reward_real"] == 0.0
    assert eps[1].reward == 0.0 and "reward_real" not in eps[1].metadata
    with pytest.raises(ValueError, match="only"):
        check_task_reward(type("S", (), {"name": "tau2", "reward_modes": ("real",)}), "consistent")
    with pytest.raises(ValueError, match="not one of"):
        check_task_reward(EASY, "answer")


def test_hybrid_act_baseline_within_strata():
    """Real-call episodes (reward 1, 1) and rehearsed ones (0, 1) of one task: pooled, the rehearsed
    0 gets -0.75; within strata the real ones get 0 and the rehearsed pair -0.5 / +0.5."""
    A, C = int(Role.ACT), int(Role.CONTEXT)
    real = [{"mode": "real"}]
    reh = [{"mode": "rehearse"}]
    assert stratum_of(real + reh) == "real" and stratum_of(reh) == "rehearsed" and stratum_of([]) == "rehearsed"

    def eps(strata: bool):
        out = [_episode("t", [C, A], r, calls=c) for r, c in ((1.0, real), (1.0, real), (0.0, reh), (1.0, reh))]
        if strata:
            for e in out:
                e.metadata["stratum"] = stratum_of(e.metadata["calls"])
        return out
    pooled, _ = compute_advantages(eps(False))
    strat, st = compute_advantages(eps(True))
    assert [a[1] for a in pooled] == [0.25, 0.25, -0.75, 0.25]
    assert [a[1] for a in strat] == [0.0, 0.0, -0.5, 0.5]
    assert st.zero_signal_frac["ACT"] == 0.5 and st.zero_std_frac["ACT"] == 0.5   # the real stratum: all 1


def test_world_reward_gated_on_act_signal():
    """gate act_signal: REHEARSE's advantage is 0 in a group whose ACT rewards are all equal (the
    rehearse arm's zero-reward seeds), untouched in a group where ACT has signal; ungated, both
    groups train REHEARSE. Hybrid: a group has ACT signal when some stratum does."""
    from fastrehearse.algo.advantages import AdvantageConfig
    from fastrehearse.train.config import load_config
    A, R, C = int(Role.ACT), int(Role.REHEARSE), int(Role.CONTEXT)

    def eps():   # group "flat": task reward 0, 0 (no ACT signal); group "live": 1, 0
        out = [_episode(t, [C, A, R, A], r) for t, r in (("flat", 0.0), ("flat", 0.0), ("live", 1.0), ("live", 0.0))]
        for e, w in zip(out, (0.9, 0.3, 0.8, 0.2)):
            e.role_rewards[R] = w
        return out
    plain, _ = compute_advantages(eps())
    gated, st = compute_advantages(eps(), AdvantageConfig(gate_rehearse_on_act=True))
    assert plain == [[0.0, 0.0, pytest.approx(0.3), 0.0], [0.0, 0.0, pytest.approx(-0.3), 0.0],
                                             [0.0, 0.5, pytest.approx(0.3), 0.5], [0.0, -0.5, pytest.approx(-0.3), -0.5]]
    assert gated == [[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0],
                                             [0.0, 0.5, pytest.approx(0.3), 0.5], [0.0, -0.5, pytest.approx(-0.3), -0.5]]
    assert st.zero_signal_frac == {"ACT": 0.5, "REHEARSE": 0.5}
    assert st.act_signal_groups == 1
    # a group where REHEARSE never acted (both calls malformed, say) carries no REHEARSE signal
    none = [_episode("m", [C, A], 0.0), _episode("m", [C, A], 1.0)]
    assert compute_advantages(none)[1].zero_signal_frac == {"ACT": 0.0, "REHEARSE": 1.0}
    # hybrid strata: ACT equal within each stratum, unequal across -> no ACT signal -> gated
    h = eps()[:2]
    h[0].metadata["stratum"], h[1].metadata["stratum"] = "real", "rehearsed"
    h[0].reward = 1.0
    ha, sh = compute_advantages(h, AdvantageConfig(gate_rehearse_on_act=True))
    assert ha[0] == [0.0] * 4 and sh.act_signal_groups == 0
    # the config key is the AdvantageConfig the trainer passes to compute_advantages
    assert load_config(None, ["algo.advantage.gate_rehearse_on_act=true"]).algo.advantage == \
        AdvantageConfig(gate_rehearse_on_act=True)
    assert not load_config(None).algo.advantage.gate_rehearse_on_act
    with pytest.raises(ValueError, match="ACT before REHEARSE"):
        compute_advantages(eps(), AdvantageConfig(gate_rehearse_on_act=True), roles=(Role.REHEARSE, Role.ACT))


def test_assign_rewards_tags_hybrid_strata_only_in_hybrid():
    task = _easy("get_balance")
    traj = _traj(task, "{}", "x", rehearsed=False)
    for mode, baseline, want in (("hybrid", "strata", True), ("hybrid", "pooled", False), ("rehearse", "strata", False)):
        e = _episode(task.id, [int(Role.ACT)], 0.0, calls=[{"mode": "real"}])
        [e] = assign_rewards([e], [traj], [task], EASY, rollout_mode=mode, hybrid_baseline=baseline)
        assert ("stratum" in e.metadata) == want


@pytest.fixture(scope="module")
def llama():
    from fastrehearse.model.loader import load_model
    from fastrehearse.rollout.text.template import ChatTemplate
    model, tok = load_model("tiny-llama")
    return model, tok, ChatTemplate(tok)


def test_trainer_rollout_assigns_the_configured_rewards(llama, monkeypatch):
    """train/rollouts.py: `rollout()` applies env.reward / algo.world_reward to the engine's
    episodes, `rollout_row` logs both rewards."""
    import functools
    import types

    from fastrehearse.rollout.text.template import assistant_text
    from _rollout_fixtures import ScriptedTurns
    from fastrehearse.train import rollouts
    from fastrehearse.train.config import load_config
    model, tok, tmpl = llama
    task = _easy("get_balance")
    aid = task.payload["required_calls"][0]["arguments"]["account_id"]
    acts = [assistant_text(task.gold[0]), "The balance is 1234.56 USD."]
    tools = [json.dumps({"account_id": aid, "balance": 1234.56, "currency": "USD"}, separators=(",", ":"))]
    monkeypatch.setattr(rollouts, "RolloutEngine", functools.partial(
        rollouts.RolloutEngine, template=tmpl, logits_processor=ScriptedTurns(tmpl, acts, tools)))
    cfg = load_config("configs/learning_tiny.yaml", ["env.reward=consistent", "algo.world_reward.mode=world",
                                                     "algo.world_reward.grounded_weight=1", "rollout.max_new_tokens=80"])
    run = types.SimpleNamespace(cfg=cfg, gen_model=model, tokenizer=tok, suite=EASY, logger=None)
    eps, metrics, failures = rollouts.rollout(run, [task], mode="rehearse", temperature=1.0, seed=0, group_size=1,
                                              measure_fidelity=True)
    assert failures == 0 and len(eps) == 1 and eps[0].metadata["stop_reason"] == "final_answer"
    for e in eps:
        assert e.reward == 1.0 and e.metadata["reward_real"] == 0.0     # faithful to its world, wrong in the real one
        g = e.metadata["fidelity"][0]["field_f1"]
        assert 0 < g < 1                                   # account_id and currency right, balance wrong
        assert e.role_rewards[int(Role.REHEARSE)] == e.metadata["world_reward"]["reward"] == pytest.approx((1 + g) / 2)
    row = rollouts.rollout_row(eps, [metrics], 1.0)
    assert row["reward"] == 1.0 and row["reward_real"] == 0.0 and row["world_grounded"] == pytest.approx(g)


def _engine_episode(task, traj, malformed: dict):
    """What the rollout engine builds from a finished row (rollout/engine/episode.py), for a row that ran
    `traj` against the builtin world."""
    from types import SimpleNamespace

    from fastrehearse.rollout.config import RolloutConfig
    from fastrehearse.rollout.engine.episode import build_episode
    p = SimpleNamespace(task=task, seed=0, input_ids=[1])
    row = SimpleNamespace(p=p, env=EASY.make_env(), error=None, traj=traj, malformed=malformed,
                          cfg=RolloutConfig(), stop_reason="final_answer",
                          turns=2, user_turns=0, cut_turns=0, call_log=[{"name": "get_balance", "mode": "rehearse"}],
                          fidelity=[], tools_changed=[], policy_log=[], ids=[1, 2, 3],
                          roles=[int(Role.CONTEXT), int(Role.ACT), int(Role.ACT)], logps=[float("nan")] * 3)
    ep = build_episode(row)
    ep.metadata["group"] = 0
    return ep


@pytest.mark.parametrize("task_reward", ["real", "consistent", "calls"])
@pytest.mark.parametrize("malformed_reward", [0.0, -0.5, None])
def test_malformed_episode_rewards_in_every_mode(task_reward, malformed_reward):
    """The trained reward (and the logged real one) of an episode with a malformed call, from the
    engine's episode through assign_rewards: malformed_reward in every mode; None scores it as any
    other episode. Two answers: right in the real world (real 1, consistent 0) and faithful to the
    rehearsed world (real 0, consistent 1); both make the required call (calls 1)."""
    task = _easy("get_balance")
    aid = task.payload["required_calls"][0]["arguments"]["account_id"]
    real = task.payload["answer"]["value"]
    resp = {"account_id": aid, "balance": 1234.56, "currency": "USD"}
    trajs = {"real_right": _traj(task, resp, f"It is {real:.2f} USD."),
             "world_right": _traj(task, resp, "The balance is 1234.56 USD.")}
    scores = {"real_right": {"real": 1.0, "consistent": 0.0, "calls": 1.0},
              "world_right": {"real": 0.0, "consistent": 1.0, "calls": 1.0}}
    for name, traj in trajs.items():
        for malformed in ({"bad_json": 1}, {}):
            ep = _engine_episode(task, traj, malformed)
            eps = assign_rewards([ep], [traj], [task], EASY, task_reward=task_reward,
                                 malformed_reward=malformed_reward)
            assert ep.reward == scores[name]["real"]      # the engine's episode: its score, unchanged
            hit = bool(malformed) and malformed_reward is not None
            want = malformed_reward if hit else scores[name][task_reward]
            want_real = malformed_reward if hit else scores[name]["real"]
            assert (eps[0].reward, eps[0].metadata["reward_real"]) == (want, want_real), (name, malformed)
