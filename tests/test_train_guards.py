"""Guards of the loop: non-finite steps are skipped (not applied) and N in a row stop training with
a clear error; rollout failures are counted, not fatal; the LR schedule; the task stream."""
import dataclasses
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _train_dist_worker import episodes  # noqa: E402

from fastrehearse.train.build import LRSchedule, setup  # noqa: E402
from fastrehearse.train.errors import TrainingError  # noqa: E402
from fastrehearse.train.rollouts import rollout  # noqa: E402
from fastrehearse.train.tasks import next_tasks  # noqa: E402
from fastrehearse.train.update import policy_update  # noqa: E402
from fastrehearse.train.config import load_config  # noqa: E402
from fastrehearse.train.parallelize import init_distributed  # noqa: E402


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("guards")
    cfg = load_config("configs/smoke.yaml", [f"run_dir={d}", "eval.num_tasks=0", "max_tokens=64",
                                             "rollout.max_episode_tokens=64", "max_consecutive_skips=2"])
    return setup(cfg, init_distributed("cpu"))


def test_nonfinite_steps_are_skipped_then_stop(run):
    eps = episodes(len(run.tokenizer))
    norm = run.hf_model.model.norm.weight
    saved = norm.detach().clone()
    with torch.no_grad():
        norm[0] = float("nan")                     # every hidden state -> NaN loss
    before = {n: p.detach().clone() for n, p in run.policy.named_parameters()}
    row = policy_update(run, eps, stage="sft")
    assert row["skipped"] == 1 and row["loss"] != row["loss"]
    for n, p in run.policy.named_parameters():     # nothing applied (NaN compares unequal: nan_to_num)
        assert torch.equal(torch.nan_to_num(p), torch.nan_to_num(before[n])), n
    with pytest.raises(TrainingError, match="2 consecutive steps skipped.*max_consecutive_skips=2"):
        policy_update(run, eps, stage="sft")
    with torch.no_grad():
        norm.copy_(saved)
    run.state.consecutive_skips = 0
    row = policy_update(run, eps, stage="sft")   # healthy again: applied, counter reset
    assert "skipped" not in row and run.state.consecutive_skips == 0 and run.state.skipped_steps == 2


def test_rollout_failures_are_counted_not_fatal(run, monkeypatch):
    from fastrehearse.rollout.engine import engine as eng
    real = eng.RolloutEngine.rollout
    bad = run.train_tasks[1].id

    def flaky(self, tasks, envs, **kw):
        if any(t.id == bad for t in tasks):
            raise RuntimeError("simulated engine crash")
        return real(self, tasks, envs, **kw)
    monkeypatch.setattr(eng.RolloutEngine, "rollout", flaky)
    eps, metrics, failures = rollout(run, run.train_tasks[:3], mode="rehearse", temperature=1.0, seed=0,
                                     group_size=2, measure_fidelity=False)
    assert failures == 1 and len(eps) == 4
    assert {e.task_id for e in eps} == {run.train_tasks[0].id, run.train_tasks[2].id}
    # the metrics of the task-by-task retry add up over the tasks that ran (not the last one's)
    assert metrics["episodes"] == 4
    assert metrics["decode_tokens"] == sum(sum(1 for r in e.roles if r in (1, 2)) for e in eps)
    assert "tokens_per_s" not in metrics          # a rate of one call is not the retry's rate


def test_episode_that_could_not_be_scored_is_not_trained_on(run, monkeypatch):
    """An episode whose env crashed or whose score failed has reward 0 and metadata["error"]: a
    failure, counted and dropped, never a training reward of 0."""
    from fastrehearse.rollout.engine import engine as eng
    real = eng.RolloutEngine.rollout

    def scoring_crash(self, tasks, envs, **kw):
        res = real(self, tasks, envs, **kw)
        res.episodes[0].metadata["error"] = "score: RuntimeError: evaluator crashed"
        return res
    monkeypatch.setattr(eng.RolloutEngine, "rollout", scoring_crash)
    eps, _, failures = rollout(run, run.train_tasks[:2], mode="rehearse", temperature=1.0, seed=0,
                               group_size=2, measure_fidelity=False)
    assert failures == 1 and len(eps) == 3 and not any(e.metadata.get("error") for e in eps)


def test_lr_schedule_and_task_stream():
    cfg = load_config("configs/smoke.yaml", ["sft.steps=2", "sft.lr=1e-3", "sft.warmup_steps=2",
                                             "steps=10", "optim.lr=1e-4", "optim.warmup_steps=2",
                                             "optim.min_lr_ratio=0.1"])
    f = LRSchedule(cfg)
    assert [round(f(s), 6) for s in range(4)] == [5.0, 10.0, 0.5, 1.0]   # x optim.lr
    rl = [f(s) for s in range(4, 12)]                                    # cosine, decreasing
    assert all(a > b for a, b in zip(rl, rl[1:])) and rl[-1] > 0.1
    assert f(12) == pytest.approx(0.1) and f(50) == pytest.approx(0.1)   # floor after the last step
    tasks = list(range(5))
    stream = next_tasks(tasks, 0, 10, seed=3)
    assert sorted(stream[:5]) == tasks and sorted(stream[5:]) == tasks   # each epoch a permutation
    assert next_tasks(tasks, 4, 3, seed=3) == stream[4:7]           # cursor resumes exactly


def test_sft_without_gold_is_refused_before_the_model_loads(tmp_path, monkeypatch):
    """sft.steps > 0 on a split without gold trajectories: a ConfigError naming the key from
    build_tasks, before any weights load (not at the first SFT step, after the load)."""
    from fastrehearse.envs.builtin.suite import BuiltinSuite
    from fastrehearse.train import model_init
    from fastrehearse.train.config import ConfigError
    from fastrehearse.train.loop import train
    real = BuiltinSuite.tasks

    def no_gold(self, split, limit=None):
        return [dataclasses.replace(t, gold=None) for t in real(self, split, limit)]
    monkeypatch.setattr(BuiltinSuite, "tasks", no_gold)
    monkeypatch.setattr(model_init, "load_whole", lambda cfg: pytest.fail("the model loaded first"))
    cfg = load_config("configs/smoke.yaml", [f"run_dir={tmp_path}", "sft.steps=2"])
    with pytest.raises(ConfigError, match=r"'sft.steps' = 2: no task of env.train_split 'train' has a gold"):
        train(cfg)


def test_prompt_length_warning_goes_to_the_run_log(run):
    """Some (not all) prompts fill max_episode_tokens: the warning is returned for the run's logger
    (it was a bare print); none: nothing."""
    from fastrehearse.rollout.text.template import ChatTemplate
    from fastrehearse.train.tasks import check_prompt_lengths
    cfg, tasks, tmpl = run.cfg, run.train_tasks[:16], ChatTemplate(run.tokenizer)
    lens = []
    for t in tasks:
        env = run.suite.make_env()
        r = env.reset(t)
        env.close()
        lens.append(len(tmpl.render(list(r.messages), r.tools, add_generation_prompt=True).input_ids))
    assert min(lens) < max(lens)
    saved = cfg.rollout.engine.max_episode_tokens
    try:
        cfg.rollout.engine.max_episode_tokens = max(lens)
        got = check_prompt_lengths(cfg, run.suite, tasks, run.tokenizer)
        assert len(got) == 1 and got[0].startswith("warning: ") and "nothing would be generated" in got[0]
        cfg.rollout.engine.max_episode_tokens = max(lens) + 1
        assert check_prompt_lengths(cfg, run.suite, tasks, run.tokenizer) == []
    finally:
        cfg.rollout.engine.max_episode_tokens = saved


def test_old_and_ref_logp_are_returned_and_the_batches_left_unchanged(run):
    """The update's old log-probs come back from `old_and_ref_logp`; the packed batches keep the
    rollout's (what truncated IS compares with). Without rollout log-probs they are one forward
    of the policy on sampled tokens, 0 elsewhere; no reference without KL."""
    from fastrehearse.packing import pack
    from fastrehearse.train.update import compute_logprobs, old_and_ref_logp
    batches = pack(episodes(len(run.tokenizer)), run.cfg.max_tokens, overlong="truncate_right")
    given = [b.old_logp.clone() for b in batches]
    old, ref = old_and_ref_logp(run, batches)
    assert ref == [None] * len(batches)
    for b, g in zip(batches, given):
        assert torch.equal(b.old_logp.isnan(), g.isnan()) and b.old_logp.isnan().all() and b.ref_logp is None
    for b, o, lp in zip(batches, old, compute_logprobs(run.policy, batches, run.cfg)):
        sampled = (b.roles == 1) | (b.roles == 2)
        assert torch.equal(o, torch.where(sampled, lp, torch.zeros_like(lp))) and sampled.any()
