"""One RL update on identical episodes: fastrehearse (packed rows + fused policy loss) vs an
HF-style baseline (padded batch, full logits, torch log_softmax/gather, the same loss math).

    python benchmarks/bench_train_step.py [--json PATH] [--model smollm2|qwen3-1.7b-shape]
                                          [--episodes 8] [--reps 2] [--device cpu|cuda]

An update = forward + backward of every micro-batch, global grad-norm clipping, AdamW step (lr 0,
so every rep sees the same weights and the two methods can be checked against each other).

  ours      fastrehearse.packing.pack -> one row per micro-batch (token budget --max-tokens),
            varlen attention (episodes isolated by cu_seqlens, no padding), final hidden states
            only, fastrehearse.kernels.linear_policy_loss (fused, chunked: never the [N, V] logits),
            CONTEXT tokens skip the LM-head projection. Role-wise global normalizers.
  hf-style  episodes in arrival order, `--hf-batch` per micro-batch (default: as many micro-batches
            as ours packs, so both hold the same real tokens per forward), right-padded to the longest,
            the same model weights (one copy in memory; lr 0, so nothing changes between methods),
            transformers SDPA attention with a padding mask, full logits [B, L, V] in fp32,
            log_softmax + gather, the same PPO-clip / per-role token-mean loss in plain torch
            (what TRL-style trainers do).

Reported: real (non-padding) tokens per second of the whole update (median over reps), peak extra
memory of one update (CPU: peak RSS above the pre-update RSS; CUDA: max_memory_allocated), and
the two losses (must agree: same weights, same episodes, same math). On CUDA, MFU counts
6 * params * real tokens against the measured dense bf16 matmul rate.
Targets: CPU + SmolLM2-135M: >= 1.3x tokens/s and <= 0.5x peak memory; GPU with a
Qwen3-1.7B-shaped model: >= 2x tokens/s.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

from _common import (add_output_args, bar_plot, default_json, output_path, fmt_bytes, hardware, matmul_tflops,  # noqa: E402
                     peak_extra_bytes, print_table, write_json)

from fastrehearse.algo import AdvantageConfig, compute_advantages, local_counts, with_advantages  # noqa: E402
from fastrehearse.data import Episode  # noqa: E402
from fastrehearse.kernels import PolicyLossConfig, linear_policy_loss  # noqa: E402
from fastrehearse.kernels.roles import Role  # noqa: E402
from fastrehearse.model import RehearsalModel, load_model, token_logprobs  # noqa: E402
from fastrehearse.packing import pack  # noqa: E402

LOSS = PolicyLossConfig(w_act=1.0, w_rehearse=1.0, w_observed=0.0, clip_low=0.2, clip_high=0.28)


# ---------------------------------------------------------------------------------- episodes
def make_episodes(n: int, vocab: int, seed: int = 0) -> list[Episode]:
    """Agent-like episodes: a long CONTEXT prompt (system + tool schemas + user), then policy turns
    (ACT), rehearsed tool responses (REHEARSE) and template scaffolding (CONTEXT); lengths with a
    long tail (~150..1000 tokens), groups of 4 samples per task."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        prompt = 120 + int(torch.randint(0, 200, (1,), generator=g))
        roles = [int(Role.CONTEXT)] * prompt
        for _turn in range(1 + int(torch.randint(0, 3, (1,), generator=g))):
            roles += [int(Role.ACT)] * int(torch.randint(20, 90, (1,), generator=g))
            roles += [int(Role.CONTEXT)] * 8
            roles += [int(Role.REHEARSE)] * int(torch.randint(20, 160, (1,), generator=g))
            roles += [int(Role.CONTEXT)] * 6
        roles += [int(Role.ACT)] * int(torch.randint(10, 50, (1,), generator=g))
        ids = torch.randint(0, vocab, (len(roles),), generator=g).tolist()
        out.append(Episode(input_ids=ids, roles=roles, task_id=f"task{i // 4}",
                           reward=float(torch.rand((), generator=g) > 0.5)))
    return with_advantages(out, compute_advantages(out, AdvantageConfig())[0])


@torch.no_grad()
def add_old_logprobs(model, episodes, max_tokens: int, seed: int = 1) -> None:
    """Behaviour log-probs = current log-probs + noise, so ratios differ from 1 and clip."""
    g = torch.Generator().manual_seed(seed)
    wrapped = RehearsalModel(model)
    for b in pack(episodes, max_tokens):
        lp = token_logprobs(wrapped, b.to(next(model.parameters()).device)).cpu()
        noise = 0.1 * torch.randn(lp.shape, generator=g)
        for k, ep_i in enumerate(b.episode_indices):
            lo, hi = int(b.cu_seqlens[k]), int(b.cu_seqlens[k + 1])
            ep = episodes[ep_i]
            # position t of the row predicts token t+1: shift back into per-token alignment
            vals = [math.nan] + (lp[lo:hi - 1] + noise[lo:hi - 1]).tolist()
            ep.rollout_logprobs = [v if r in (int(Role.ACT), int(Role.REHEARSE)) else math.nan
                                   for v, r in zip(vals, ep.roles)]


# ---------------------------------------------------------------------------------- methods
def clip_and_step(model, opt) -> float:
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    torch.nn.utils.clip_grads_with_norm_(params, 1.0, norm)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(norm)


def ours_update(wrapped, opt, episodes, max_tokens: int, device) -> float:
    batches = [b.to(device) for b in pack(episodes, max_tokens)]
    counts = local_counts(batches)[0].to(device)      # global per-role counts (one rank here)
    total = 0.0
    for b in batches:
        old = torch.nan_to_num(b.old_logp, nan=0.0)
        res = wrapped(b, lambda h, w: linear_policy_loss(h, w, b.targets, b.roles, b.advantages, old,
                                                         LOSS, normalizers=counts))
        res.loss.backward()
        total += float(res.loss.detach())
    clip_and_step(wrapped, opt)
    return total


def hf_token_loss(logp, old, adv, roles, counts):
    """The same role-wise PPO-clip loss, written the way TRL-style trainers do (plain torch)."""
    ratio = torch.exp(logp - old)
    clipped = torch.clamp(ratio, 1 - LOSS.clip_low, 1 + LOSS.clip_high)
    l = torch.maximum(-adv * ratio, -adv * clipped)
    w = torch.tensor([0.0, LOSS.w_act, LOSS.w_rehearse, LOSS.w_observed], device=logp.device)
    inv = torch.where(counts > 0, 1.0 / counts.clamp_min(1), torch.zeros_like(counts)).float()
    scale = w[roles] * inv.to(logp.device)[roles]
    return (torch.where(scale > 0, l, torch.zeros_like(l)) * scale).sum()


def hf_update(model, opt, episodes, batch_size: int, device, counts) -> float:
    total = 0.0
    for s in range(0, len(episodes), batch_size):
        eps = episodes[s:s + batch_size]
        L = max(len(e) for e in eps)
        B = len(eps)
        ids = torch.zeros(B, L, dtype=torch.long)
        mask = torch.zeros(B, L, dtype=torch.long)
        roles = torch.zeros(B, L, dtype=torch.long)
        adv = torch.zeros(B, L)
        old = torch.zeros(B, L)
        for i, e in enumerate(eps):
            n = len(e)
            ids[i, :n] = torch.tensor(e.input_ids)
            mask[i, :n] = 1
            roles[i, :n] = torch.tensor(e.roles)
            adv[i, :n] = torch.tensor(e.advantages)
            old[i, :n] = torch.nan_to_num(torch.tensor(e.rollout_logprobs), nan=0.0)
        ids, mask, roles, adv, old = (t.to(device) for t in (ids, mask, roles, adv, old))
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits.float()  # [B, L, V]
        logp_all = torch.log_softmax(logits[:, :-1], dim=-1)
        logp = logp_all.gather(-1, ids[:, 1:, None]).squeeze(-1)          # [B, L-1]
        loss = hf_token_loss(logp, old[:, 1:], adv[:, 1:], roles[:, 1:] * mask[:, 1:], counts)
        loss.backward()
        total += float(loss.detach())
    clip_and_step(model, opt)
    return total


# ---------------------------------------------------------------------------------- main
def load(name: str, device, dtype):
    if name == "smollm2":
        model, _ = load_model("smollm2", dtype=dtype)
    elif name == "qwen3-1.7b-shape":   # the public Qwen3-1.7B config, random weights
        from transformers import AutoModelForCausalLM, Qwen3Config

        from fastrehearse.model import ATTN_IMPL
        cfg = Qwen3Config(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                          num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                          head_dim=128, tie_word_embeddings=True, max_position_embeddings=40960,
                          rope_theta=1000000.0, rms_norm_eps=1e-6)
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=ATTN_IMPL)
    else:
        raise ValueError(f"--model must be smollm2 or qwen3-1.7b-shape, got {name!r}")
    return model.to(device)


def run_method(name, fn, device, reps: int, real_tokens: int):
    losses, times, peaks = [], [], []
    fn()                                     # warm-up: allocates the AdamW state
    for _ in range(reps):
        box = {}

        def once():
            t0 = time.perf_counter()
            box["loss"] = fn()
            if torch.device(device).type == "cuda":
                torch.cuda.synchronize()
            box["t"] = time.perf_counter() - t0
        peaks.append(peak_extra_bytes(once, device))
        times.append(box["t"])
        losses.append(box["loss"])
    med = statistics.median(times)
    peak = max(p for p in peaks if p is not None) if any(p is not None for p in peaks) else None
    return {"method": name, "median_s": med, "tokens_per_s": real_tokens / med, "peak_extra_bytes": peak,
            "loss": losses[0], "times_s": times}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_output_args(ap)
    ap.add_argument("--png", default=None)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--episodes", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=2048, help="token budget of a packed row")
    ap.add_argument("--hf-batch", type=int, default=None,
                    help="episodes per padded micro-batch (default: ceil(episodes / ours' packed rows), "
                         "i.e. the same number of micro-batches and real tokens per forward as ours)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--activation-checkpointing", action="store_true",
                    help="recompute each decoder block in backward, for both methods")
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    torch.manual_seed(0)
    model = load(args.model, device, dtype)
    vocab = model.config.vocab_size
    episodes = make_episodes(args.episodes, vocab)
    add_old_logprobs(model, episodes, args.max_tokens)
    real_tokens = sum(len(e) for e in episodes)
    packed = pack(episodes, args.max_tokens)
    counts = local_counts(packed)[0]
    if args.hf_batch is None:      # matched micro-batches: a smaller hf batch would trade its speed
        args.hf_batch = -(-len(episodes) // len(packed))           # for memory, and vice versa
    n_params = sum(p.numel() for p in model.parameters())

    L = [len(e) for e in episodes]
    padded = sum(max(L[s:s + args.hf_batch]) * len(L[s:s + args.hf_batch]) for s in range(0, len(L), args.hf_batch))
    print(f"{args.model}: {n_params / 1e6:.0f}M params, {len(episodes)} episodes, {real_tokens} real tokens "
          f"(ours: {len(packed)} packed rows; hf-style: batches of {args.hf_batch} padded to {padded}), loss-bearing {int(counts[1] + counts[2])}, device {device}")

    # One model instance, one optimizer at a time (lr 0 and no weight change: both methods see the
    # same weights), so the process holds a single copy of weights + AdamW state.
    wrapped = RehearsalModel(model, activation_checkpointing=args.activation_checkpointing).train()
    opt = torch.optim.AdamW(wrapped.parameters(), lr=0.0, weight_decay=0.0)
    rows = [run_method("ours (packed + fused)",
                       lambda: ours_update(wrapped, opt, episodes, args.max_tokens, device),
                       device, args.reps, real_tokens)]
    del opt, wrapped
    gc.collect()
    model.set_attn_implementation("sdpa")      # the stock transformers path with a padding mask
    model.train()
    if args.activation_checkpointing:          # (already on from RehearsalModel; the HF switch)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = torch.optim.AdamW(model.parameters(), lr=0.0, weight_decay=0.0)
    rows.append(run_method("hf-style (padded + full logits)",
                           lambda: hf_update(model, opt, episodes, args.hf_batch, device, counts),
                           device, args.reps, real_tokens))
    ours, hf = rows
    rel = abs(ours["loss"] - hf["loss"]) / max(1e-12, abs(hf["loss"]))
    speedup = ours["tokens_per_s"] / hf["tokens_per_s"]
    mem_ratio = (ours["peak_extra_bytes"] / hf["peak_extra_bytes"]
                 if ours["peak_extra_bytes"] and hf["peak_extra_bytes"] else None)
    mfu = None
    if device.type == "cuda":
        peak_tflops = matmul_tflops(device, torch.bfloat16)
        for r in rows:
            r["mfu"] = 6 * n_params * real_tokens / r["median_s"] / (peak_tflops * 1e12)
        mfu = {"matmul_tflops": peak_tflops}
    table = [{"method": r["method"], "median s": f"{r['median_s']:.2f}",
              "tokens/s": f"{r['tokens_per_s']:.0f}", "peak extra mem": fmt_bytes(r["peak_extra_bytes"]),
              "loss": f"{r['loss']:.6f}", **({"MFU": f"{100 * r['mfu']:.1f}%"} if "mfu" in r else {})}
             for r in rows]
    cols = ["method", "median s", "tokens/s", "peak extra mem", "loss"] + (["MFU"] if mfu else [])
    print_table(f"one RL update, {args.model} on {device} ({real_tokens} real tokens)", table, cols)
    print(f"speed-up {speedup:.2f}x tokens/s (target >= {2.0 if device.type == 'cuda' else 1.3}x); "
          f"peak memory ratio {mem_ratio:.2f}x (target <= 0.5x); loss rel. diff {rel:.1e}")

    payload = {"benchmark": "bench_train_step", "hardware": hardware(device), "model": args.model,
               "params": n_params, "episodes": len(episodes), "real_tokens": real_tokens,
               "padded_tokens_hf": padded, "max_tokens": args.max_tokens, "hf_batch": args.hf_batch,
               "reps": args.reps, "activation_checkpointing": args.activation_checkpointing,
               "results": rows, "speedup_tokens_per_s": speedup,
               "peak_memory_ratio": mem_ratio, "loss_rel_diff": rel, "matmul": mfu}
    tag = f"bench_train_step_{args.model}" + ("_ac" if args.activation_checkpointing else "")
    out = output_path(args.json, default_json(tag, device).name, args.record)
    write_json(out, payload)
    bar_plot(Path(args.png) if args.png else out.with_suffix(".png"), ["tokens/s", "peak extra GiB"],
             {r["method"]: [r["tokens_per_s"] / 1000, (r["peak_extra_bytes"] or 0) / 2**30] for r in rows},
             ylabel="k tokens/s | GiB", title=f"one RL update, {args.model} ({device})")
    if rel > 1e-3:
        raise SystemExit(f"the two methods disagree on the loss (rel. diff {rel:.2e})")


if __name__ == "__main__":
    main()
