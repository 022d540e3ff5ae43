"""Rollouts and evaluation inside a training run: this rank's episodes for a step (a failing batch
retried task by task), the held-out evaluation (the code of `fastrehearse eval`), and keeping the
generation model in step with the trained weights."""
from __future__ import annotations

import time
from dataclasses import replace

from fastrehearse.algo.rewards import assign_rewards, reward_row
from fastrehearse.data import Episode
from fastrehearse.eval.runner import EvalSettings, MemoryStore, evaluate_items
from fastrehearse.rollout.backends.vllm_backend import VLLMStartError, shared_backend
from fastrehearse.rollout.engine.engine import RolloutEngine
from fastrehearse.rollout.engine.policy import ModelPolicy

from .state import Run
from .errors import TrainingError
from .model_init import serving_dtype, sync_generation_model
from .parallelize import all_gather_object


def rollout(run: Run, tasks, *, mode: str, temperature: float, seed: int, group_size: int,
            measure_fidelity: bool) -> tuple[list[Episode], dict, int]:
    """Episodes for `tasks` on this rank, with the count of failures. An engine exception on the
    batch is retried task by task; a task that still fails, and an episode that could not run or be
    scored to its end (metadata "error": its reward is not a result), are failures: logged, counted,
    never trained on."""
    if not tasks:
        return [], {}, 0
    ecfg = replace(run.cfg.rollout.engine, mode=mode, measure_fidelity=measure_fidelity, temperature=temperature)
    engine = RolloutEngine(run.gen_model, run.tokenizer, ecfg)
    run.gen_model.eval()
    try:
        res = engine.rollout(tasks, run.suite, group_size=group_size, seed=seed)
    except VLLMStartError as e:   # no task can run: stop (the last checkpoint stays)
        raise TrainingError(f"rollout: {e}; --resume continues from the last complete checkpoint") from None
    except Exception as e:  # noqa: BLE001 - any engine bug: isolate the failing task(s)
        run.logger.write(f"rollout failed on a batch of {len(tasks)} tasks ({type(e).__name__}: {e}); "
                         f"retrying one task at a time")
    else:
        # outside the retry: a reward bug is not an engine failure
        episodes, errors = _without_errors(run, _rewards(run, res, tasks, mode))
        return episodes, res.metrics, errors
    episodes, parts, failures = [], [], 0
    for i, t in enumerate(tasks):
        try:
            res = engine.rollout([t], run.suite, group_size=group_size, seed=seed * 1000 + i)
        except VLLMStartError as e:
            raise TrainingError(f"rollout: {e}; --resume continues from the last complete checkpoint") from None
        except Exception as e:  # noqa: BLE001
            failures += 1
            run.logger.write(f"rollout failed for task {t.id}: {type(e).__name__}: {e}")
            continue
        kept, errors = _without_errors(run, _rewards(run, res, [t], mode))
        episodes += kept
        failures += errors
        parts.append(res.metrics)
    return episodes, merge_metrics(parts), failures


def _without_errors(run: Run, episodes: list[Episode]) -> tuple[list[Episode], int]:
    bad = [e for e in episodes if e.metadata.get("error")]
    for e in bad:
        run.logger.write(f"episode of task {e.task_id} not trained on (could not run or be scored: "
                         f"{e.metadata['error']})")
    return [e for e in episodes if not e.metadata.get("error")], len(bad)


def merge_metrics(parts: list[dict]) -> dict:
    """The rollout metrics of several engine calls as one: counts (ints, and dicts of counts) and
    wall_s are summed; rates and means, which do not add, are left out rather than reported for
    one call only."""
    out: dict = {}
    for m in parts:
        for k, v in m.items():
            if isinstance(v, bool):
                continue
            if isinstance(v, int) or k == "wall_s":
                out[k] = out.get(k, 0) + v
            elif isinstance(v, dict) and all(isinstance(x, int) and not isinstance(x, bool)
                                             for x in v.values()):
                d = out.setdefault(k, {})
                for kk, x in v.items():
                    d[kk] = d.get(kk, 0) + x
    return out


def _rewards(run: Run, res, tasks, mode: str) -> list[Episode]:
    """The engine's episodes with their training rewards per role (fastrehearse.algo.rewards:
    env.reward, rollout.malformed_reward, algo.world_reward, algo.hybrid_baseline)."""
    c = run.cfg
    return assign_rewards(res.episodes, res.trajectories, tasks, run.suite, task_reward=c.env.reward,
                          world=c.algo.world_reward, rollout_mode=mode,
                          malformed_reward=c.rollout.malformed_reward, hybrid_baseline=c.algo.hybrid_baseline)


def evaluate(run: Run, *, tag: str) -> dict:
    """Held-out success (eval.mode, greedy by default) and world-model fidelity, over all ranks,
    computed by the evaluation code of `fastrehearse eval` (fastrehearse.eval.runner): the same
    checkpoint, items, limits and seed give the same per-item numbers as
    `fastrehearse eval --max-turns <rollout.max_turns> --max-new-tokens <rollout.max_new_tokens>
    --max-episode-tokens <rollout.max_episode_tokens> --on-max-new-tokens <rollout.on_max_new_tokens>
    --seed <seed>`. A task that could not run is
    an error, never a 0; when none could run the eval (and the run) stops with TrainingError."""

    cfg, info = run.cfg, run.info
    if not run.eval_tasks:
        return {}
    mine = run.eval_tasks[info.rank::info.world_size]
    t0 = time.perf_counter()
    # every engine field of the run's rollout config (on_max_new_tokens included), eval's own
    # temperature and mode: the one builder the CLI's settings share (fastrehearse.eval.runner)
    settings = EvalSettings.from_rollout(cfg.rollout.engine, seed=cfg.seed, fidelity=cfg.eval.fidelity,
                                         temperature=cfg.eval.temperature, mode=cfg.eval.mode)
    run.gen_model.eval()
    store = MemoryStore()
    evaluate_items([(cfg.env.eval_split, t) for t in mine], lambda c: run.suite.make_env(), run.gen_model,
                   run.tokenizer, ModelPolicy(), store, settings)
    local = [(r.score, r.error, (r.fidelity or {}).get("field_f1"), int((r.fidelity or {}).get("calls", 0)))
             for r in store.items()]
    rows = [x for part in all_gather_object(local, info) for x in part]
    scores = [s for s, e, _, _ in rows if e is None]
    errors = [e for _, e, _, _ in rows if e is not None]
    calls = sum(c for s, e, f, c in rows if e is None and f is not None)
    f1 = sum(f * c for s, e, f, c in rows if e is None and f is not None)
    out = {"success": sum(scores) / len(scores) if scores else float("nan"), "n": len(scores),
           "errors": len(errors), "fidelity": f1 / calls if calls else float("nan"), "fidelity_n": calls,
           "seconds": round(time.perf_counter() - t0, 2)}
    if not scores:
        raise TrainingError(f"eval {tag}: none of the {len(rows)} held-out tasks could run "
                            f"(first error: {errors[0] if errors else 'none'})")
    run.logger.write(f"eval {tag}: success {out['success']:.3f} on {out['n']} held-out tasks, "
                     f"fidelity {out['fidelity']:.3f} ({out['fidelity_n']} rehearsed calls)"
                     + (f"; {len(errors)} task(s) could not run (not scored): {errors[0]}" if errors else ""))
    return out



def start_rollout_backend(run: Run) -> float:
    """rollout.backend=vllm: start this rank's vLLM engine, in this process on this rank's device,
    on the generation model now (not in the first step's rollout); its start-up seconds (0 for hf).
    Refusals (vLLM missing, a KV cache too small) are one-line TrainingErrors."""
    if run.cfg.rollout.engine.backend != "vllm":
        return 0.0
    try:
        b = _vllm(run)
    except (VLLMStartError, ValueError) as e:
        raise TrainingError(f"rollout.backend=vllm: {e}") from None
    run.logger.write(f"vLLM engine started in {b.startup_s:.1f} s, in process on rank {run.info.rank} "
                     f"({run.info.device}, serving {str(b.dtype).replace('torch.', '')})")
    return b.startup_s


def _vllm(run: Run):
    dtype = serving_dtype(run.cfg, run.info.device)
    return shared_backend(run.gen_model, run.tokenizer, run.cfg.rollout.engine, dtype=dtype)


def weight_sync_route(run: Run) -> str:
    """How the trained weights reach the rollout model (summary.json `weight_sync_route`)."""
    if run.cfg.rollout.engine.backend == "vllm":
        return "vllm in-process reload, parameter by parameter from the trainer's shards (no file)"
    if run.gen_model is not run.hf_model:
        return "copy into the unsharded generation model, parameter by parameter"
    return "none (the HF backend decodes with the trained module itself)"


def release_rollout_memory(run: Run) -> None:
    """After a step's rollouts, before its update: the vLLM engine frees its weights and KV cache
    (CUDA sleep mode; nothing on the CPU). The next sync_generation_weights wakes it."""
    if run.cfg.rollout.engine.backend == "vllm":
        _vllm(run).release()


def sync_generation_weights(run: Run) -> dict:
    """Bring the rollout model up to the updated weights: with rollout.backend=vllm, stream them
    into the vLLM engine (fastrehearse.rollout.backends.vllm_backend: one full parameter at a time, gathered
    from the shards, collective); with hf in a sharded run, copy them into the unsharded generation
    model. Returns metrics.jsonl's `weight_sync_s` and, when weights moved, `weight_sync_bytes`."""
    t0 = time.perf_counter()
    row = {}
    if run.cfg.rollout.engine.backend == "vllm":
        b = _vllm(run)
        b.sync_weights(run.hf_model)
        row["weight_sync_bytes"] = b.last_sync_bytes
    elif run.gen_model is not run.hf_model:
        sync_generation_model(run.policy, run.hf_model, run.gen_model)   # one whole tensor at a time
        row["weight_sync_bytes"] = sum(p.numel() * p.element_size() for p in run.gen_model.parameters())
    row["weight_sync_s"] = round(time.perf_counter() - t0, 3)
    return row



def rollout_row(episodes: list[Episode], metrics: list[dict], rollout_s: float) -> dict:
    row = {"episodes": len(episodes)}
    if episodes:
        row["reward"] = sum(e.reward for e in episodes) / len(episodes)
        row["episode_tokens"] = sum(len(e) for e in episodes) / len(episodes)
        row["malformed_frac"] = sum(1 for e in episodes if e.metadata.get("malformed")) / len(episodes)
    fid = [s["field_f1"] for e in episodes for s in e.metadata.get("fidelity", [])]
    if fid:
        row["fidelity"] = sum(fid) / len(fid)
    row.update(reward_row(episodes))     # reward_real, world-model reward terms, hybrid strata
    tok = sum(m.get("prefill_tokens", 0) + m.get("decode_tokens", 0) for m in metrics if m)
    if rollout_s > 0 and tok:
        row["rollout_tokens_per_s"] = tok / rollout_s
    return row


