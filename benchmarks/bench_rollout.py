"""Rollout benchmark: inline world rehearsal vs a separate simulator prompt per call, and batching.

Same tasks (builtin suite), same model, same seeds. To make every mode do the same work, the policy
turns are forced to each task's gold turns and every rehearsed response to the gold tool response
(a logits bias of 1e4 on the scripted token: the model still runs a full forward and a sampling
step for every such token, so the decode cost is real). What differs is only how the environment
role is played:

  inline     after </tool_call> the engine forces the scaffolding "close assistant + open tool turn"
             into the same KV cache and the model keeps generating the response (fastrehearse).
  separate   per call, a fresh simulator prompt (system + tools + the conversation so far + the call)
             is prefilled and decoded, and its tokens are copied into the episode (the style of the
             paper's official code): benchmarks/_simulator.py, on the engine's simulator hook.

Also: batched rollout tokens/s (all episodes in one decode batch) vs one episode at a time.
Prints a table, writes JSON (hardware, torch version, medians over --repeats) and a PNG.

    python benchmarks/bench_rollout.py [--model smollm2|tiny-llama] [--tasks 8] [--json PATH]

`--backends hf,vllm` instead compares the generation backends (fastrehearse/rollout/backends/segments.py)
on the same tasks with the same sampling settings, in interleaved rounds with fresh tasks every
round (no round reuses an earlier round's prefix cache for its prompts): builtin `mixed`, a
GRPO-shaped builtin workload (`builtin_grpo`: --tasks // group_size prompts x group_size samples,
the group from --preset) and BFCL multi-turn episodes (model-sampled, T=1: what an RL step rolls
out), the engine on vLLM against raw `LLM.generate` over the same prompts and sampled lengths, and
an RL step (rollout + weight sync + update, timed on every episode) on the BFCL episodes. Before
each round it waits (up to --idle-wait-s) for the 1-minute load to fall below --idle-load, records
the load at the round's start and end, and marks a round above the core count "loaded". Writes runs/bench/rollout_backends_<device>.json (--record: benchmarks/results/).

    python benchmarks/bench_rollout.py --backends hf,vllm [--model smollm2] [--rounds 2]
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from fastrehearse.algo import local_counts
from fastrehearse.envs import get_suite
from fastrehearse.envs.builtin import BuiltinSuite
from fastrehearse.kernels.roles import Role
from fastrehearse.model import RehearsalModel, load_model, use_varlen_attention
from fastrehearse.packing import pack
from fastrehearse.rollout import RolloutConfig, RolloutEngine
from fastrehearse.rollout.backends.vllm_backend import VLLMBackend
from fastrehearse.rollout.backends.vllm_options import VLLMOptions
from fastrehearse.rollout.text.gold import gold_replies
from fastrehearse.rollout.text.template import ChatTemplate, assistant_text
from fastrehearse.train.config import TrainConfig, load_config
from fastrehearse.train.heads import rl_head
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_output_args, cpu_model, output_path  # noqa: E402
from _simulator import SIMULATOR_SYSTEM, SeparateSimulator  # noqa: E402

REHEARSALS = ("inline", "separate")




class GoldScript:
    """Forces, per episode, the task's gold assistant turns (ACT) and gold tool responses (REHEARSE
    inline, or the simulator's turn in separate mode). State is kept per row (keyed by the row's
    token list, which the engine grows in place) so the per-step cost is O(new tokens)."""

    def __init__(self, tmpl: ChatTemplate, tasks, bias: float = 1e4):
        self.t, self.bias = tmpl, bias
        end = tmpl.assistant_end_markers[0]
        marker = tmpl.tool_end_markers[0]
        tool_end = tmpl.scaffolding.texts["tool_to_assistant"].split(marker)[0] + marker
        self.by_prompt = {}
        for task in tasks:
            acts = [tmpl.encode(assistant_text(m) + end) for m in gold_replies(task)]
            tools = [m["content"] for m in task.gold if m["role"] == "tool"]
            self.by_prompt[task.payload["prompt"]] = (acts, [tmpl.encode(c) + tmpl.encode(tool_end) for c in tools],
                                                      [tmpl.encode(c + end) for c in tools])
        self.sim_prefix = tmpl.encode(SIMULATOR_SYSTEM)
        self.rows: dict[int, dict] = {}

    def _state(self, ids, roles):
        st = self.rows.get(id(ids))
        if st is None or st["n"] > len(ids):
            text = self.t.tokenizer.decode(ids)
            sim = self.t.tokenizer.decode(self.sim_prefix) in text[:2000]
            key = next((p for p in self.by_prompt if json.dumps(p)[1:-1] in text or p in text), None)
            st = {"n": 0, "runs": {Role.ACT: 0, Role.REHEARSE: 0}, "prev": None, "seg": 0, "sim": sim,
                  "key": key, "n_tool_msgs": text.count('"role": "tool"') if sim else 0}
            self.rows[id(ids)] = st
        for r in roles[st["n"]:]:  # incremental scan of the roles appended since the last call
            kind = Role.ACT if r == Role.ACT else Role.REHEARSE if r in (Role.REHEARSE, Role.OBSERVED) else None
            if kind is not None and kind != st["prev"]:
                st["runs"][kind] += 1
                st["seg"] = 0
            st["seg"] = st["seg"] + 1 if kind is not None else 0
            st["prev"] = kind
        st["n"] = len(roles)
        return st

    def __call__(self, contexts, context_roles, sample_roles, logits):
        logits = logits.clone()
        for i, (ids, roles, role) in enumerate(zip(contexts, context_roles, sample_roles)):
            st = self._state(ids, roles)
            if st["key"] is None:
                continue
            acts, tools, sim_tools = self.by_prompt[st["key"]]
            kind = Role.ACT if role == Role.ACT else Role.REHEARSE
            cur = st["prev"] == kind
            k = st["runs"][kind] - (1 if cur else 0)
            n = st["seg"] if cur else 0
            if st["sim"]:
                script = sim_tools[st["n_tool_msgs"]] if st["n_tool_msgs"] < len(sim_tools) else []
            else:
                seq = acts if kind == Role.ACT else tools
                script = seq[k] if k < len(seq) else []
            if n < len(script):
                logits[i, script[n]] += self.bias
        return logits


def run_mode(model, tok, tmpl, suite, tasks, *, rehearsal: str, batch: int, group: int, seed: int):
    """One rollout of `tasks`, rehearsing "inline" (the engine) or "separate" (_simulator.py)."""
    if rehearsal not in REHEARSALS:
        raise ValueError(f"rehearsal must be one of {REHEARSALS}, got {rehearsal!r}")
    cfg = RolloutConfig(mode="rehearse", max_new_tokens=256, max_turns=8,
                        max_episode_tokens=4096, max_batch_size=batch, temperature=1.0)
    sim = SeparateSimulator(tmpl) if rehearsal == "separate" else None
    eng = RolloutEngine(model, tok, cfg, template=tmpl, logits_processor=GoldScript(tmpl, tasks), simulator=sim)
    res = eng.rollout(tasks, suite, group_size=group, seed=seed)
    m = res.metrics
    ok = sum(ep.metadata["stop_reason"] == "final_answer" for ep in res.episodes)
    return {"wall_s": m["wall_s"], "prefill_tokens": m["prefill_tokens"], "decode_tokens": m["decode_tokens"],
            "forward_calls": m["forward_calls"], "tokens_per_s": m["tokens_per_s"],
            "decode_tokens_per_s": m["decode_tokens_per_s"], "simulator_prompts": sim.prompts if sim else 0,
            "rehearsed_calls": m["calls"].get("rehearse", 0), "episodes": len(res.episodes),
            "episodes_finished": ok, "mean_reward": m["mean_reward"],
            "episode_tokens": sum(len(e.input_ids) for e in res.episodes),
            "role_tokens": m["role_tokens"]}


def median_run(repeats, **kw):
    runs = [run_mode(**kw) for _ in range(repeats)]
    out = dict(runs[-1])
    for key in ("wall_s", "tokens_per_s", "decode_tokens_per_s"):
        out[key] = statistics.median(r[key] for r in runs)
    out["wall_s_all"] = [r["wall_s"] for r in runs]
    return out


class _TimedBackend:
    """Wraps a segment backend and adds up the seconds spent inside its sessions' add / step (the
    serving engine's own work: scheduling, prefill, decode); the rest of a rollout's wall time is the
    engine's (rows, stop matching, forced tokens, tool execution). Where the engine's cost goes."""

    def __init__(self, backend):
        self.b, self.name, self.add_s, self.step_s = backend, backend.name, 0.0, 0.0

    def session(self, sampling, stats):
        s, outer = self.b.session(sampling, stats), self

        class Timed:
            def add(self, reqs):
                t0 = time.perf_counter()
                s.add(reqs)
                outer.add_s += time.perf_counter() - t0

            def step(self):
                t0 = time.perf_counter()
                out = s.step()
                outer.step_s += time.perf_counter() - t0
                return out

            def drop(self, keys):
                s.drop(keys)

            def close(self):
                s.close()
        return Timed()


WORKLOADS = ("builtin_mixed", "builtin_grpo", "bfcl_multi_turn")


def round_tasks(tasks: list, r: int, n: int) -> list:
    """Round r's tasks: the r-th block of n (fresh tasks every round: a later round must not reuse
    an earlier round's prefix cache for the same prompts, which a training step never sees)."""
    block = tasks[r * n:(r + 1) * n]
    if len(block) < n:
        raise SystemExit(f"{len(tasks)} tasks are not enough for round {r} of {n} fresh ones")
    return block


def wait_idle(max_load: float, limit_s: float, poll_s: float = 5.0) -> dict:
    """Before a timed round: wait (up to limit_s) until the 1-minute load average is below
    max_load. Returns the load when the round starts and how long it waited."""
    t0 = time.monotonic()
    while os.getloadavg()[0] >= max_load and time.monotonic() - t0 < limit_s:
        time.sleep(min(poll_s, max(0.0, limit_s - (time.monotonic() - t0))))
    return {"loadavg_1m_start": round(os.getloadavg()[0], 2), "idle_wait_s": round(time.monotonic() - t0, 1)}


def mark_loaded(rec: dict, cores: int) -> dict:
    """A figure taken while the 1-minute load (at the round's start or end) exceeded the core count
    is marked loaded: other jobs then shared its CPUs."""
    rec["loaded"] = max(rec.get("loadavg_1m_start", 0.0), rec.get("loadavg_1m", 0.0)) > cores
    return rec


def _backend_run(model, tok, tmpl, suite, tasks, cfg, backend, seed, group_size=1):
    timed = _TimedBackend(backend) if backend is not None else None
    eng = RolloutEngine(model, tok, cfg, template=tmpl, backend=timed)
    t0 = time.perf_counter()
    res = eng.rollout(tasks, suite, group_size=group_size, seed=seed)
    dt = time.perf_counter() - t0
    m = res.metrics
    rec = {"rollout_s": dt, "tokens": m["decode_tokens"], "tokens_per_s": m["decode_tokens"] / dt,
           "prefill_tokens": m["prefill_tokens"], "prefill_reused_tokens": m["prefill_reused_tokens"],
           "segments": m["segments"], "episodes": len(res.episodes),
           "episode_tokens": sum(len(e.input_ids) for e in res.episodes),
           "stop_reasons": m["stop_reasons"]}
    if timed is not None:
        rec.update(backend_add_s=round(timed.add_s, 3), backend_step_s=round(timed.step_s, 3),
                   engine_own_s=round(dt - timed.add_s - timed.step_s, 3))
    return rec, res


def _raw_generate(llm, episodes, rounds=1):
    """vLLM's own LLM.generate over the episodes' prompts, each asked for as many tokens as the
    engine sampled in that episode (ignore_eos: exactly that many), T=1."""
    from vllm import SamplingParams
    prompts, lens = [], []
    for ep in episodes:
        p = ep.metadata["prompt_tokens"]
        n = sum(1 for r in ep.roles[p:] if r in (int(Role.ACT), int(Role.REHEARSE)))
        prompts.append({"prompt_token_ids": ep.input_ids[:p]})
        lens.append(max(1, n))
    llm.reset_prefix_cache()
    t0 = time.perf_counter()
    out = llm.generate(prompts, [SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True) for n in lens],
                       use_tqdm=False)
    dt = time.perf_counter() - t0
    n = sum(len(o.outputs[0].token_ids) for o in out)
    return {"rollout_s": dt, "tokens": n, "tokens_per_s": n / dt, "requests": len(prompts),
            "prompt_tokens": sum(len(p["prompt_token_ids"]) for p in prompts),
            "prefill_reused_tokens": sum(o.num_cached_tokens or 0 for o in out)}


def _update_seconds(model, episodes):
    """The trainer's RL update on `episodes`: packed, RL loss head (fused), backward, Adam step."""
    m = copy.deepcopy(model)
    use_varlen_attention(m)
    m.gradient_checkpointing_enable()   # 7.5k-token BFCL episodes: activations would not fit beside the rest
    m.train()
    wrapped = RehearsalModel(m)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-6)
    cfg = TrainConfig()
    t0 = time.perf_counter()
    batches = pack(episodes, 8192, num_ranks=1, overlong="truncate_right")
    counts = local_counts(batches)
    for b in batches:
        b.advantages = torch.randn(b.num_tokens, generator=torch.Generator().manual_seed(0))
        b.ref_logp = None
        wrapped(b, rl_head(cfg, b, counts[0], None)).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def backends_main(args):
    """--backends: hf vs vllm, interleaved rounds (see the module docstring)."""
    names = args.backends.split(",")
    if any(n not in ("hf", "vllm") for n in names):
        raise SystemExit(f"--backends: expected names from hf,vllm, got {args.backends!r}")
    unknown = [w for w in args.workloads if w not in WORKLOADS]
    if unknown or not args.workloads:
        raise SystemExit(f"--workloads: unknown {unknown or 'empty'}; choose from {','.join(WORKLOADS)}")
    for flag, v in (("--rounds", args.rounds), ("--tasks", args.tasks), ("--bfcl-tasks", args.bfcl_tasks)):
        if v < 1:
            raise SystemExit(f"{flag} must be >= 1, got {v}")
    for flag, v in (("--group-size", args.group_size), ("--idle-wait-s", args.idle_wait_s),
                    ("--update-episodes", args.update_episodes)):
        if v < 0:
            raise SystemExit(f"{flag} must be >= 0, got {v}")
    torch.set_num_threads(args.threads or 2)
    model, tok = load_model(args.model)
    model.eval()
    tmpl = ChatTemplate(tok)
    group = args.group_size or load_config(args.preset).rollout.group_size
    n_builtin = max(args.tasks * args.rounds, 16)
    builtin_cfg = RolloutConfig(mode="rehearse", temperature=1.0, max_new_tokens=96, max_turns=3,
                                max_episode_tokens=2048, max_batch_size=64)
    # name -> (suite, task selection, engine config, episodes per task)
    workloads = {
        "builtin_mixed": (BuiltinSuite(level="mixed", n_train=n_builtin, n_test=8),
                          dict(split="train", limit=args.tasks), builtin_cfg, 1),
        # GRPO-shaped: the step's prompts, group_size samples each (they share the prompt's prefix)
        "builtin_grpo": (BuiltinSuite(level="mixed", n_train=n_builtin, n_test=8),
                         dict(split="train", limit=max(1, args.tasks // group)), builtin_cfg, group),
        "bfcl_multi_turn": (get_suite("bfcl"), dict(split="multi_turn_base", limit=args.bfcl_tasks),
                            # 2 rows at a time: HF's batched prefill of 8 x 7.4k-token prompts needs
                            # ~16 GB of attention scores (it was OOM-killed on the 24 GB box)
                            RolloutConfig(mode="real", temperature=1.0, max_new_tokens=96,
                                          max_turns=args.bfcl_turns, max_episode_tokens=8192,
                                          max_batch_size=args.bfcl_batch), 1),
    }
    workloads = {w: workloads[w] for w in args.workloads}
    backends, startup = {}, {}
    t0 = time.perf_counter()
    backends["hf"] = None                        # the engine's default (HFGenerator over `model`)
    startup["hf"] = 0.0                          # the model is the trainer's own: nothing to start
    if "vllm" in names:
        t0 = time.perf_counter()
        backends["vllm"] = VLLMBackend(model, tok, max_episode_tokens=8192,
                                       options=VLLMOptions(kv_cache_gib=args.kv_cache_gib,
                                                           enforce_eager=args.enforce_eager))
        startup["vllm"] = time.perf_counter() - t0
        print(f"vllm start-up {startup['vllm']:.1f} s", flush=True)
    try:   # vLLM stopped on every exit path (its EngineCore holds GBs)
        out = {"benchmark": "rollout_backends", "model": args.model, "rounds": args.rounds,
               "hardware": {"cpu": cpu_model(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None},
               "torch": torch.__version__, "vllm_enforce_eager": args.enforce_eager, "workloads": {}}
        last = {}
        path = output_path(args.json, f"rollout_backends_{'cuda' if torch.cuda.is_available() else 'cpu'}.json",
                           args.record)
        path.parent.mkdir(parents=True, exist_ok=True)

        def save():   # after every run: a killed benchmark keeps what it measured
            path.write_text(json.dumps(out, indent=2, default=str))

        # untimed warm-up, one builtin episode per backend: the first requests pay one-time costs
        # (vLLM's first forwards, kernel set-up; HF's allocator) that a single timed round would count
        suite, tk, cfg, _ = next(iter(workloads.values()))
        warm = suite.tasks(tk["split"], limit=tk["limit"] * args.rounds + 1)[-1:]   # a task no round uses
        for n in names:
            _backend_run(model, tok, tmpl, suite, warm, cfg, backends[n], seed=99)
        out["warmup"] = "one untimed episode per backend (of a task no timed round uses) before the rounds"
        out["fresh_tasks_per_round"] = True
        out["group_size"] = group
        out["idle"] = {"max_load": args.idle_load, "wait_limit_s": args.idle_wait_s,
                       "loaded_means": f"1-minute load above {os.cpu_count()} cores at a round's start or end"}
        cores = os.cpu_count()
        for wname, (suite, tk, cfg, per_task) in workloads.items():
            every = suite.tasks(tk["split"], limit=tk["limit"] * args.rounds)
            runs = {n: [] for n in names}
            for r in range(args.rounds):                 # interleaved: hf, vllm / vllm, hf / ...
                tasks = round_tasks(every, r, tk["limit"])   # the same tasks for both backends
                for n in (names if r % 2 == 0 else names[::-1]):
                    idle = wait_idle(args.idle_load, args.idle_wait_s)
                    rec, res = _backend_run(model, tok, tmpl, suite, tasks, cfg, backends[n], seed=r,
                                            group_size=per_task)
                    rec.update(idle, round=r, task_ids=[t.id for t in tasks])
                    rec["loadavg_1m"] = os.getloadavg()[0]     # the box is shared: how busy it was
                    mark_loaded(rec, cores)
                    runs[n].append(rec)
                    last[(wname, n)] = res
                    print(f"{wname} round {r} {n}: {rec['rollout_s']:.1f} s, {rec['tokens']} tokens, "
                          f"{rec['tokens_per_s']:.1f} tok/s (load {rec['loadavg_1m_start']:.1f} -> "
                          f"{rec['loadavg_1m']:.1f}{', LOADED' if rec['loaded'] else ''})", flush=True)
                    out["workloads"][wname] = {"partial": True, "runs": runs}
                    save()
            recs = []
            for n in names:
                rs = runs[n]
                med = statistics.median(x["rollout_s"] for x in rs)
                tps = statistics.median(x["tokens_per_s"] for x in rs)
                recs.append({"backend": n, "startup_s": round(startup[n], 2), "rollout_s": round(med, 2),
                             "tokens": rs[-1]["tokens"], "tokens_per_s": round(tps, 2),
                             "episodes": rs[-1]["episodes"], "loaded_rounds": sum(x["loaded"] for x in rs),
                             "rounds": rs})
            w = {"tasks": len(tasks), "episodes_per_task": per_task, "config": {k: getattr(cfg, k) for k in ("mode", "temperature", "max_new_tokens",
                                                                              "max_turns", "max_episode_tokens")},
                 "records": recs}
            if len(names) == 2:
                w["ratio_tokens_per_s"] = round(recs[1]["tokens_per_s"] / recs[0]["tokens_per_s"], 3)
            out["workloads"][wname] = w
        if "vllm" in names and {"builtin_mixed", "bfcl_multi_turn"} <= set(workloads):
            b = backends["vllm"]
            raw = _raw_generate(b.llm, last[("builtin_mixed", "vllm")].episodes)
            raw["loadavg_1m"] = os.getloadavg()[0]
            vr = next(r for r in out["workloads"]["builtin_mixed"]["records"] if r["backend"] == "vllm")
            eng = statistics.median(x["tokens_per_s"] for x in vr["rounds"])
            er = vr["rounds"][-1]   # the round whose episodes' prompts and lengths the raw run replays
            out["engine_vs_raw_generate"] = {
                "workload": "builtin_mixed", "raw_generate": raw, "engine_tokens_per_s": eng,
                "ratio": round(eng / raw["tokens_per_s"], 3),
                "engine_breakdown_last_round": {
                    k: er.get(k) for k in ("rollout_s", "backend_add_s", "backend_step_s", "engine_own_s",
                                           "segments", "prefill_tokens", "prefill_reused_tokens")},
                "breakdown_note": "backend_add_s / backend_step_s: seconds inside vLLM's add_request / step "
                                  "for the engine's segment requests; engine_own_s: the rest (row state, stop "
                                  "matching, forced scaffolding, tool execution). Raw LLM.generate: one request "
                                  "per episode from its initial prompt for as many tokens as the engine sampled "
                                  "(ignore_eos), so it has no segment boundaries: no re-admitted requests, no "
                                  "prefill of the forced / tool tokens appended between segments"}
            # RL step on BFCL multi-turn: rollout (median) + weight sync + update (same for both)
            syncs = [b.sync_weights(model) for _ in range(2)]
            out["weight_sync_s"] = syncs
            save()
            eps = last[("bfcl_multi_turn", names[0])].episodes[:args.update_episodes or None]
            upd = _update_seconds(model, eps)
            n_eps = out["workloads"]["bfcl_multi_turn"]["tasks"]
            upd_all = upd * n_eps / len(eps)
            step = {}
            for rec in out["workloads"]["bfcl_multi_turn"]["records"]:
                sync = statistics.median(syncs) if rec["backend"] == "vllm" else 0.0
                step[rec["backend"]] = {"rollout_s": rec["rollout_s"], "weight_sync_s": round(sync, 2),
                                        "update_s": round(upd_all, 2),
                                        "step_s": round(rec["rollout_s"] + sync + upd_all, 2)}
            out["rl_step_bfcl_multi_turn"] = {
                **step, "update_note": (f"update measured on {len(eps)} of the {n_eps} episodes (packed, fused RL "
                                        f"head, activation checkpointing, backward, AdamW)"
                                        + (f" and scaled by {n_eps}/{len(eps)}" if len(eps) < n_eps else "")
                                        + "; the same for both backends"),
                "speedup": (round(step["hf"]["step_s"] / step["vllm"]["step_s"], 3)
                            if "hf" in step and "vllm" in step and step["vllm"]["step_s"] > 0 else None)}
            save()
        out["note"] = ("same tasks per round (fresh tasks every round), seeds and sampling settings (T=1, top_p=1) "
                       "for both backends, rounds interleaved, each after waiting for an idle box (idle); "
                       "a round whose load exceeded the core count is marked loaded; "
                       "tokens = tokens the model sampled (episodes differ in content between backends: tokens/s "
                       "normalizes); start-up reported separately; the 2-core box is shared with other jobs.")
        save()
        print(f"\n{'workload':<18} {'backend':<6} {'start s':>8} {'rollout s':>10} {'tokens':>7} {'tok/s':>8}")
        for wname, w in out["workloads"].items():
            for r in w["records"]:
                print(f"{wname:<18} {r['backend']:<6} {r['startup_s']:>8.1f} {r['rollout_s']:>10.1f} {r['tokens']:>7} "
                      f"{r['tokens_per_s']:>8.1f}")
            if "ratio_tokens_per_s" in w:
                print(f"{wname}: vllm/hf tokens/s {w['ratio_tokens_per_s']:.2f}x")
        if "engine_vs_raw_generate" in out:
            ev = out["engine_vs_raw_generate"]
            print(f"engine on vLLM vs raw LLM.generate: {ev['ratio']:.2f}x "
                  f"({json.dumps(ev['engine_breakdown_last_round'])})")
            print(f"RL step (BFCL multi-turn): {json.dumps(out['rl_step_bfcl_multi_turn'])}")
        print(f"wrote {path}")
    finally:
        if backends.get("vllm") is not None:
            backends["vllm"].close()
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2", help="load_model spec (smollm2, tiny-llama, a path)")
    ap.add_argument("--tasks", type=int, default=8, help="builtin tasks (each one episode)")
    ap.add_argument("--level", default="mixed")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave the default)")
    ap.add_argument("--skip-sequential", action="store_true", help="skip the one-episode-at-a-time run")
    add_output_args(ap, "output JSON, rollout_<model>.json or (--backends) rollout_backends_<device>.json")
    ap.add_argument("--backends", default=None, help="compare generation backends, e.g. hf,vllm (see docstring)")
    ap.add_argument("--rounds", type=int, default=2, help="--backends: interleaved rounds")
    ap.add_argument("--bfcl-tasks", type=int, default=8, help="--backends: BFCL multi-turn episodes")
    ap.add_argument("--bfcl-turns", type=int, default=1, help="--backends: BFCL policy turns per user turn")
    ap.add_argument("--update-episodes", type=int, default=0,
                    help="--backends: episodes the update is timed on (0: all; fewer: scaled, and said so)")
    ap.add_argument("--kv-cache-gib", type=int, default=2, help="--backends: VLLM_CPU_KVCACHE_SPACE")
    ap.add_argument("--bfcl-batch", type=int, default=2, help="--backends: BFCL episodes decoded together")
    ap.add_argument("--enforce-eager", action="store_true", help="--backends: vLLM without torch.compile")
    ap.add_argument("--workloads", type=lambda s: [w for w in s.split(",") if w],
                    default=["builtin_mixed", "builtin_grpo", "bfcl_multi_turn"],
                    help="--backends: comma list of builtin_mixed, builtin_grpo, bfcl_multi_turn")
    ap.add_argument("--preset", default="demo", help="--backends: the preset whose rollout.group_size "
                                                     "shapes builtin_grpo (a name or a YAML file)")
    ap.add_argument("--group-size", type=int, default=0, help="--backends: builtin_grpo's group (0: the preset's)")
    ap.add_argument("--idle-load", type=float, default=1.0,
                    help="--backends: before each round wait until the 1-minute load is below this")
    ap.add_argument("--idle-wait-s", type=float, default=300.0,
                    help="--backends: the longest wait for an idle box per round (0: do not wait)")
    args = ap.parse_args(argv)
    output_path(args.json, "-", args.record)     # --json with --record: refused before any work
    if args.backends:
        if args.tasks == 8:
            args.tasks = 16
        return backends_main(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load_model(args.model)
    tmpl = ChatTemplate(tok)
    suite = BuiltinSuite(level=args.level, n_train=max(args.tasks, 8), n_test=8)
    tasks = suite.tasks("train", limit=args.tasks)
    kw = dict(model=model, tok=tok, tmpl=tmpl, suite=suite, tasks=tasks, group=1, seed=0)
    run_mode(**{**kw, "tasks": tasks[:1]}, rehearsal="inline", batch=1)  # warm-up
    results = {
        "inline": median_run(args.repeats, rehearsal="inline", batch=len(tasks), **kw),
        "separate": median_run(args.repeats, rehearsal="separate", batch=len(tasks), **kw),
    }
    if not args.skip_sequential:
        results["inline_sequential"] = median_run(args.repeats, rehearsal="inline", batch=1, **kw)
    inl, sep = results["inline"], results["separate"]
    ratios = {
        "prefill_tokens_separate_over_inline": sep["prefill_tokens"] / max(1, inl["prefill_tokens"]),
        "wall_separate_over_inline": sep["wall_s"] / inl["wall_s"],
    }
    if "inline_sequential" in results:
        seq = results["inline_sequential"]
        ratios["tokens_per_s_batched_over_sequential"] = inl["tokens_per_s"] / seq["tokens_per_s"]
    cfg = model.config
    out = {
        "benchmark": "rollout", "model": args.model,
        "model_shape": {"layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size, "vocab": cfg.vocab_size},
        "tasks": len(tasks), "level": args.level, "repeats": args.repeats,
        "hardware": {"cpu": cpu_model(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                     "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None},
        "torch": torch.__version__, "python": sys.version.split()[0],
        "results": results, "ratios": ratios,
        "note": "policy turns and rehearsed responses forced to the gold trajectory (bias 1e4) so both "
                "modes do identical work; prefill_tokens = prompt + forced tokens fed to the model "
                "(separate: + simulator prompts and the copied responses).",
    }
    path = output_path(args.json, f"rollout_{args.model.replace('/', '_')}.json", args.record)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))

    rows = [("mode", "wall s", "prefill tok", "decode tok", "fwd calls", "tok/s", "sim prompts", "finished")]
    for name, r in results.items():
        rows.append((name, f"{r['wall_s']:.2f}", str(r["prefill_tokens"]), str(r["decode_tokens"]),
                     str(r["forward_calls"]), f"{r['tokens_per_s']:.0f}", str(r["simulator_prompts"]),
                     f"{r['episodes_finished']}/{r['episodes']}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    print(f"rollout benchmark: {args.model}, {len(tasks)} builtin tasks, {out['hardware']['cpu']}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for row in rows:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))
    for k, v in ratios.items():
        print(f"{k}: {v:.2f}x")
    print(f"wrote {path}")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        names = ["inline", "separate"]
        fig, ax = plt.subplots(1, 2, figsize=(8, 3.2))
        ax[0].bar(names, [results[n]["prefill_tokens"] for n in names], color=["tab:green", "tab:red"])
        ax[0].set_title("prefill tokens")
        ax[1].bar(names, [results[n]["wall_s"] for n in names], color=["tab:green", "tab:red"])
        ax[1].set_title("wall time (s)")
        fig.suptitle(f"rehearsal inline vs separate simulator ({args.model}, {len(tasks)} tasks)")
        fig.tight_layout()
        fig.savefig(path.with_suffix(".png"), dpi=110)
        print(f"wrote {path.with_suffix('.png')}")
    except Exception as e:  # the JSON and the table are the result; the plot is a convenience
        print(f"plot skipped: {e}")
    return out


if __name__ == "__main__":
    main()
