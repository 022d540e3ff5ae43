"""Every figure the README's result tables and cited prose quote is recomputed from its results JSON
under benchmarks/results/ and must appear, as formatted here, on the README line that cites it; a
table cell may hold no number that its JSON does not give. The check is also run on copies of the
README with one figure edited, and must fail on each.

Not covered here: the dry-run table (a plan printed by `--dry-run`, no results JSON), the published
peer figures (quoted from their sources), the vLLM rollout table (its JSON is being re-measured)."""
from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RES = ROOT / "benchmarks" / "results"
NUM = re.compile(r"\d+(?:\.\d+)?")


def _j(name: str):
    return json.loads((RES / name).read_text())


def x2(v: float) -> str:
    return f"{v:.2f}x"


def rng(lo: float, hi: float, fmt: str) -> str:
    a, b = format(lo, fmt), format(hi, fmt)
    return a if a == b else f"{a}-{b}"


def _row(rows, method, frac):
    (r,) = [r for r in rows if r["method"] == method and r["frac"] == frac]
    return r


def measured_table() -> dict[str, list[str]]:
    """The headline 'Measured' table: the JSON cell of a row -> the figures of its result cell."""
    out = {}
    lp = _j("bench_logprobs_cpu.json")["rows"]
    ours, naive, ours25 = _row(lp, "ours (torch)", 1.0), _row(lp, "naive", 1.0), _row(lp, "ours (torch)", 0.25)
    out["`bench_logprobs_cpu.json`"] = [
        x2(ours["time_vs_naive"]), f"{100 * ours['peak_extra_bytes'] / naive['peak_extra_bytes']:.1f}%",
        f"{ours['peak_extra_bytes'] / 2**20:.0f} MiB", f"{naive['peak_extra_bytes'] / 2**30:.2f} GiB",
        x2(ours25["time_vs_naive"]), "25%"]
    fw = _j("bench_logprobs_fwd_cpu.json")["rows"]
    ours, naive = _row(fw, "ours (torch)", 1.0), _row(fw, "naive", 1.0)
    out["`bench_logprobs_fwd_cpu.json`"] = [
        x2(ours["time_vs_naive"]), f"{ours['peak_extra_bytes'] / 2**20:.0f} MiB",
        f"{naive['peak_extra_bytes'] / 2**30:.2f} GiB"]
    pl = _j("bench_policy_loss_cpu.json")["rows"]
    out["`bench_policy_loss_cpu.json`"] = [x2(_row(pl, "fused (torch)", 1.0)["time_vs_unfused"]),
                                           x2(_row(pl, "fused (torch)", 0.25)["time_vs_unfused"]), "25%"]
    ts, ac = _j("bench_train_step_smollm2_cpu.json"), _j("bench_train_step_smollm2_cpu_ac.json")
    out["`bench_train_step_smollm2_cpu*.json`"] = [
        x2(ts["speedup_tokens_per_s"]), x2(ts["peak_memory_ratio"]), x2(ac["peak_memory_ratio"])]
    eff = _j("bench_packing_cpu.json")["efficiency"]
    med = {m: [statistics.median(r[m] for r in eff if r["max_tokens"] == b)
               for b in sorted({r["max_tokens"] for r in eff})] for m in ("ours_eff", "greedy_eff", "padded_eff")}
    out["`bench_packing_cpu.json`"] = [
        rng(100 * min(med["ours_eff"]), 100 * max(med["ours_eff"]), ".1f") + "%",
        rng(100 * min(med["greedy_eff"]), 100 * max(med["greedy_eff"]), ".0f") + "%",
        rng(100 * min(med["padded_eff"]), 100 * max(med["padded_eff"]), ".0f") + "%"]
    ro = _j("rollout_smollm2.json")["ratios"]
    out["`rollout_smollm2.json`"] = [f"{ro['prefill_tokens_separate_over_inline']:.2f}x",
                                     x2(ro["wall_separate_over_inline"])]
    figs = []
    for name in ("bench_integrations_cpu.json", "bench_integrations_qwen3_moe_cpu.json"):
        d = _j(name)
        t = list(d["over_trl_time_paired_median"]["fr-fused"].values())
        by = {(r["V"], r["method"]): r["peak_extra_bytes"] for r in d["rows"]}
        m = [by[v, "fr-fused"] / by[v, "trl"] for v in sorted({v for v, _ in by})]
        figs += [rng(min(t), max(t), ".2f") + "x", rng(min(m), max(m), ".2f") + "x"]
    out["`bench_integrations_cpu.json`, `bench_integrations_qwen3_moe_cpu.json`"] = figs
    rc = {r["method"]: r for r in _j("bench_rehearsal_cache.json")["rows"]}
    out["`bench_rehearsal_cache.json`"] = [x2(rc["prefix cache"]["x_cpu"])]
    return out


# the predicted table: the row's first cell -> (method, design_key, N) in roofline_h200.json
PREDICTED = {
    "| `linear_logprobs` (vocabulary-outer backward": ("ours-logprobs", "vocab-outer", 16384),
    "| `linear_policy_loss`, fused (3 GiB budget": ("ours-fused-loss", "budgeted", 16384),
    "| same, opt-in `dw_accum_dtype=torch.bfloat16`": ("ours-fused-loss", "budgeted-bf16", 16384),
    "at Liger's H200 shape (below)": ("ours-fused-loss", "budgeted", 4096),
}


def predicted_table() -> dict[str, list[str]]:
    recs = [r for r in _j("roofline_h200.json") if r.get("kind") == "prediction"
            and (r["H"], r["V"], r["unmasked"]) == (4096, 128256, 1.0)]
    out = {}
    for key, (method, design, n) in PREDICTED.items():
        (r,) = [r for r in recs if (r["method"], r["design_key"], r["N"]) == (method, design, n)]
        lo, hi = r["predicted_ms_range"]
        flo, fhi = r["ratio_to_floor_range"]
        out[key] = [str(n), f"{r['predicted_ms']:.1f} [{lo:.1f} - {hi:.1f}]",
                    f"{r['ratio_to_floor']:.2f}x [{flo:.2f} - {fhi:.2f}]",
                    f"{r['workspace_bytes'] / 2**30:.2f} GiB"]
    return out


def _targets() -> dict[str, dict]:
    import importlib.util
    import sys
    spec = importlib.util.spec_from_file_location("fr_roofline_fig", ROOT / "benchmarks" / "roofline.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["fr_roofline_fig"] = mod
    spec.loader.exec_module(mod)
    recs = [r for r in _j("roofline_h200.json") if r.get("kind") == "prediction"]
    return {t["design_key"] + "/" + t["method"]: t for t in mod.targets(recs)}


def _t25(t: dict) -> str:
    lo, hi = t["unmasked_25_ratio_range"]
    return f"{t['unmasked_25_ratio']:.3f}x [{lo:.3f} - {hi:.3f}]"


def _tfloor(t: dict) -> str:
    lo, hi = t["time_vs_target_floor_range"]
    return f"{t['time_vs_target_floor']:.2f}x [{lo:.2f} - {hi:.2f}]"


def prose() -> dict[str, list[str]]:
    """Figures in sentences (line key -> figures that line must hold)."""
    tg = _targets()
    lp, fl = tg["vocab-outer/ours-logprobs"], tg["budgeted/ours-fused-loss"]
    demo = _j("demo_backends_cpu.json")
    hf = [r for r in demo["runs"] if r["variant"] == "hf" and r["returncode"] == 0]
    vl = [r for r in demo["runs"] if r["variant"] == "vllm-eager" and r["returncode"] == 0]
    after = {m for r in hf for _, m in r["messages"] if m.startswith("eval after")}
    assert len(after) == 1, after          # every hf run ended on the same table: none is picked
    succ, n, fid = re.search(r"success ([\d.]+) on (\d+) held-out tasks, fidelity ([\d.]+)", after.pop()).groups()
    before = {r["success_before"] for r in hf}
    assert len(before) == 1
    wall = demo["summary"]["hf"]["wall_s_median"]
    loads = [r["loadavg_1m_mean"] for r in demo["runs"]]
    rl = (statistics.median(sum(r["rl_rollout_s"]) for r in hf)
          / statistics.median(sum(r["rl_rollout_s"]) for r in vl))
    sync = statistics.median(w for r in vl for w in r["weight_sync_s"] if w)
    starts = [r["startup_s"] for r in vl]
    mem = _j("load_memory_cpu.json")
    sharded = [r["added_policy_ref_mib"] for r in mem["methods"]["sharded"]["per_rank"]]
    whole = [r["added_policy_ref_mib"] for r in mem["methods"]["whole"]["per_rank"]]
    return {
        "design in the code; at 25% loss rows the predicted time is": [_t25(lp)],
        "(`linear_logprobs`) and": [_t25(fl)],
        "GPU time <= 1.10x of the FLOP floor (predicted": [f"{_tfloor(lp)} / {_tfloor(fl)}"],
        "task success, held-out": [f"{100 * before.pop():.1f}%", f"{100 * float(succ):.1f}%", f"{n} EASY tasks"],
        "world-model fidelity (field F1)": [f"{100 * float(fid):.1f}%"],
        "wall there, median of": [f"{int(wall // 60)} min {round(wall % 60)} s", f"{len(hf)} runs"],
        "interleaved rounds, medians, load": [rng(min(loads), max(loads), ".1f"),
                                              f"{wall:.0f} s on hf",
                                              f"{demo['summary']['vllm-eager']['wall_s_median']:.0f} s on vLLM eager",
                                              "eager (" + x2(demo["summary"]["vllm-eager"]["wall_vs_hf"])],
        "short EASY episodes, but its": [f"{rl:.1f}x faster",
                                         f"{demo['summary']['vllm-eager']['startup_s_median']:.0f} s start-up"],
        "weight sync per step cost more": [f"~{sync:.1f} s weight sync"],
        "with `rollout.vllm.enforce_eager`": [rng(min(starts), max(starts), ".0f") + " s"],
        "KL reference took": [f"{statistics.median(sharded):.0f} MiB per rank",
                              f"{statistics.median(whole):.0f} MiB for the"],
        "whole-copy loading it replaced": [f"{mem['world_size']} CPU ranks", f"{mem['params'] / 1e6:.0f}M parameters"],
    }


def _line(text: str, key: str) -> str:
    lines = [ln for ln in text.splitlines() if key in ln]
    if len(lines) != 1:
        raise LookupError(f"{len(lines)} README lines hold {key!r}")
    return lines[0]


def check(text: str) -> list[str]:
    """Every mismatch between the README text and the JSONs, one line each."""
    errors = []
    # (figures, the table cells that may hold only those figures' numbers; None: prose)
    groups = [(measured_table(), slice(1, 2)), (predicted_table(), slice(1, None)), (prose(), None)]
    for figures, cells in groups:
        for key, figs in figures.items():
            try:
                line = _line(text, key)
            except LookupError as e:
                errors.append(str(e))
                continue
            errors += [f"{key}: {f!r} not on its line" for f in figs if f not in line]
            if cells is None:
                continue
            quoted = [c.strip() for c in line.strip().strip("|").split("|")][cells]
            allowed = {n for f in figs for n in NUM.findall(f)}
            errors += [f"{key}: {n} has no JSON figure" for c in quoted for n in NUM.findall(c)
                       if n not in allowed]
    return errors


README = (ROOT / "README.md").read_text()


def test_readme_figures_match_their_json():
    assert check(README) == []


def _all_figures():
    out = []
    for group in (measured_table(), predicted_table(), prose()):
        for key, figs in group.items():
            out += [(key, f) for f in figs]
    return out


@pytest.mark.parametrize("key, fig", _all_figures())
def test_an_edited_figure_fails(key, fig):
    line = _line(README, key)
    m = re.search(r"\d", fig)
    edited = fig[:m.start()] + str((int(fig[m.start()]) + 1) % 10) + fig[m.start() + 1:]
    bad = README.replace(line, line.replace(fig, edited, 1))
    assert bad != README
    errs = check(bad)
    assert errs and any(key in e for e in errs), (key, fig, errs)


def test_a_number_without_json_fails():
    line = _line(README, "`bench_policy_loss_cpu.json`")
    cells = line.split("|")
    cells[2] = cells[2] + " and 0.66x at 50% loss rows "
    errs = check(README.replace(line, "|".join(cells)))
    assert any("0.66 has no JSON figure" in e for e in errs), errs
    assert any("50 has no JSON figure" in e for e in errs), errs
