"""End-to-end GPU step: rollout + one RL update of a Qwen3-1.7B-shaped random-init model.

    python benchmarks/bench_e2e_gpu.py [--json PATH] [--tasks 4 --group 4 --prompt 768 --new 256]
    python benchmarks/bench_e2e_gpu.py --tiny --json /tmp/e2e.json     # CPU smoke (seconds)

What runs (the trainer's pieces, not a mock):
1. model: the public Qwen3-1.7B config (hidden 2048, 28 layers, 16/8 heads, head_dim 128,
   intermediate 6144, vocab 151936, tied embeddings) with random weights; fp32 master weights,
   a bf16 copy for generation (as the trainer keeps a generation copy);
2. rollout: `fastrehearse.rollout.backends.generator.HFGenerator` (batched KV-cache decoding, sdpa) +
   `fastrehearse.rollout.backends.sampling.sample` at temperature 1 on `--tasks x --group` random prompts;
   the sampler's log-probs become the behaviour log-probs; random 0/1 rewards, group advantages
   (`fastrehearse.algo.compute_advantages`);
3. one RL update: `RehearsalModel` (torch varlen attention over packed rows) wrapped by
   `fastrehearse.train.parallelize` (1-rank FSDP2: NCCL on CUDA with bf16 compute / fp32 reduce;
   `--tiny` on CPU uses a 1-rank gloo group in fp32), packed micro-batches of `--max-tokens`,
   `linear_policy_loss` (fused), global role counts, grad-norm clipping, AdamW. One untimed
   warm-up update first (Triton compile, optimizer state), then `--reps` timed updates.

Reported: rollout generated tokens/s, update tokens/s (every token of the packed rows), peak
memory (CUDA max_memory_allocated; CPU peak RSS), MFU = 6 * params * tokens / time over the
measured dense matmul rate (update; attention FLOPs not counted) and 2 * params * generated
tokens / time for the rollout (decode is bandwidth-bound: low by nature).
"""
from __future__ import annotations

import argparse
import copy
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from _common import add_output_args, hardware, output_path, matmul_tflops, print_table, write_json  # noqa: E402

from fastrehearse.algo import AdvantageConfig, compute_advantages, local_counts, with_advantages  # noqa: E402
from fastrehearse.data import Episode  # noqa: E402
from fastrehearse.dtensor import full_tensor  # noqa: E402
from fastrehearse.kernels import PolicyLossConfig, linear_policy_loss  # noqa: E402
from fastrehearse.kernels.roles import Role  # noqa: E402
from fastrehearse.model import ATTN_IMPL, RehearsalModel  # noqa: E402
from fastrehearse.packing import pack  # noqa: E402
from fastrehearse.rollout.backends.generator import HFGenerator  # noqa: E402
from fastrehearse.rollout.backends.sampling import sample  # noqa: E402
from fastrehearse.train.parallelize import DistInfo, init_distributed, parallelize  # noqa: E402

LOSS = PolicyLossConfig(w_act=1.0, w_rehearse=1.0, w_observed=0.0, clip_low=0.2, clip_high=0.28)
QWEN3_1P7B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                  tie_word_embeddings=True, max_position_embeddings=40960, rope_theta=1000000.0,
                  rms_norm_eps=1e-6)
TINY = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
            max_position_embeddings=4096, rms_norm_eps=1e-6)


def dist_info(device: torch.device) -> DistInfo:
    """1-rank FSDP2 group: the trainer's own setup on CUDA, a gloo group on CPU (--tiny)."""
    if device.type == "cuda":
        return init_distributed("cuda")
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1)
    return DistInfo(0, 1, 0, device, "gloo", init_device_mesh("cpu", (1,), mesh_dim_names=("dp",)))


def build_model(cfg_kwargs: dict, device: torch.device, seed: int = 0):
    from transformers import AutoModelForCausalLM, Qwen3Config
    torch.manual_seed(seed)
    cfg = Qwen3Config(**cfg_kwargs)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32,
                                                 attn_implementation=ATTN_IMPL)
    return model


@torch.no_grad()
def rollout(gen_model, prompts: list[list[int]], new_tokens: int, seed: int):
    """Sample `new_tokens` per prompt; returns (generated ids, their log-probs) per row."""
    gen_model.set_attn_implementation("sdpa")    # decoding with a padding mask + KV cache
    g = HFGenerator(gen_model)
    dev = g.device
    rng = torch.Generator().manual_seed(seed)
    logits = g.start(prompts)
    toks, lps = [[] for _ in prompts], [[] for _ in prompts]
    for step in range(new_tokens):
        u = torch.rand(len(prompts), generator=rng).to(dev)
        tok, lp = sample(logits, 1.0, 1.0, u)
        for r, (t, l) in enumerate(zip(tok.tolist(), lp.tolist())):
            toks[r].append(t)
            lps[r].append(l)
        if step + 1 < new_tokens:
            logits = g.step([[t] for t in tok.tolist()])
    return toks, lps


def make_episodes(prompts, toks, lps, group: int, seed: int) -> list[Episode]:
    rng = torch.Generator().manual_seed(seed)
    eps = []
    for i, (p, t, lp) in enumerate(zip(prompts, toks, lps)):
        roles = [int(Role.CONTEXT)] * len(p) + [int(Role.ACT)] * len(t)
        eps.append(Episode(input_ids=p + t, roles=roles, task_id=f"task{i // group}",
                           reward=float(torch.rand((), generator=rng) > 0.5),
                           rollout_logprobs=[math.nan] * len(p) + lp))
    return with_advantages(eps, compute_advantages(eps, AdvantageConfig())[0])


def rl_update(wrapped, opt, episodes, max_tokens: int, device) -> tuple[float, int]:
    """Forward + backward of every packed micro-batch, clip, AdamW step; (loss, tokens)."""
    batches = [b.to(device) for b in pack(episodes, max_tokens)]
    counts = local_counts(batches)[0].to(device)   # one rank: local counts are the global ones
    total, tokens = 0.0, 0
    for b in batches:
        old = torch.nan_to_num(b.old_logp, nan=0.0)
        res = wrapped(b, lambda h, w: linear_policy_loss(h, w, b.targets, b.roles, b.advantages,
                                                         old, LOSS, normalizers=counts))
        res.loss.backward()
        total += float(res.loss.detach())
        tokens += int(b.targets.numel())
    params = [p for p in wrapped.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    norm = full_tensor(norm)
    torch.nn.utils.clip_grads_with_norm_(params, 1.0, norm)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return total, tokens


def _peak_reset(device):
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def _peak(device) -> int | None:
    if device.type == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:  # pragma: no cover
        pass
    return None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_output_args(ap)
    ap.add_argument("--tiny", action="store_true", help="tiny Qwen3 config on the CPU (smoke test)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--tasks", type=int, default=None)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=None, help="prompt tokens per episode")
    ap.add_argument("--new", type=int, default=None, help="generated tokens per episode")
    ap.add_argument("--max-tokens", type=int, default=None, help="packed row budget")
    ap.add_argument("--reps", type=int, default=None)
    args = ap.parse_args(argv)
    device = torch.device(args.device or ("cpu" if args.tiny or not torch.cuda.is_available()
                                          else "cuda"))
    if not args.tiny and device.type != "cuda":
        raise SystemExit("the Qwen3-1.7B-shaped run needs CUDA; use --tiny on the CPU")
    tasks = args.tasks or (2 if args.tiny else 4)
    plen = args.prompt or (24 if args.tiny else 768)
    new = args.new or (8 if args.tiny else 256)
    max_tokens = args.max_tokens or (64 if args.tiny else 8192)
    reps = args.reps or (1 if args.tiny else 2)
    if device.type == "cpu":
        torch.set_num_threads(1)

    info = dist_info(device)
    cfg = TINY if args.tiny else QWEN3_1P7B
    t0 = time.perf_counter()
    model = build_model(cfg, device)
    n_params = sum(p.numel() for p in model.parameters())
    gen = copy.deepcopy(model).to(torch.bfloat16 if device.type == "cuda" else torch.float32).eval()
    build_s = time.perf_counter() - t0
    rng = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, cfg["vocab_size"], (plen,), generator=rng).tolist()
               for _ in range(tasks)]
    prompts = [p for p in prompts for _ in range(args.group)]    # group of samples per task

    _peak_reset(device)
    t0 = time.perf_counter()
    toks, lps = rollout(gen, prompts, new, seed=2)
    if device.type == "cuda":
        torch.cuda.synchronize()
    rollout_s = time.perf_counter() - t0
    rollout_peak = _peak(device)
    del gen
    episodes = make_episodes(prompts, toks, lps, args.group, seed=3)
    generated = sum(len(t) for t in toks)

    wrapped = parallelize(RehearsalModel(model).train(), info,
                          precision="bf16" if device.type == "cuda" else "fp32")
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-6, weight_decay=0.0)
    t0 = time.perf_counter()
    rl_update(wrapped, opt, episodes, max_tokens, device)           # warm-up: compile, AdamW state
    if device.type == "cuda":
        torch.cuda.synchronize()
    warm_s = time.perf_counter() - t0
    _peak_reset(device)
    times, losses = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        loss, tokens = rl_update(wrapped, opt, episodes, max_tokens, device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(loss)
    update_peak = _peak(device)
    step_s = statistics.median(times)
    rate = matmul_tflops(device, torch.bfloat16 if device.type == "cuda" else torch.float32,
                         n=None if device.type == "cuda" else 512)
    res = {"params": n_params, "episodes": len(episodes), "prompt_tokens": plen,
           "generated_tokens": generated, "update_tokens": tokens, "max_tokens": max_tokens,
           "model_build_s": round(build_s, 2), "rollout_s": round(rollout_s, 3),
           "rollout_tokens_per_s": generated / rollout_s,
           "rollout_mfu": 2 * n_params * generated / rollout_s / (rate * 1e12),
           "warmup_update_s": round(warm_s, 3), "update_s": times,
           "update_median_s": step_s, "update_tokens_per_s": tokens / step_s,
           "update_mfu": 6 * n_params * tokens / step_s / (rate * 1e12),
           "matmul_tflops": rate, "rollout_peak_bytes": rollout_peak,
           "update_peak_bytes": update_peak, "losses": losses,
           "fsdp2": f"1-rank {info.backend}", "compute_dtype": "bf16" if device.type == "cuda"
           else "fp32"}
    if not all(math.isfinite(x) for x in losses):
        raise SystemExit(f"non-finite loss {losses}")
    gib = lambda b: "n/a" if b is None else f"{b / 2**30:.2f} GiB"  # noqa: E731
    print_table(f"e2e: {'tiny Qwen3' if args.tiny else 'Qwen3-1.7B-shaped'} ({n_params / 1e6:.1f}M "
                f"params) on {device}", [
                    {"phase": "rollout", "tokens/s": f"{res['rollout_tokens_per_s']:.0f}",
                     "time s": f"{rollout_s:.2f}", "peak mem": gib(rollout_peak),
                     "MFU": f"{100 * res['rollout_mfu']:.2f}%"},
                    {"phase": "RL update", "tokens/s": f"{res['update_tokens_per_s']:.0f}",
                     "time s": f"{step_s:.2f}", "peak mem": gib(update_peak),
                     "MFU": f"{100 * res['update_mfu']:.1f}%"}],
                ["phase", "tokens/s", "time s", "peak mem", "MFU"])
    path = output_path(args.json, "bench_e2e_tiny_cpu.json" if args.tiny else "bench_e2e_gpu.json",
                       args.record)
    write_json(path, {"benchmark": "bench_e2e_gpu", "hardware": hardware(device),
                      "model": "tiny-qwen3" if args.tiny else "qwen3-1.7b-shape (random init)",
                      "config": cfg, "argv": sys.argv[1:] if argv is None else argv, **res})
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
