"""The training loop, top to bottom: (optional) SFT warm-up on gold trajectories, then role-wise GRPO.

One RL step:
  1. rollout   each rank rolls out its share of the step's tasks (group_size samples per task) with
               the rollout mode from the config (rehearse / real / hybrid); failures are counted
  2. gather    every rank gets every episode (token ids, roles, log-probs, rewards, the engine's
               small record)
  3. advantages  role-wise GRPO per (task group, role) -- identical on every rank; returned, the
               episodes are not changed
  4. pack      token-budget rows, the same number of micro-batches on every rank
  5. old log-probs  the rollout's when strictly on-policy (one update per batch), else recomputed;
               reference log-probs when the KL term is on (returned, set on new micro-batches)
  6. update    fused policy loss per micro-batch, each role divided by its GLOBAL token count, so
               gradients summed over micro-batches and ranks (FSDP2 SUM reduction) are the full-batch
               gradient at any world size; AdamW, warm-up + cosine, grad-norm clipping; a non-finite
               loss, grad norm or updated weight skips the step (the update is rolled back)
  7. metrics / checkpoint (every K steps and on SIGTERM)

Before any of it, `prepare_run_dir` refuses a run_dir that holds another run (unless --resume or
--overwrite) and, on --resume, a changed setting the checkpoint cannot honour; the suite and its
tasks are built before the model loads, so bad env settings fail in seconds.
"""
from __future__ import annotations

import signal
import time
from pathlib import Path

import numpy as np

from fastrehearse.algo import compute_advantages, with_advantages
from fastrehearse.data import Episode
from fastrehearse.rollout.backends.vllm_backend import close_shared

from . import failures
from .build import apply_optim_settings, setup
from .checkpoint import Checkpointer
from .config import TrainConfig, warnings_for
from .errors import DiskFullError, TrainingError
from .export import export_hf
from .failures import phase
from .metrics import final_table
from .parallelize import (
    DistInfo,
    all_gather_object,
    any_rank,
    destroy_distributed,
    init_distributed,
    launched_by_torchrun,
)
from .rollouts import (
    evaluate,
    release_rollout_memory,
    rollout,
    rollout_row,
    start_rollout_backend,
    sync_generation_weights,
    weight_sync_route,
)
from .run_dir import prepare_run_dir, write_run_config
from .state import Run, TrainState
from .tasks import check_prompt_lengths, gold_episode, next_tasks, step_seed
from .update import policy_update, skip_step

__all__ = ["DiskFullError", "TrainingError", "rl_step", "sft_step", "train"]


# ==============================================================================================
# Entry point


def train(cfg: TrainConfig, *, resume: bool = False, overwrite: bool = False) -> dict:
    """Run the whole recipe; returns the summary (also written to run_dir/summary.json).

    resume: continue the latest complete checkpoint in run_dir (docs/training.md says what may
    change); overwrite: replace the run run_dir holds. Without either, a run_dir holding a run is
    refused (ConfigError) before anything is written."""
    info = init_distributed(cfg.device, timeout_s=cfg.dist.timeout_s)
    failures.start(info.rank, info.world_size, cfg.dist.timeout_s, launched_by_torchrun())
    previous = signal.getsignal(signal.SIGTERM)
    ok = False
    try:
        summary = _train(cfg, info, resume, overwrite)
        ok = True
        return summary
    except Exception as e:
        # Say where it failed (the store, not a collective); a rank whose collective broke because
        # a peer failed first names that peer instead of its own symptom (failures.py).
        failures.report(e)
        peer = failures.peer_failure(e)
        if peer:
            raise failures.PeerFailed(peer) from e
        raise
    finally:
        failures.stop()
        close_shared()   # the vLLM instance, if any: its engine processes stop before this returns
        _restore_sigterm(previous)
        destroy_distributed(sync=ok)


def _train(cfg: TrainConfig, info: DistInfo, resume: bool, overwrite: bool) -> dict:
    t_start = time.perf_counter()
    notes = prepare_run_dir(cfg, info, resume=resume, overwrite=overwrite)
    run = setup(cfg, info)
    if cfg.steps > 0 or cfg.sft.source == "own_rehearsals":   # steps that sample rollouts
        notes += check_prompt_lengths(cfg, run.suite, run.train_tasks, run.tokenizer)
    for n in notes + warnings_for(cfg):
        run.logger.write(n)
    run.backend_startup_s = start_rollout_backend(run)   # vLLM: started now, not in the first rollout
    ckpt = Checkpointer(cfg.run_dir, info, keep=cfg.checkpoint.keep)
    resumed_at = None
    if resume:
        had_any = bool(ckpt.complete())
        with phase("resume"):
            path, st = ckpt.load_latest(run.policy, run.optimizer, log=run.logger.write)
        if path is None and had_any:
            raise TrainingError(f"--resume: no checkpoint in {ckpt.root} could be loaded (see above); "
                                f"config.yaml and metrics.jsonl were left as they were")
        if path is None:
            run.logger.write(f"--resume: no complete checkpoint in {ckpt.root}; starting from scratch")
        else:
            run.state = TrainState(**st)
            apply_optim_settings(run)
            sync_generation_weights(run)
            resumed_at = run.state.step
            if run.state.best:
                ckpt.pinned = Path(run.state.best["checkpoint"])
            run.logger.write(f"resumed from {path} (step {run.state.step}); lr now "
                             f"{run.scheduler.get_last_lr()[0]:.4g}")
            note = ckpt.numerics_note(path)
            if note:
                run.logger.write(note)
    write_run_config(run, resumed_at)
    _install_sigterm(run)

    if run.state.eval_before is None and cfg.eval.before:
        with phase("eval"):
            run.state.eval_before = evaluate(run, tag="before")
    sft_steps, total = cfg.sft.steps, cfg.sft.steps + cfg.steps
    # checkpoint.every counts from the first step that samples rollouts: an own_rehearsals run's
    # SFT steps are as long as RL steps and as worth keeping
    ckpt_from = 0 if cfg.sft.source == "own_rehearsals" else sft_steps
    run.logger.set_progress(run.state.step, total=total)

    saved_at = None
    while run.state.step < total:
        step = run.state.step
        if step < sft_steps:
            row = sft_step(run)
        else:
            if step == sft_steps and sft_steps > 0:
                run.optimizer.state.clear()   # SFT's Adam moments do not describe RL gradients
            row = rl_step(run)
        run.state.step += 1
        run.scheduler.step()
        row.update(step=run.state.step, lr=run.scheduler.get_last_lr()[0])
        run.logger.log(row)
        stop = _agree_to_stop(run)
        new_best = False
        if not stop and cfg.eval.every and run.state.step % cfg.eval.every == 0:
            with phase("eval"):
                new_best = periodic_eval(run, ckpt)
        every = cfg.checkpoint.every
        if stop or new_best or (every and run.state.step >= ckpt_from and run.state.step % every == 0):
            with phase("checkpoint"):
                save_checkpoint(run, ckpt)
            saved_at = run.state.step
        if stop:
            run.logger.write(f"SIGTERM: checkpoint saved at step {run.state.step}; exiting")
            run.logger.close()
            return {"interrupted": True, "step": run.state.step}

    if cfg.checkpoint.at_end and saved_at != run.state.step and not (
            cfg.checkpoint.every and run.state.step % cfg.checkpoint.every == 0 and run.state.step >= ckpt_from):
        with phase("checkpoint"):
            save_checkpoint(run, ckpt)
    with phase("eval"):
        after = evaluate(run, tag="after") if cfg.eval.after else {}
    last = ckpt.latest()
    if (cfg.eval.every and after and last is not None and last.name == f"step_{run.state.step:08d}"
            and (run.state.best is None or after["success"] > run.state.best["success"])):
        run.state.best = {"step": run.state.step, "success": after["success"], "checkpoint": str(last)}
    export_dir = None
    if cfg.checkpoint.export:
        with phase("export"):
            export_dir = export_hf(run.policy, run.hf_model, run.tokenizer, Path(cfg.run_dir) / "export",
                                   info)
    summary = _summary(run, after, time.perf_counter() - t_start, export_dir, last)
    run.logger.close()
    if info.is_main:
        final_table(summary, cfg.run_dir)
    return summary



def step_rollouts(run: Run) -> tuple[list[Episode], dict]:
    """1. rollout: this rank's share of the step's tasks; 2. gather: every rank sees every episode
    (rank order, deterministic). Returns the step's episodes (all ranks') and its rollout metrics."""
    cfg, info, st = run.cfg, run.info, run.state
    tasks = next_tasks(run.train_tasks, st.rl_cursor, cfg.rollout.tasks_per_step, cfg.seed)
    st.rl_cursor += cfg.rollout.tasks_per_step
    mine = tasks[info.rank::info.world_size]
    t0 = time.perf_counter()
    with phase("rollout"):
        episodes, rmetrics, n_failed = rollout(run, mine, mode=cfg.rollout.engine.mode,
                                               temperature=cfg.rollout.engine.temperature,
                                               seed=step_seed(cfg.seed, st.step, info.rank),
                                               group_size=cfg.rollout.group_size,
                                               measure_fidelity=cfg.rollout.engine.measure_fidelity)
        rollout_s = time.perf_counter() - t0
        gathered = all_gather_object((episodes, rmetrics, n_failed), info)
    episodes = [e for eps, _, _ in gathered for e in eps]
    n_failed = sum(f for _, _, f in gathered)
    st.rollout_failures += n_failed
    row = {"rollout_failures": n_failed, "rollout_s": round(rollout_s, 3)}
    row.update(rollout_row(episodes, [m for _, m, _ in gathered], rollout_s))
    return episodes, row


def rl_step(run: Run) -> dict:
    cfg, info = run.cfg, run.info
    episodes, rollout_metrics = step_rollouts(run)
    row = {"stage": "rl", **rollout_metrics}
    n_failed = row["rollout_failures"]
    if len(episodes) < info.world_size:   # packing needs one episode per rank
        return skip_step(run, row, reason=f"only {len(episodes)} episodes for {info.world_size} ranks "
                                      f"({n_failed} rollout failures)")
    # 3. role-wise GRPO advantages (groups = task ids)
    advantages, stats = compute_advantages(episodes, cfg.algo.advantage)
    # Groups (or hybrid strata) whose ACT advantages are all 0 -- equal rewards, or one episode --
    # carry no signal; the same for the world model's REHEARSE.
    row["zero_signal_groups"] = stats.zero_signal_frac.get("ACT", 0.0)
    row["zero_signal_groups_rehearse"] = stats.zero_signal_frac.get("REHEARSE", 0.0)
    # 4-6. pack, old/ref log-probs, update; the rollout engine's memory is the update's meanwhile
    release_rollout_memory(run)
    with phase("update"):
        row.update(policy_update(run, with_advantages(episodes, advantages), stage="rl"))
        row.update(sync_generation_weights(run))
    return row


def sft_step(run: Run) -> dict:
    """One CE step on gold trajectories (every rank builds the same global list; packing splits
    it). Gold tool responses are real ones: role OBSERVED, the world model's supervised target."""
    cfg = run.cfg
    if cfg.sft.source == "own_rehearsals":
        return own_rehearsals_step(run)
    gold = [t for t in run.train_tasks if t.gold]   # non-empty: checked by build_tasks before loading
    tasks = next_tasks(gold, run.state.sft_cursor, cfg.sft.tasks_per_step, cfg.seed + 1)
    run.state.sft_cursor += cfg.sft.tasks_per_step
    episodes = [gold_episode(run, t) for t in tasks]
    row = {"stage": "sft"}
    with phase("update"):
        row.update(policy_update(run, episodes, stage="sft"))
        row.update(sync_generation_weights(run))
    return row



def periodic_eval(run: Run, ckpt: Checkpointer) -> bool:
    """eval.every: the held-out eval now (all ranks, as the final one), one metrics row (stage
    "eval"); True when its success beats every earlier one (strictly), which makes this step's
    checkpoint the best: recorded in the state and pinned against rotation (the caller saves it)."""
    st = run.state
    res = evaluate(run, tag=f"step {st.step}")
    run.logger.log({"stage": "eval", "step": st.step, "eval_success": res["success"],
                    "eval_fidelity": res["fidelity"], "eval_n": res["n"], "eval_errors": res["errors"],
                    "eval_s": res["seconds"]}, advance=False)
    if st.best is not None and not res["success"] > st.best["success"]:
        return False
    st.best = {"step": st.step, "success": res["success"],
               "checkpoint": str(ckpt.root / f"step_{st.step:08d}")}
    ckpt.pinned = Path(st.best["checkpoint"])
    return True


def own_rehearsals_step(run: Run) -> dict:
    """sft.source own_rehearsals (rejection-sampling SFT, the Sr control): the RL step's rollout
    (same task stream, cursor and step seed), then CE on the ACT and REHEARSE tokens of the episodes
    whose env.reward (consistent, checked by the config) is 1."""
    cfg, info = run.cfg, run.info
    episodes, rollout_metrics = step_rollouts(run)
    row = {"stage": "sft", "source": "own_rehearsals", **rollout_metrics}
    kept = [e for e in episodes if e.reward >= 1.0]
    row["kept_episodes"], row["kept_frac"] = len(kept), len(kept) / max(1, len(episodes))
    if len(kept) < info.world_size:   # packing needs one episode per rank
        return skip_step(run, row, reason=f"{len(kept)} of {len(episodes)} own rehearsed episodes pass "
                                          f"{cfg.env.reward!r}: nothing to train on")
    release_rollout_memory(run)
    with phase("update"):
        row.update(policy_update(run, kept, stage="sft"))
        row.update(sync_generation_weights(run))
    return row


def save_checkpoint(run: Run, ckpt: Checkpointer) -> None:
    run.state.scheduler = run.scheduler.state_dict()
    state = {k: getattr(run.state, k) for k in TrainState.__dataclass_fields__}
    path = ckpt.save(run.state.step, run.policy, run.optimizer, state, config_text=run.config_text)
    run.logger.write(f"checkpoint: {path}")



def _install_sigterm(run: Run) -> None:
    def handler(signum, frame):
        run.stop_requested = True
    try:
        signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread (e.g. called from a worker thread in tests)
        pass


def _restore_sigterm(previous) -> None:
    try:
        signal.signal(signal.SIGTERM, previous)
    except (ValueError, TypeError):
        pass


def _agree_to_stop(run: Run) -> bool:
    """All ranks stop together when any of them got SIGTERM."""
    return any_rank(run.stop_requested, run.info)


def _summary(run: Run, after: dict, wall_s: float, export_dir, last_checkpoint=None) -> dict:
    before = run.state.eval_before or {}
    rows = [r for r in run.logger.rows if r.get("stage") == "rl"] if run.info.is_main else []
    tps = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r]
    rtps = [r["rollout_tokens_per_s"] for r in rows if "rollout_tokens_per_s" in r]
    return {
        "model": run.cfg.model.spec, "suite": run.cfg.env.suite,
        "n_eval": after.get("n", before.get("n")),
        "success_before": before.get("success"), "success_after": after.get("success"),
        "fidelity_before": before.get("fidelity"), "fidelity_after": after.get("fidelity"),
        "train_tokens_per_s": float(np.median(tps)) if tps else None,
        "rollout_tokens_per_s": float(np.median(rtps)) if rtps else None,
        "wall_s": wall_s, "steps": run.state.step, "skipped_steps": run.state.skipped_steps,
        "rollout_failures": run.state.rollout_failures, "world_size": run.info.world_size,
        "backend": run.cfg.rollout.engine.backend, "backend_startup_s": run.backend_startup_s,
        "weight_sync_route": weight_sync_route(run),
        "export_dir": str(export_dir) if export_dir else None,
        "last_checkpoint": str(last_checkpoint) if last_checkpoint else None,
        # eval.every: the checkpoint whose held-out success was the best (step, success, path)
        "best_checkpoint": run.state.best,
    }
