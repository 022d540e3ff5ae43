"""The policy update: pack a step's episodes, old / reference log-probs, the fused role-wise loss
per micro-batch (each role divided by its global token count), clipping, AdamW, and the guards
that skip (and roll back) a non-finite step."""
from __future__ import annotations

import copy
import math
import time
from dataclasses import replace

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from fastrehearse.algo import local_counts, token_weights
from fastrehearse.algo.tis import apply_tis
from fastrehearse.data import Episode
from fastrehearse.dtensor import full_tensor, local_shard
from fastrehearse.kernels import linear_logprobs
from fastrehearse.kernels.roles import Role
from fastrehearse.packing import pack

from .state import Run
from .checkpoint import Checkpointer
from .config import TrainConfig
from .errors import TrainingError
from .heads import rl_head, sft_head
from .parallelize import DistInfo, all_gather_object, any_rank, sum_over_ranks


def policy_update(run: Run, episodes: list[Episode], *, stage: str) -> dict:
    """Pack `episodes` (the same global list on every rank), then `updates_per_batch` optimizer
    steps of the fused role-wise loss (stage "rl") or of masked CE (stage "sft")."""
    cfg, info = run.cfg, run.info
    packed = pack(episodes, cfg.max_tokens, num_ranks=info.world_size, overlong="truncate_right")
    batches = [b.to(info.device) for b in (packed[info.rank] if info.distributed else packed)]
    counts = sum_over_ranks(local_counts(batches), info)            # [2, NUM_ROLES] global
    n_tokens = int(sum_over_ranks([float(sum(b.num_tokens for b in batches))], info).item())
    weights = None
    if stage == "rl" and cfg.algo.aggregation != "token-mean":
        weights = token_weights(batches, cfg.algo.aggregation, counts,
                                norm_len=cfg.algo.norm_len or cfg.rollout.engine.max_episode_tokens)
    tis_row, pg_weights = {}, None
    if stage == "rl":
        old, ref = old_and_ref_logp(run, batches)
        bad = sum(int((~torch.isfinite(t)).sum()) for t in old + [r for r in ref if r is not None])
        if any_rank(bad > 0, info):
            return skip_step(run, {"train_tokens": n_tokens}, reason=f"{bad} non-finite old/reference log-probs")
        # The packed batches keep the rollout backend's own log-probs of its samples (NaN where it
        # sampled nothing), what truncated IS compares the trainer's with (fastrehearse.algo.tis).
        rollout_lp = [b.old_logp for b in batches]
        batches = [replace(b, old_logp=o, ref_logp=r) for b, o, r in zip(batches, old, ref)]
        a = cfg.algo
        if cfg.rollout.engine.backend == "vllm" and (a.tis_cap is not None or a.tis_sequence is not None):
            pg_weights, st = apply_tis(batches, rollout_lp, a.tis_cap, a.tis_sequence, a.tis_sequence_cap)
            tis_row = _tis_over_ranks(st, info)

    out = {}
    t0 = time.perf_counter()
    for _ in range(cfg.algo.updates_per_batch if stage == "rl" else 1):
        out = _one_update(run, batches, counts, weights, stage, pg_weights)
    dt = time.perf_counter() - t0
    out.update(train_tokens=n_tokens, train_s=round(dt, 3),
               tokens_per_s=n_tokens * (cfg.algo.updates_per_batch if stage == "rl" else 1) / dt)
    for r in (Role.ACT, Role.REHEARSE, Role.OBSERVED):
        out[f"tokens_{r.name.lower()}"] = int(counts[0, int(r)].item())
    out.update(tis_row)
    return out


def _tis_over_ranks(st: dict, info: DistInfo) -> dict:
    """The truncated-IS ratio statistics of every rank: token-weighted mean and capped share, max;
    the largest |trainer - engine| log-prob gap, overall and per rank (each rank's own engine)."""
    n, mean_n, capped_n = sum_over_ranks([st["tis_tokens"], st["tis_ratio_mean"] * st["tis_tokens"],
                                          st["tis_capped_frac"] * st["tis_tokens"]], info).tolist()
    per_rank = all_gather_object((st["tis_ratio_max"], st["tis_logp_diff_max"]) if st["tis_tokens"] else None, info)
    seen = [r for r in per_rank if r is not None]
    return {"tis_ratio_mean": mean_n / n if n else 1.0,
            "tis_ratio_max": max((r[0] for r in seen), default=1.0),
            "tis_capped_frac": capped_n / n if n else 0.0,
            "tis_logp_diff_max": max((r[1] for r in seen), default=0.0),
            "tis_logp_diff_max_by_rank": [r[1] if r is not None else None for r in per_rank],
            **_seq_tis_over_ranks(st, info)}


def _seq_tis_over_ranks(st: dict, info: DistInfo) -> dict:
    """Sequence-level IS over every rank: mean log-ratio per sequence, share truncated / masked."""
    if "tis_seq_n" not in st:
        return {}
    n, lr, hit = sum_over_ranks([st["tis_seq_n"], st["tis_seq_log_ratio_sum"], st["tis_seq_affected"]], info).tolist()
    return {"tis_seq_log_ratio_mean": lr / n if n else 0.0, "tis_seq_affected_frac": hit / n if n else 0.0}


def _one_update(run: Run, batches, counts, weights, stage: str, pg_weights=None) -> dict:
    cfg, info = run.cfg, run.info
    run.policy.train()
    run.optimizer.zero_grad(set_to_none=True)
    loss_sum = 0.0
    stats = _LossStats()
    for i, b in enumerate(batches):
        if stage == "rl":
            head = rl_head(cfg, b, counts[0], None if weights is None else weights[i],
                           None if pg_weights is None else pg_weights[i])
        else:
            head = sft_head(cfg, b, counts[0])
        res = run.policy(b, head)
        res.loss.backward()
        loss_sum += float(res.loss.detach())
        stats.add(res)
    loss = float(sum_over_ranks([loss_sum], info).item())
    grad_norm = _clip_grad_norm(run.policy, cfg.optim.grad_clip)
    row = {"loss": loss, "grad_norm": grad_norm, **stats.summary(info)}
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        run.optimizer.zero_grad(set_to_none=True)
        return skip_step(run, row, reason=f"non-finite loss {loss} / grad norm {grad_norm}")
    snap = _snapshot(run) if cfg.optim.rollback_nonfinite else None
    try:
        run.optimizer.step()
        bad = sum(int(not bool(torch.isfinite(local_shard(p)).all())) for p in run.policy.parameters())
    except RuntimeError as e:   # AdamW's step size beyond float32 ("... without overflow")
        if "overflow" not in str(e):
            raise
        bad = 1
    if any_rank(bad > 0, info):
        run.optimizer.zero_grad(set_to_none=True)
        if snap is None:
            raise TrainingError(f"step {run.state.step + 1}: the update left non-finite weights and "
                                f"optim.rollback_nonfinite is off; stopping (lower optim.lr)")
        _restore(run, snap)
        return skip_step(run, row, reason=f"the update left non-finite weights (lr {run.optimizer.param_groups[0]['lr']:.3g}); rolled back")
    run.state.consecutive_skips = 0
    return row


def _snapshot(run: Run):
    """Copies of this rank's parameter shards and optimizer state, to undo one optimizer step."""
    params = [p for g in run.optimizer.param_groups for p in g["params"]]
    saved = []
    for p in params:
        st = run.optimizer.state.get(p)
        saved.append((local_shard(p).clone(),
                      None if st is None else {k: (local_shard(v).clone() if torch.is_tensor(v) else copy.deepcopy(v))
                                               for k, v in st.items()}))
    return params, saved


@torch.no_grad()
def _restore(run: Run, snap) -> None:
    params, saved = snap
    for p, (value, st) in zip(params, saved):
        local_shard(p).copy_(value)
        if st is None:
            run.optimizer.state.pop(p, None)
            continue
        cur = run.optimizer.state[p]
        for k, v in st.items():
            if torch.is_tensor(v) and torch.is_tensor(cur.get(k)):
                local_shard(cur[k]).copy_(v)
            else:
                cur[k] = v


def skip_step(run: Run, row: dict, reason: str) -> dict:
    st = run.state
    st.consecutive_skips += 1
    st.skipped_steps += 1
    run.logger.write(f"step {st.step + 1} skipped ({reason}); {st.consecutive_skips} in a row")
    if st.consecutive_skips >= run.cfg.max_consecutive_skips:
        ckpt = Checkpointer(run.cfg.run_dir, run.info).latest()
        raise TrainingError(f"{st.consecutive_skips} consecutive steps skipped (last: {reason}); "
                            f"stopping (max_consecutive_skips={run.cfg.max_consecutive_skips}). "
                            f"Lower optim.lr or check the data. Last complete checkpoint: {ckpt}")
    return {**row, "skipped": 1}



def old_and_ref_logp(run: Run, batches) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """Per micro-batch, the old log-probs of the ratio and the reference's (None without KL); the
    batches are not changed.
    old: the rollout's own log-probs when strictly on-policy (one update per batch, the HF backend,
    every sampled token has one), else one no-grad forward of the current policy. Tokens that were
    not sampled (OBSERVED, CONTEXT) have no behaviour log-prob (NaN from the rollout); they use no
    ratio, so they get 0."""
    cfg = run.cfg
    sampled = [(b.roles == int(Role.ACT)) | (b.roles == int(Role.REHEARSE)) for b in batches]
    old = [torch.where(s, b.old_logp, torch.zeros_like(b.old_logp)) for b, s in zip(batches, sampled)]
    # vLLM's log-probs are another engine's numbers: the ratio's denominator is always the trainer's
    # own (the mismatch is what truncated IS corrects). Reuse is decided by every rank together:
    # the forward below all-gathers FSDP shards, so one rank recomputing while another goes on to
    # the reference forward or the loss would pair mismatched collectives (mixed weights, a hang).
    reuse = cfg.algo.updates_per_batch == 1 and cfg.rollout.engine.backend == "hf"
    if reuse:   # the same on every rank (config), so every rank takes part in any_rank or none does
        local = all(bool(torch.isfinite(o).all()) for o in old)
        reuse = not any_rank(not local, run.info)
    if not reuse:
        old = [torch.where(s, lp, torch.zeros_like(lp))
               for s, lp in zip(sampled, compute_logprobs(run.policy, batches, cfg))]
    ref = compute_logprobs(run.ref, batches, cfg) if run.ref is not None else [None] * len(batches)
    return old, ref


@torch.no_grad()
def compute_logprobs(module: nn.Module, batches, cfg: TrainConfig) -> list[torch.Tensor]:
    """[T] log-prob of every loss-bearing target under `module` (0 elsewhere), no grad.

    An FSDP2 module is resharded afterwards: its root is wrapped with reshard_after_forward=False
    (parallelize.py), which a backward undoes, but a no-grad forward has no backward -- the
    reference's gathered root (embeddings + LM head, 2.3 GiB at 8B) would stay on every rank
    through the whole update."""
    temp = cfg.algo.loss.temperature   # == rollout.temperature (1.0 when greedy); config.validate
    module.eval()
    out = []
    for b in batches:
        out.append(module(b, lambda h, w, **head_kw: linear_logprobs(
            h, w, b.targets, mask=b.roles != 0, temperature=temp,
            backend=cfg.model.kernel_backend, **head_kw)[0]).float())
    if isinstance(module, FSDPModule):
        module.reshard()
    return out


def _clip_grad_norm(model: nn.Module, max_norm: float) -> float:
    """Global grad norm (DTensor-aware, as torchtitan) and clipping; returns the pre-clip norm."""
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return 0.0
    norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0)
    norm = full_tensor(norm)
    if max_norm > 0 and torch.isfinite(norm):
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return float(norm)


class _LossStats:
    """The kernel's per-role metrics over micro-batches and ranks: token-weighted means (ratio,
    clip fraction, KL, entropy, NLL) and sums (each role's share of the loss)."""

    def __init__(self):
        self.sums: dict[str, float] = {}

    def _add(self, key: str, v: float) -> None:
        self.sums[key] = self.sums.get(key, 0.0) + v

    def add(self, res) -> None:
        for role, d in (getattr(res, "metrics", None) or {}).items():
            n = float(d.get("tokens", 0) or 0)
            if n <= 0:
                continue
            self._add(f"{role}/n", n)
            for k, v in d.items():
                if k == "tokens" or not isinstance(v, (int, float)) or not math.isfinite(v):
                    continue
                self._add(f"{role}/{k}", float(v) if k == "loss" else float(v) * n)

    def summary(self, info: DistInfo) -> dict:
        keys = sorted(set().union(*all_gather_object(sorted(self.sums), info)))
        if not keys:
            return {}
        vals = sum_over_ranks([self.sums.get(k, 0.0) for k in keys], info)
        tot = dict(zip(keys, vals.tolist()))
        out = {}
        for k, v in tot.items():
            role, name = k.split("/", 1)
            if name == "loss":
                out[f"{role}_loss"] = v
            elif name != "n" and tot.get(f"{role}/n", 0) > 0:
                out[f"{role}_{name}"] = v / tot[f"{role}/n"]
        return out


