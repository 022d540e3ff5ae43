"""Role-wise GRPO loss fwd+bwd: fused one-pass (6NHV) vs unfused (linear_logprobs + torch loss,
8NHV) vs Liger's chunked GRPO loss.

    python benchmarks/bench_policy_loss.py [--json PATH] [--n 4096] [--fracs 1 0.25]

Inputs: N tokens, a fraction `frac` loss-bearing (ACT / REHEARSE / OBSERVED mixed, the rest
CONTEXT), PPO-clip + k3 KL (kl_coef 0.04). Liger's LigerFusedLinearGRPOLoss gets the same
tokens as [B, 256] sequences with the loss-bearing tokens in its attention mask, per-sequence
advantages, loss_type "dapo" (token-mean), beta 0.04 with reference log-probs: comparable work,
not identical math (it has no roles). Reported: median time, peak extra memory, TFLOP/s counted
as 6 * N_loss * H * V for every method, ratios to the unfused path.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (add_output_args, output_path, plot_by_config, default_json, fmt_bytes, hardware, peak_extra_bytes,  # noqa: E402
                     print_table, randn_on, successful, time_fn, time_interleaved, write_json)

from fastrehearse.kernels import PolicyLossConfig, Role, linear_policy_loss  # noqa: E402

GPU_SHAPES = [(576, 49152), (2048, 151936), (4096, 128256)]
SEQ = 256
CFG = PolicyLossConfig(kl_coef=0.04, kl_type="k3", w_observed=0.1)


def make_inputs(n, h, v, frac, device, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = randn_on((n, h), device, dtype, g).requires_grad_()
    w = randn_on((v, h), device, dtype, g, scale=h ** -0.5).requires_grad_()
    t = torch.randint(0, v, (n,), generator=g)
    roles = torch.randint(1, 4, (n,), generator=g)
    roles[torch.rand(n, generator=g) >= frac] = int(Role.CONTEXT)
    seq_adv = torch.randn(n // SEQ + 1, generator=g)
    adv = seq_adv[torch.arange(n) // SEQ]
    old = -10.0 + 0.3 * torch.randn(n, generator=g)  # near log(1/V) for random weights
    ref = old + 0.1 * torch.randn(n, generator=g)
    d = dict(t=t, roles=roles, adv=adv, old=old, ref=ref, seq_adv=seq_adv)
    return x, w, {k: val.to(device) for k, val in d.items()}


def m_ours(fused, backend, weight_dtype_acc=False, **kw):
    def make(x, w, b):
        if weight_dtype_acc:        # the low-precision dW accumulator (a no-op for fp32 weights)
            kw["dw_accum_dtype"] = w.dtype

        def run():
            out = linear_policy_loss(x, w, b["t"], b["roles"], b["adv"], b["old"], CFG,
                                     ref_logp=b["ref"], fused=fused, backend=backend, **kw)
            out.loss.backward()
            return out.loss.detach()
        return run
    return make


def m_liger(x, w, b, compiled=True):
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
    n, h = x.shape
    bsz = n // SEQ
    loss_fn = LigerFusedLinearGRPOLoss(beta=0.04, compiled=compiled, use_ref_model=True,
                                       chunk_size=1, loss_type="dapo")
    mask = (b["roles"] != int(Role.CONTEXT))[: bsz * SEQ].view(bsz, SEQ).long()
    ids = b["t"][: bsz * SEQ].view(bsz, SEQ)
    old = b["old"][: bsz * SEQ].view(bsz, SEQ)
    ref = b["ref"][: bsz * SEQ].view(bsz, SEQ)
    adv = b["seq_adv"][:bsz]

    def run():
        xs = x[: bsz * SEQ].view(bsz, SEQ, h)
        out = loss_fn(xs, w, ids, mask, adv, ref_per_token_logps=ref, old_per_token_logps=old)
        loss = out[0] if isinstance(out, tuple) else out
        loss.backward()
        return loss.detach()
    return run


def methods(device):
    cuda = device.type == "cuda"
    out = []
    if cuda:
        out += [("fused (triton)", m_ours(True, "triton")), ("unfused (triton)", m_ours(False, "triton")),
                # the opt-in low-precision dW accumulator at the 1.5 GiB workspace target (docs/gpu.md)
                ("fused (triton, bf16 dW, 1.5 GiB)",
                 m_ours(True, "triton", weight_dtype_acc=True, workspace_bytes=3 << 29))]
    out += [("fused (torch)", m_ours(True, "torch")), ("unfused (torch)", m_ours(False, "torch"))]
    try:
        import liger_kernel.chunked_loss  # noqa: F401
        out.append(("liger chunked GRPO", m_liger))
    except ImportError:
        pass
    return out


def bench_one(factory, x, w, b, device, reps):
    run = factory(x, w, b)

    def step():
        x.grad = w.grad = None
        return run()

    step()  # warm-up / compile
    box = {}
    x.grad = w.grad = None  # the warm-up's gradients must not sit in the baseline
    mem = peak_extra_bytes(lambda: box.update(t=time_fn(step, device, warmup=0, reps=1)), device)
    rest = time_fn(step, device, warmup=0, reps=reps - 1)["times_ms"] if reps > 1 else []
    times = [box["t"]["median_ms"]] + rest
    x.grad = w.grad = None
    return {"median_ms": statistics.median(times), "times_ms": times}, mem


def _reset(x, w):
    x.grad = w.grad = None


def _stepper(run, x, w):
    def step():
        _reset(x, w)
        return run()
    return step


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_output_args(p)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--n", type=int, nargs="+", default=None)
    p.add_argument("--fracs", type=float, nargs="+", default=None)
    p.add_argument("--shapes", type=str, nargs="+", default=None, help="HxV, e.g. 576x49152")
    p.add_argument("--methods", type=str, nargs="+", default=None)
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--interleave", action=argparse.BooleanOptionalAction, default=None,
                   help="time the methods of a config round-robin (default on CPU)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="input dtype (default: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default 1: shared box)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if args.interleave is None:
        args.interleave = not cuda
    if not cuda:
        torch.set_num_threads(args.threads or 1)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if cuda else torch.float32)
    ns = args.n or ([4096, 16384] if cuda else [4096])
    fracs = args.fracs or ([1.0, 0.5, 0.25] if cuda else [1.0, 0.25])
    shapes = ([tuple(int(s) for s in sh.split("x")) for sh in args.shapes] if args.shapes
              else (GPU_SHAPES if cuda else [(576, 49152)]))
    reps = args.reps or (10 if cuda else 3)
    path = output_path(args.json, default_json("bench_policy_loss", device).name, args.record)
    hw = hardware(device)
    print(hw)
    rows, skipped = [], {}
    for h, v in shapes:
        for n in ns:
            for frac in fracs:
                x, w, b = make_inputs(n, h, v, frac, device, dtype)
                n_loss = int((b["roles"] != int(Role.CONTEXT)).sum())
                flops = 6 * n_loss * h * v
                todo = [(name, f) for name, f in methods(device)
                        if not args.methods or name in args.methods]
                results = {}
                if args.interleave:
                    steps = {}
                    for name, factory in todo:
                        try:
                            run = factory(x, w, b)
                        except Exception as e:
                            results[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                            continue
                        steps[name] = (_stepper(run, x, w), lambda: _reset(x, w))
                    results.update(time_interleaved(steps, device, warmup=1, reps=reps))
                else:
                    for name, factory in todo:
                        try:
                            tm, mem = bench_one(factory, x, w, b, device, reps)
                            results[name] = dict(tm, peak_extra_bytes=mem)
                        except Exception as e:  # a peer failing must not kill the benchmark
                            _reset(x, w)
                            results[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                for name, res in successful(results, [n for n, _ in todo], skipped):
                    ms, mem = res["median_ms"], res["peak_extra_bytes"]
                    rows.append(dict(H=h, V=v, N=n, frac=frac, n_loss=n_loss, method=name,
                                     median_ms=round(ms, 2),
                                     times_ms=[round(s, 2) for s in res["times_ms"]],
                                     peak_extra_bytes=mem,
                                     tflops=round(flops / (ms * 1e-3) / 1e12, 4)))
                    print(f"  H={h} V={v} N={n} frac={frac} {name}: {ms:.1f} ms {fmt_bytes(mem)}",
                          flush=True)
                del x, w, b
                # after every configuration: a timeout later must not lose these numbers
                save(path, rows, skipped, hw, dtype, args, final=False)
    save(path, rows, skipped, hw, dtype, args, final=True)


def save(path, rows, skipped, hw, dtype, args, *, final):
    """Ratios to the unfused path, the JSON (every call) and, at the end, the table and PNG."""
    for r in rows:
        key = (r["H"], r["V"], r["N"], r["frac"])
        kind = "triton" if "triton" in r["method"] else "torch"
        base = next((b for b in rows if b["method"] == f"unfused ({kind})" and
                     (b["H"], b["V"], b["N"], b["frac"]) == key), None)
        if base:
            r["time_vs_unfused"] = round(r["median_ms"] / base["median_ms"], 3)
            if r["peak_extra_bytes"] is not None and base["peak_extra_bytes"]:
                r["mem_vs_unfused"] = round(r["peak_extra_bytes"] / base["peak_extra_bytes"], 3)
    write_json(path, {"benchmark": "bench_policy_loss", "hardware": hw, "dtype": str(dtype),
                      "config": CFG.__dict__, "flops_counted": "6 * n_loss * H * V",
                      "load_avg_end": os.getloadavg(), "argv": sys.argv[1:],
                      "timing": "interleaved round-robin per config" if args.interleave else
                      "sequential per method", "complete": final, "rows": rows,
                      "skipped": skipped})
    if not final:
        return
    table = [dict(r, shape=f"{r['H']}x{r['V']}", mem=fmt_bytes(r["peak_extra_bytes"])) for r in rows]
    print_table(f"role-wise GRPO loss fwd+bwd, {dtype}, {hw.get('gpu') or hw['cpu']}", table,
                ["shape", "N", "frac", "method", "median_ms", "mem", "tflops",
                 "time_vs_unfused", "mem_vs_unfused"])
    for name, note in skipped.items():
        print(f"skipped {name}: {note}")
    plot_by_config(path.with_suffix(".png"), rows,
                   title=f"GRPO loss fwd+bwd ({hw.get('gpu') or hw['cpu']})")


if __name__ == "__main__":
    main()
