"""sft.source own_rehearsals (the Sr control): each step samples episodes as an RL step would, keeps
those passing env.reward (consistent), and trains CE on their ACT and REHEARSE tokens."""
import pytest

import fastrehearse.train.loop as loop
from fastrehearse.data import Episode
from fastrehearse.kernels.roles import Role
from fastrehearse.train.config import ConfigError, load_config

BASE = ["seed=0", "log.progress=false", "eval.num_tasks=0", "eval.before=false", "eval.after=false",
        "checkpoint.at_end=false", "checkpoint.export=false", "checkpoint.every=0", "env.reward=consistent"]


def _fake_rollout(calls):
    """Episodes with ACT and REHEARSE tokens, rewards 1, 0, 1, 0, ...; records what was asked."""
    def fake(run, tasks, *, mode, temperature, seed, group_size, measure_fidelity):
        calls.append(([t.id for t in tasks], seed, mode, group_size))
        ids = run.tokenizer("The balance is 12.50 USD.").input_ids
        eps = []
        for i, t in enumerate(tasks * group_size):
            roles = [int(Role.CONTEXT)] * 3 + [int(Role.ACT)] * (len(ids) - 6) + [int(Role.REHEARSE)] * 3
            eps.append(Episode(input_ids=list(ids), roles=roles, task_id=t.id, reward=float(i % 2 == 0),
                               rollout_logprobs=[0.0] * len(ids)))
        return eps, {}, 0
    return fake


def test_own_rehearsals_keeps_passing_episodes_and_trains_act_and_rehearse(tmp_path, monkeypatch):
    calls, updates = [], []
    monkeypatch.setattr(loop, "rollout", _fake_rollout(calls))
    real_update = loop.policy_update

    def spy(run, episodes, *, stage):
        row = real_update(run, episodes, stage=stage)
        updates.append((stage, [e.reward for e in episodes], row))
        return row
    monkeypatch.setattr(loop, "policy_update", spy)
    cfg = load_config("configs/smoke.yaml", BASE + [f"run_dir={tmp_path / 'sr'}", "steps=0", "sft.steps=2",
                                                     "sft.source=own_rehearsals", "checkpoint.every=1"])
    loop.train(cfg)
    assert len(updates) == 2
    # its steps sample rollouts like RL steps, so checkpoint.every applies to them
    assert sorted(p.name for p in (tmp_path / "sr" / "checkpoints").iterdir()) == ["step_00000001", "step_00000002"]
    for stage, rewards, row in updates:
        # 2 tasks x group 2 = 4 episodes, rewards 1, 0, 1, 0: the two passing ones are trained on
        assert stage == "sft" and rewards == [1.0, 1.0]
        assert row["tokens_act"] > 0 and row["tokens_rehearse"] > 0 and row["grad_norm"] > 0
    # the same tasks, step seeds, mode and group size as the RL arm's steps
    rl_calls = []
    monkeypatch.setattr(loop, "rollout", _fake_rollout(rl_calls))
    cfg = load_config("configs/smoke.yaml", BASE + [f"run_dir={tmp_path / 'rl'}", "steps=2", "sft.steps=0"])
    loop.train(cfg)
    assert calls == rl_calls and calls[0][2] == "rehearse" and calls[0][1] != calls[1][1]


def test_own_rehearsals_config_refusals():
    for extra, key in ((["rollout.mode=real"], "rollout.mode"), (["env.reward=real"], "env.reward"),
                       (["sft.source=mine"], "sft.source")):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config("configs/smoke.yaml", BASE + ["sft.source=own_rehearsals", *extra])
