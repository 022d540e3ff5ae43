"""Markdown tables and PNG plots for eval results (matplotlib, Agg backend: no display needed)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}"


def results_markdown(res: dict[str, Any]) -> str:
    """One run: a row per category, then the overall line(s)."""
    title = f"### {res['suite']} -- policy `{res['policy']}`"
    if res.get("rehearsal", {}).get("budget"):
        r = res["rehearsal"]
        title += f", test-time rehearsal N={r['budget']} ({r.get('commit', 'memory')}, {r['mode']})"
    if res.get("drift"):
        title += f", drift `{res['drift']}`"
    has_fid = any("fidelity" in c for c in res["categories"].values())
    head = ("| category | n scored | accuracy (%) | errors (not scored) | gen tok/item | rehearsal tok/item | "
            "real calls/item | malformed turns |")
    sep = "|---|---:|---:|---:|---:|---:|---:|---:|"
    if has_fid:
        head += " fidelity exact | fidelity field F1 |"
        sep += "---:|---:|"
    lines = [title, "", head, sep]
    for name, c in res["categories"].items():
        row = (f"| {name} | {c['n']} | {_pct(c['accuracy'])} | {c.get('errors', 0)} | {c['mean_gen_tokens']:.0f} | "
               f"{c['mean_rehearsal_tokens']:.0f} | {c['mean_real_calls']:.2f} | {c['malformed_turns']} |")
        if has_fid:
            f = c.get("fidelity") or {}
            row += f" {_pct(f.get('exact'))} | {_pct(f.get('field_f1'))} |"
        lines.append(row)
    lines.append("")
    lines.append(f"**overall: {_pct(res.get('overall'))}%**" + (
        f" (BFCL strict formula, categories not run = 0: {_pct(res['bfcl_overall_strict'])}%)"
        if res.get("bfcl_overall_strict") is not None else ""))
    errors = sum(c.get("errors", 0) for c in res["categories"].values())
    if errors:
        examples = sorted({e for c in res["categories"].values() for e in c.get("error_examples", [])})
        lines.append("")
        lines.append(f"**{errors} item(s) could not run** (errors, not counted in accuracy; a rerun with "
                     f"the same --out retries them): " + "; ".join(examples[:3]))
    return "\n".join(lines) + "\n"


def plot_categories(res: dict[str, Any], path: str | Path) -> Path:
    names = list(res["categories"])
    raw = [res["categories"][n]["accuracy"] for n in names]     # None: no item could run
    acc = [0.0 if a is None else 100 * a for a in raw]
    fig, ax = plt.subplots(figsize=(max(4.0, 0.7 * len(names) + 2), 3.2))
    ax.bar(range(len(names)), acc, color="#4477aa")
    ax.set_xticks(range(len(names)), names, rotation=35, ha="right", fontsize=8)
    ax.set_ylim(0, 100)
    ax.set_ylabel("accuracy (%)")
    ax.set_title(f"{res['suite']} / {res['policy']}", fontsize=9)
    for i, (a, r) in enumerate(zip(acc, raw)):
        ax.text(i, a + 1, "n/a" if r is None else f"{a:.0f}", ha="center", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def write_run_report(res: dict[str, Any], out_dir: str | Path) -> list[Path]:
    out = Path(out_dir)
    md = out / "results.md"
    md.write_text(results_markdown(res))
    return [md, plot_categories(res, out / "accuracy.png")]

