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
             paper's official code).

Also: batched rollout tokens/s (all episodes in one decode batch) vs one episode at a time.
Prints a table, writes JSON (hardware, torch version, medians over --repeats) and a PNG.

    python benchmarks/bench_rollout.py [--model smollm2|tiny-llama] [--tasks 8] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from fastrehearse.envs.builtin import BuiltinSuite
from fastrehearse.kernels.roles import Role
from fastrehearse.model import load_model
from fastrehearse.rollout.engine import SIMULATOR_SYSTEM, RolloutConfig, RolloutEngine
from fastrehearse.rollout.template import ChatTemplate, assistant_text
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import cpu_model  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"




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
            acts = [tmpl.encode(assistant_text(m) + end) for m in task.gold if m["role"] == "assistant"]
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
    cfg = RolloutConfig(mode="rehearse", rehearsal=rehearsal, max_new_tokens=256, max_turns=8,
                        max_episode_tokens=4096, max_batch_size=batch, temperature=1.0)
    eng = RolloutEngine(model, tok, cfg, template=tmpl, logits_processor=GoldScript(tmpl, tasks))
    res = eng.rollout(tasks, suite, group_size=group, seed=seed)
    m = res.metrics
    ok = sum(ep.metadata["stop_reason"] == "final_answer" for ep in res.episodes)
    return {"wall_s": m["wall_s"], "prefill_tokens": m["prefill_tokens"], "decode_tokens": m["decode_tokens"],
            "forward_calls": m["forward_calls"], "tokens_per_s": m["tokens_per_s"],
            "decode_tokens_per_s": m["decode_tokens_per_s"], "simulator_prompts": m["simulator_prompts"],
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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2", help="load_model spec (smollm2, tiny-llama, a path)")
    ap.add_argument("--tasks", type=int, default=8, help="builtin tasks (each one episode)")
    ap.add_argument("--level", default="mixed")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave the default)")
    ap.add_argument("--skip-sequential", action="store_true", help="skip the one-episode-at-a-time run")
    ap.add_argument("--json", default=None, help="output JSON (default benchmarks/results/rollout_<model>.json)")
    args = ap.parse_args(argv)
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
    path = Path(args.json) if args.json else RESULTS / f"rollout_{args.model.replace('/', '_')}.json"
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
