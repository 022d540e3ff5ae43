"""A PREDICTED step time for the dry run: rollout on vLLM, the weight sync, the update -- per rank,
every rank in parallel -- as a range [optimistic, central, pessimistic] from the assumptions below.
Nothing here is measured: the device rates are the roofline basis of benchmarks/roofline.py (its
H200 numbers were measured on one H200, its H100 numbers are derived from them and the datasheet;
there they are a prediction basis, and so here), and the workload (episode lengths, efficiencies,
bandwidths) is assumed. Tool / environment time is not included.
"""
from __future__ import annotations

import math

# benchmarks/roofline.py DEVICES["h100"] (tests/test_dry_run_step_time.py checks they agree):
# bf16 dense large-GEMM rate and HBM bandwidth (bytes read + written) of an H100 SXM.
H100_TFLOPS = 790.0
H100_TBPS = 3.0
# (optimistic, central, pessimistic)
MFU = (0.6, 0.45, 0.3)                      # fraction of the large-GEMM rate a training GEMM mix reaches
PREFILL_MFU = (0.7, 0.5, 0.3)               # vLLM prefill, fraction of the same rate
DECODE_BW = (0.9, 0.7, 0.5)                 # fraction of HBM bandwidth a decode step reaches
CONTEXT_FRACTION = (0.25, 0.5, 1.0)         # episode tokens / rollout.max_episode_tokens
SAMPLED_TURNS = (1, 2, 4)                   # policy turns of max_new_tokens per episode (<= max_turns)
NET_GBPS = (50.0, 25.0, 12.5)               # per-GPU inter-node bandwidth, GB/s (400 / 200 / 100 Gb/s)
NVLINK_GBPS = (300.0, 200.0, 100.0)         # per-GPU bandwidth of collectives within one node, GB/s
GPUS_PER_NODE = 8                           # a world of at most 8 ranks is one node
COMM_EXPOSED = (0.0, 0.5, 1.0)              # share of FSDP2's collectives not hidden behind compute
HOST_GBPS = (10.0, 5.0, 2.0)                # GPU -> tmpfs safetensors write, and vLLM's reload from it

ASSUMPTIONS = [
    f"device: H100 SXM at {H100_TFLOPS:g} TFLOP/s bf16 and {H100_TBPS:g} TB/s (benchmarks/roofline.py's "
    f"basis: not measured on an H100)",
    f"episode length {CONTEXT_FRACTION} x rollout.max_episode_tokens; sampled tokens {SAMPLED_TURNS} x "
    f"rollout.max_new_tokens (capped by max_turns and the episode length)",
    f"training MFU {MFU}, vLLM prefill {PREFILL_MFU} of the GEMM rate; decode at {DECODE_BW} of HBM bandwidth, "
    f"weights + the rows' KV read once per step, all of a rank's rows decoded together",
    f"{GPUS_PER_NODE} GPUs a node; collectives at {NET_GBPS} GB/s per GPU across nodes, {NVLINK_GBPS} within "
    f"one; {COMM_EXPOSED} of FSDP2's all-gathers / reduce-scatters exposed",
    f"weight sync: fp32 all-gather of the whole model, bf16 safetensors to tmpfs and vLLM's reload at "
    f"{HOST_GBPS} GB/s",
    "not included: tool / environment latency, vLLM start-up, eval, checkpoints",
]


def predict_step_time(cfg, hf_config, world: int, n_params: int) -> dict:
    """Seconds per training step, each part as [optimistic, central, pessimistic]."""
    rc, ec = cfg.rollout, cfg.rollout.engine
    episodes = math.ceil(rc.tasks_per_step / world) * rc.group_size            # per rank
    n_layers, heads = hf_config.num_hidden_layers, hf_config.num_attention_heads
    hd = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    kv_token = 2 * n_layers * hf_config.num_key_value_heads * hd * 2         # bf16 K + V
    rate, bw = H100_TFLOPS * 1e12, H100_TBPS * 1e12
    per_token_layer_attn = 4 * heads * hd                                    # QK^T + PV, per context token
    rollout, sync, update = [], [], []
    for s in range(3):
        length = CONTEXT_FRACTION[s] * ec.max_episode_tokens
        sampled = min(min(SAMPLED_TURNS[s], ec.max_turns) * ec.max_new_tokens, length)
        # rollout: each row's context prefilled once (prefix caching), then `sampled` decode steps
        prefill = 2 * n_params * episodes * (length - sampled) / (rate * PREFILL_MFU[s])
        step_bytes = 2 * n_params + episodes * (length / 2) * kv_token
        step_flops = 2 * n_params * episodes
        decode = sampled * max(step_bytes / (bw * DECODE_BW[s]), step_flops / (rate * PREFILL_MFU[s]))
        rollout.append(prefill + decode)
        # weight sync: every rank receives the fp32 model, writes and reloads it in bf16
        net = (NVLINK_GBPS if world <= GPUS_PER_NODE else NET_GBPS)[s] * 1e9
        sync.append(4 * n_params * (world - 1) / world / net + 2 * 2 * n_params / (HOST_GBPS[s] * 1e9))
        # update: forward + backward (+ recompute) + no-grad forwards (old log-probs, reference)
        tokens = episodes * length
        fwd = 2 * n_params + n_layers * per_token_layer_attn * length / 2  # causal: half the context
        passes = 3 + (1 if cfg.model.activation_checkpointing else 0)
        nograd = (0 if (cfg.algo.updates_per_batch == 1 and ec.backend == "hf") else 1) + \
                 (1 if cfg.algo.loss.kl_coef > 0 else 0)
        flops = fwd * tokens * (passes * cfg.algo.updates_per_batch + nograd)
        micro = math.ceil(tokens / cfg.max_tokens)
        comm_bytes = (micro * cfg.algo.updates_per_batch * (2 * 2 + 4) + micro * nograd * 2) * n_params
        comm = COMM_EXPOSED[s] * comm_bytes * (world - 1) / world / net
        update.append(flops / (rate * MFU[s]) + comm)
    parts = {"rollout (vLLM)": rollout, "weight sync": sync, "update": update}
    shard = math.ceil(n_params / world)
    return {"is_a": "predicted (not measured)", "unit": "s", "range": "[optimistic, central, pessimistic]",
            "parts_s": {k: [round(v, 1) for v in vals] for k, vals in parts.items()},
            "total_s": [round(sum(v[i] for v in parts.values()), 1) for i in range(3)],
            "rollout_backend_in_config": ec.backend,
            "rollback_copy_ms": 2 * 12 * shard / bw * 1e3 if cfg.optim.rollback_nonfinite else 0.0,
            "assumptions": ASSUMPTIONS}


def format_step_time(st: dict) -> str:
    lo, mid, hi = st["total_s"]
    parts = "; ".join(f"{k} {v[1]:g} s ({v[0]:g}-{v[2]:g})" for k, v in st["parts_s"].items())
    note = ("" if st["rollout_backend_in_config"] == "vllm" else
            f" (this config rolls out with the {st['rollout_backend_in_config']} backend, which is not "
            f"predicted: the rollout line is vLLM's)")
    return (f"PREDICTED step time per rank (H100, not measured): {mid:g} s, range {lo:g}-{hi:g} s = {parts}"
            f"{note}; assumptions: " + " | ".join(st["assumptions"]))
