"""Episode and metrics assembly: a finished row -> `Episode` (reward, metadata), a batch -> metrics."""
from __future__ import annotations

from collections import Counter

from fastrehearse.data import Episode
from fastrehearse.kernels.roles import Role
from fastrehearse.rollout.engine.fidelity import FidelityScore, aggregate
from fastrehearse.rollout.engine.row import Row


def build_episode(row: Row) -> Episode:
    """The row's tokens, roles and rollout log-probs, its score (`env.score`, whatever the calls
    were: metadata["malformed"] counts the malformed ones, and the training reward is decided from
    both by fastrehearse.algo.rewards.assign_rewards) and its record. An episode that could not run
    or be scored carries metadata["error"]: its reward is not a result."""
    task, env = row.p.task, row.env
    reward = 0.0
    error = row.error
    if env is not None and task is not None and error is None:
        try:
            reward = float(env.score(task, row.traj))
        except Exception as e:  # a scoring bug is an outcome, not a crash of the whole batch
            error = f"score: {type(e).__name__}: {e}"
            reward = 0.0
    meta = {"stop_reason": row.stop_reason, "turns": row.turns, "user_turns": row.user_turns,
            "cut_turns": row.cut_turns,
            "calls": row.call_log, "malformed": dict(row.malformed), "seed": row.p.seed,
            "prompt_tokens": len(row.p.input_ids),
            "fidelity": [vars(s) for s in row.fidelity]}  # JSON-friendly; trajectories are
    # returned beside the episodes (RolloutResult.trajectories)
    if row.tools_changed:
        meta["tools_changed"] = row.tools_changed
    if row.policy_log:
        meta["policy"] = row.policy_log
    if env is not None:
        drift = env.drift_stats()
        if drift:
            meta["drift"] = dict(drift)
    if error:
        # The episode could not run (or be scored) to its end: its reward is not a result.
        # Evaluation records it as an error, not a score.
        meta["error"] = error
        if error.startswith("score: "):
            meta["score_error"] = error[len("score: "):]
    return Episode(input_ids=row.ids, roles=row.roles, task_id=task.id if task else "",
                   reward=reward, rollout_logprobs=row.logps, metadata=meta)


def rollout_metrics(rows: list[Row], episodes: list[Episode], stats: Counter, env_errors: Counter,
                    wall: float) -> dict:
    role_tokens = Counter()
    for ep in episodes:
        for r, n in Counter(ep.roles).items():
            role_tokens[Role(r).name] += n
    malformed, modes, stops = Counter(), Counter(), Counter()
    fid: list[FidelityScore] = []
    errors = sum(1 for e in episodes if "error" in e.metadata)
    for r in rows:
        malformed.update(r.malformed)
        modes.update(c["mode"] for c in r.call_log)
        stops[r.stop_reason] += 1
        fid += r.fidelity
    total = stats["prefill_tokens"] + stats["decode_fed"]
    return {
        "episodes": len(episodes),
        "wall_s": wall,
        # all tokens through the model (prefill + decode) and sampled tokens, per second
        "tokens_per_s": total / wall if wall > 0 else 0.0,
        "decode_tokens_per_s": stats["decode_tokens"] / wall if wall > 0 else 0.0,
        "prefill_tokens": stats["prefill_tokens"],   # prompt + forced tokens of the rows
        # ... of which not computed: a duplicate row's prompt, or a prefix from a (prefix) cache
        "prefill_reused_tokens": stats["prefill_reused_tokens"],
        "decode_tokens": stats["decode_tokens"],     # tokens sampled by the model
        "forward_calls": stats["forward_calls"],
        "token_slot_efficiency": (stats["fed_tokens"] / stats["token_slots"]) if stats["token_slots"] else 1.0,
        "segments": stats["segments"],               # model-written segments (turns, responses)
        "role_tokens": dict(role_tokens),
        "calls": dict(modes),
        "malformed": dict(malformed),
        "env_errors": dict(env_errors),
        "stop_reasons": dict(stops),
        "user_turns": sum(r.user_turns for r in rows),   # user turns added after the prompts
        "cut_turns": sum(r.cut_turns for r in rows),     # turns closed at max_new_tokens
        "forced_turns": stats["forced_turns"],           # agent turns a policy forced
        "errors": errors,                                # episodes that could not run / score
        "mean_reward": sum(e.reward for e in episodes) / len(episodes) if episodes else 0.0,
        "fidelity": aggregate(fid),
    }
