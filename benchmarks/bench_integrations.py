"""TRL GRPOTrainer's loss phase: its own LM head vs fastrehearse's (log-probs only / fused loss).

    nice python benchmarks/bench_integrations.py [--model llama|qwen3_moe] [--vocab 16384 49152]

One training step's loss phase (model forward, LM head, GRPO loss, backward) of trl 1.16's
`GRPOTrainer.compute_loss` on a fixed on-policy batch (prompts + sampled-length completions,
random advantages; generation is not part of it), for a tiny random Llama (tied head) or
Qwen3-MoE (8 experts, top-2, TRL's default router aux loss on) at several vocabulary sizes, side
by side in one run (round-robin, `_common.time_interleaved`):

    trl          trl.GRPOTrainer (its chunked head `add_fused_lm_head`, its loss)
    fr-logprobs  FastGRPOTrainer(fused_loss=False): fastrehearse head, TRL's loss in torch
    fr-fused     FastGRPOTrainer: fused linear_policy_loss, on-policy (old_logp=None)
    fr-fused-noent  the same with entropy_metric=False (no entropy for TRL's "entropy" log entry)

All compute the same loss and gradients (tests/test_integration_trl.py). Peak memory is
the loss phase's peak RSS above what was live before it (CPU) / max allocated (CUDA).
Writes runs/bench/bench_integrations_{cpu,gpu}[_<model>].{json,png} (--record: benchmarks/results/).
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (RESULTS, bar_plot, output_path, default_json, fmt_bytes, hardware,  # noqa: E402
                     print_table, time_interleaved, write_json)

METHODS = ("trl", "fr-logprobs", "fr-fused", "fr-fused-noent")


def tiny_model(kind, vocab, hidden, layers, seed=0):
    import transformers
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=1024, tie_word_embeddings=True, pad_token_id=0,
                  eos_token_id=1, bos_token_id=None)
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common)).float()
    if kind == "qwen3_moe":   # router_aux_loss_coef 0.001 by default: TRL adds the aux loss
        cfg = transformers.Qwen3MoeConfig(**common, moe_intermediate_size=hidden // 2,
                                          num_experts=8, num_experts_per_tok=2)
        return transformers.Qwen3MoeForCausalLM(cfg).float()
    raise ValueError(f"unknown --model {kind!r}")


def batch(vocab, b, prompt_len, completion_len, seed=1):
    """What GRPOTrainer._compute_loss consumes for one on-policy micro-batch (beta = 0)."""
    g = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(2, vocab, (b, prompt_len), generator=g)
    prompt_mask = torch.ones_like(prompt_ids)
    prompt_mask[: b // 2, : prompt_len // 4] = 0                     # left padding
    completion_ids = torch.randint(2, vocab, (b, completion_len), generator=g)
    lengths = torch.randint(completion_len // 2, completion_len + 1, (b,), generator=g)
    completion_mask = (torch.arange(completion_len) < lengths[:, None]).long()
    adv = torch.randn(b, generator=g)
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask,
            "completion_ids": completion_ids, "completion_mask": completion_mask,
            "advantages": (adv - adv.mean()) / adv.std(),
            "num_items_in_batch": completion_mask.sum(), "old_per_token_logps": None}


def make_trainer(method, model, workdir):
    import transformers
    import trl
    from datasets import Dataset
    from fastrehearse.integrations.trl import FastGRPOTrainer
    from tokenizers import Tokenizer, models
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"<pad>": 0, "<eos>": 1, "a": 2}, "a")),
        pad_token="<pad>", eos_token="<eos>")
    args = trl.GRPOConfig(output_dir=str(workdir), use_cpu=not torch.cuda.is_available(),
                          report_to="none", per_device_train_batch_size=4, num_generations=4,
                          max_completion_length=8, bf16=False, save_strategy="no")
    kw = dict(model=model, args=args, reward_funcs=lambda completions, **k: [0.0] * len(completions),
              train_dataset=Dataset.from_dict({"prompt": ["a"] * 8}), processing_class=tok)
    if method == "trl":
        tr = trl.GRPOTrainer(**kw)
    else:
        tr = FastGRPOTrainer(**kw, fused_loss=method.startswith("fr-fused"),
                             entropy_metric=method != "fr-fused-noent")
    tr.current_gradient_accumulation_steps = 1   # set by Trainer.train(); we call compute_loss
    tr.model.train()
    return tr


def run_config(vocab, args, device, workdir):
    base = tiny_model(args.model, vocab, args.hidden, args.layers)
    inputs = {k: (v.to(device) if isinstance(v, torch.Tensor) else v)
              for k, v in batch(vocab, args.batch, args.prompt_len, args.completion_len).items()}
    steps, trainers = {}, {}
    for m in METHODS:
        tr = make_trainer(m, copy.deepcopy(base).to(device), workdir / m)
        trainers[m] = tr

        def step(tr=tr):
            tr.compute_loss(tr.model, inputs).backward()

        def reset(tr=tr):
            tr.model.zero_grad(set_to_none=True)
        steps[m] = (step, reset)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = time_interleaved(steps, device, warmup=1, reps=args.reps)
    for m in ("fr-fused", "fr-fused-noent"):
        if "error" not in res[m]:
            assert trainers[m].fused_loss_calls > 0, f"{m}: fused path not taken"
    n_tokens = int(inputs["completion_mask"].sum())
    return res, n_tokens


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=["llama", "qwen3_moe"], default="llama")
    p.add_argument("--vocab", type=int, nargs="+", default=[4096, 16384, 49152])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--completion-len", type=int, default=96)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=None,
                   help="output JSON (default runs/bench/<name>; --record: benchmarks/results/)")
    p.add_argument("--record", action="store_true",
                   help="write into benchmarks/results/, replacing the committed result")
    p.add_argument("--plot-only", type=Path, default=None, help="redraw the PNGs of a JSON")
    args = p.parse_args(argv)
    if args.plot_only:
        import json
        d = json.loads(args.plot_only.read_text())
        st = argparse.Namespace(**d["settings"])
        return plot(args.plot_only, d["rows"], d["hardware"]["device"], st)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for v in args.vocab:
            res, n_tok = run_config(v, args, device, Path(tmp) / str(v))
            ref = res["trl"].get("median_ms")
            for m in METHODS:
                r = res[m]
                row = {"V": v, "method": m, "completion_tokens": n_tok}
                if "error" in r:
                    row["error"] = r["error"]
                    print(f"  V={v} {m}: {r['error']}")
                else:
                    row.update(median_ms=round(r["median_ms"], 1),
                               times_ms=[round(t, 1) for t in r["times_ms"]],
                               peak_extra_bytes=r.get("peak_extra_bytes"),
                               vs_trl=round(r["median_ms"] / ref, 3) if ref else None)
                rows.append(row)
    table = [{**r, "peak": fmt_bytes(r.get("peak_extra_bytes")),
              "vs trl": r.get("vs_trl", ""), "median ms": r.get("median_ms", r.get("error"))}
             for r in rows]
    shape = (f"{args.model} H={args.hidden} L={args.layers} tied head, {args.batch} seqs x "
             f"({args.prompt_len} prompt + <= {args.completion_len} completion), on-policy")
    print_table(f"TRL GRPOTrainer loss phase (fwd + head + loss + bwd), {device.type}: {shape}",
                table, ["V", "method", "median ms", "vs trl", "peak"])
    # side-by-side ratio per round (the rounds interleave the methods, so load changes hit
    # both alike), then the median over rounds
    fused_vs_lp, vs_trl = {}, {}
    for v in args.vocab:
        by = {r["method"]: r for r in rows if r["V"] == v and "times_ms" in r}
        for m in METHODS[1:]:
            for base, into in (("fr-logprobs", fused_vs_lp), ("trl", vs_trl)):
                if m in by and base in by and m != base and (base == "trl" or "fused" in m):
                    pairs = [a / b for a, b in zip(by[m]["times_ms"], by[base]["times_ms"])]
                    into.setdefault(m, {})[v] = round(statistics.median(pairs), 3)
    print("time / TRL's own head + loss, median of per-round ratios:", vs_trl)
    print("fused on-policy / (log-probs + torch loss), median of per-round ratios:", fused_vs_lp)
    name = "bench_integrations" if args.model == "llama" else f"bench_integrations_{args.model}"
    out = output_path(args.out, default_json(name, device).name, args.record)
    write_json(out, {"benchmark": "bench_integrations", "hardware": hardware(device),
                     "settings": vars(args) | {"out": str(out)}, "shape": shape,
                     "methods": {"trl": "trl.GRPOTrainer 1.16 (own chunked head + loss)",
                                 "fr-logprobs": "FastGRPOTrainer(fused_loss=False)",
                                 "fr-fused": "FastGRPOTrainer fused loss, old_logp=None",
                                 "fr-fused-noent": "fr-fused with entropy_metric=False"},
                     "rows": rows, "fused_over_logprobs_time_paired_median": fused_vs_lp,
                     "over_trl_time_paired_median": vs_trl})
    plot(out, rows, device.type, args)
    return rows


def plot(out, rows, kind, args):
    vocab = sorted({r["V"] for r in rows})
    groups = [f"V={v}" for v in vocab]
    look = {(r["V"], r["method"]): r for r in rows}
    png = Path(out).with_suffix(".png")
    what = f"{kind}, {getattr(args, 'model', 'llama')} H={args.hidden} L={args.layers}, {args.batch} seqs, on-policy"
    bar_plot(png, groups, {m: [look.get((v, m), {}).get("median_ms") for v in vocab]
                           for m in METHODS},
             ylabel="loss-phase median ms", title=f"TRL GRPOTrainer loss phase ({what})")
    bar_plot(png.with_name(png.stem + "_memory.png"), groups,
             {m: [(look.get((v, m), {}).get("peak_extra_bytes") or 0) / 2**20 for v in vocab]
              for m in METHODS},
             ylabel="loss-phase peak extra MiB", title=f"TRL GRPOTrainer loss-phase memory ({what})")


if __name__ == "__main__":
    main()
