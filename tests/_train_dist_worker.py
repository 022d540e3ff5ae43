"""Worker for tests/test_train_distributed.py: one SFT update and two RL updates (token-mean, then
seq-mean-token-mean) of the trainer's own `policy_update` on fixed episodes, run alone or under torchrun (any world size / node count).

Rank 0 saves {"losses", "grads" (full, unsharded), "params_after"} to argv[1]. Further arguments
are config overrides, and `--nan-rollout-logprob=K`: rollout log-probs on every episode, one of
episode K's non-finite (the on-policy reuse decision must be taken by all ranks together).
"""
import sys

import torch

from fastrehearse.data import Episode
from fastrehearse.dtensor import full_tensor
from fastrehearse.kernels.roles import Role
from fastrehearse.train.config import load_config
from fastrehearse.algo import compute_advantages, with_advantages
from fastrehearse.train.build import setup
from fastrehearse.train.update import policy_update
from fastrehearse.train.parallelize import destroy_distributed, exit_worker, init_distributed
from fastrehearse.algo import AdvantageConfig


def episodes(vocab: int, n: int = 10) -> list[Episode]:
    """Fixed random episodes: a CONTEXT prompt, then ACT / REHEARSE / OBSERVED / ACT turns."""
    g = torch.Generator().manual_seed(1234)
    out = []
    for i in range(n):
        parts = [(Role.CONTEXT, 7 + i % 5), (Role.ACT, 4 + i % 3), (Role.REHEARSE, 3 + i % 4),
                 (Role.CONTEXT, 2), (Role.OBSERVED, 2 + i % 2), (Role.ACT, 3 + (i * 7) % 5)]
        roles = [int(r) for r, k in parts for _ in range(k)]
        ids = torch.randint(0, vocab, (len(roles),), generator=g).tolist()
        out.append(Episode(input_ids=ids, roles=roles, task_id=f"task{i // 3}",
                           reward=float(torch.rand((), generator=g) > 0.5),
                           role_rewards={int(Role.REHEARSE): float(torch.rand((), generator=g))}))
    return out


def grads(model) -> dict:
    out = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        out[name] = full_tensor(p.grad).detach().clone()
    return out


def params(model) -> dict:
    return {n: full_tensor(p).detach().clone() for n, p in model.named_parameters()}


def rollout_logprobs(eps: list[Episode], nan_episode: int | None) -> None:
    """Rollout log-probs on every token (-2.0: the HF backend's on-policy reuse path), one sampled
    token of episode `nan_episode` non-finite: only the rank that episode is packed on sees it."""
    for i, ep in enumerate(eps):
        lp = [-2.0] * len(ep.input_ids)
        if i == nan_episode:
            lp[ep.roles.index(int(Role.ACT))] = float("nan")
        ep.rollout_logprobs = lp


def main(out_path: str, *overrides: str) -> None:
    nan_ep = [o for o in overrides if o.startswith("--nan-rollout-logprob=")]
    overrides = tuple(o for o in overrides if o not in nan_ep)
    cfg = load_config("configs/smoke.yaml", ["run_dir=/tmp/_fr_dist_unused", "eval.num_tasks=0",
                                              "log.progress=false", "algo.loss.w_observed=0.5",
                                              "algo.loss.entropy_coef=0.01", "max_tokens=64",
                                              "rollout.max_episode_tokens=64", *overrides])
    info = init_distributed("cpu")
    run = setup(cfg, info)
    eps = episodes(len(run.tokenizer))
    res = {"world_size": info.world_size, "losses": [], "grads": [], "metrics": []}
    row = policy_update(run, eps, stage="sft")
    res["losses"].append(row["loss"])
    res["grads"].append(grads(run.policy))
    eps = with_advantages(eps, compute_advantages(eps, AdvantageConfig())[0])
    if nan_ep:
        rollout_logprobs(eps, int(nan_ep[0].split("=", 1)[1]))
    row = policy_update(run, eps, stage="rl")
    res["losses"].append(row["loss"])
    res["grads"].append(grads(run.policy))
    run.cfg.algo.aggregation = "seq-mean-token-mean"     # per-episode means, global episode counts
    row = policy_update(run, eps, stage="rl")
    res["losses"].append(row["loss"])
    res["grads"].append(grads(run.policy))
    res["params_after"] = params(run.policy)
    res["metrics"].append(row)
    if info.is_main:
        torch.save(res, out_path)
    destroy_distributed()


if __name__ == "__main__":
    main(*sys.argv[1:])
    exit_worker(0)   # a torchrun worker skips interpreter finalization; outside torchrun a no-op
