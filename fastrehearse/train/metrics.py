"""Run metrics: progress bar, metrics.jsonl, a PNG of the curves, optional TensorBoard / wandb, and
the final rich table. Only rank 0 writes or prints; other ranks get a silent logger.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

PLOTTED = [("reward", "reward (task success)"), ("fidelity", "world-model fidelity"),
           ("loss", "loss"), ("tokens_per_s", "train tokens / s")]


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


class MetricsLogger:
    def __init__(self, run_dir: str | Path, *, enabled: bool = True, total_steps: int = 0,
                 progress: bool = True, plot_every: int = 1, tensorboard: bool = False,
                 wandb: bool = False, wandb_project: str = "fastrehearse", config: dict | None = None):
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "metrics.jsonl"
        self.png = self.run_dir / "curves.png"
        self.plot_every = plot_every
        self.rows: list[dict] = []
        self.bar = self.tb = self.wandb = None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.path.exists():   # resumed run: keep history for the plot
            self.rows = [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]
        if progress and total_steps > 0:
            from tqdm.auto import tqdm
            self.bar = tqdm(total=total_steps, desc="train", dynamic_ncols=True)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.tb = SummaryWriter(str(self.run_dir / "tb"))
            except ImportError:
                print("[fastrehearse] log.tensorboard=true but tensorboard is not installed; skipped")
        if wandb:
            try:
                import wandb as _wandb
                self.wandb = _wandb.init(project=wandb_project, dir=str(self.run_dir), config=config)
            except ImportError:
                print("[fastrehearse] log.wandb=true but wandb is not installed; skipped")

    def set_progress(self, n: int, total: int | None = None, desc: str | None = None) -> None:
        if self.bar is None:
            return
        if total is not None:
            self.bar.total = total
        if desc is not None:
            self.bar.set_description(desc)
        self.bar.n = n
        self.bar.refresh()

    def log(self, row: dict) -> None:
        if not self.enabled:
            return
        row = {"time": round(time.time(), 3), **row}
        self.rows.append(row)
        with open(self.path, "a") as f:
            f.write(json.dumps(row, default=float) + "\n")
        step = row.get("step", len(self.rows))
        if self.bar is not None:
            post = {k: f"{row[k]:.3g}" for k in ("reward", "fidelity", "loss", "tokens_per_s")
                    if _finite(row.get(k))}
            self.bar.set_postfix(post, refresh=False)
            self.bar.update(1)
        if self.tb is not None:
            for k, v in row.items():
                if _finite(v):
                    self.tb.add_scalar(f"{row.get('stage', 'rl')}/{k}", v, step)
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in row.items() if _finite(v)}, step=step)
        if self.plot_every and len(self.rows) % self.plot_every == 0:
            self.plot()

    def write(self, msg: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(msg)
        else:
            print(msg, flush=True)

    def plot(self) -> None:
        if not self.enabled or not self.rows:
            return
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, axes = plt.subplots(1, len(PLOTTED), figsize=(4.2 * len(PLOTTED), 3.2))
        for ax, (key, title) in zip(axes, PLOTTED):
            for stage, style in (("sft", "--"), ("rl", "-")):
                pts = {}   # last value per step (a resumed run may repeat steps)
                for r in self.rows:
                    if r.get("stage", "rl") == stage and _finite(r.get(key)):
                        pts[r.get("step", 0)] = r[key]
                if pts:
                    xs = sorted(pts)
                    ax.plot(xs, [pts[x] for x in xs], style, marker=".", label=stage)
            ax.set_title(title)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
        fig.tight_layout()
        tmp = self.png.with_suffix(".tmp.png")
        fig.savefig(tmp, dpi=90)
        plt.close(fig)
        tmp.replace(self.png)   # a viewer never sees a half-written PNG

    def close(self) -> None:
        if not self.enabled:
            return
        self.plot()
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def final_table(summary: dict, out_dir: str | Path | None = None) -> str:
    """Print the before/after table (rich) and save it as summary.json + summary.md.

    summary: {"success_before", "success_after", "n_eval", "fidelity_before", "fidelity_after",
              "train_tokens_per_s", "rollout_tokens_per_s", "wall_s", ...}; missing values show "-".
    """
    from rich.console import Console
    from rich.table import Table

    def fmt(v, pct=False):
        if not _finite(v):
            return "-"
        return f"{100 * v:.1f}%" if pct else f"{v:,.1f}"

    rows = [
        ("task success, held-out", fmt(summary.get("success_before"), True),
         fmt(summary.get("success_after"), True)),
        ("world-model fidelity (field F1)", fmt(summary.get("fidelity_before"), True),
         fmt(summary.get("fidelity_after"), True)),
        ("train tokens / s", "", fmt(summary.get("train_tokens_per_s"))),
        ("rollout tokens / s", "", fmt(summary.get("rollout_tokens_per_s"))),
        ("wall time (s)", "", fmt(summary.get("wall_s"))),
    ]
    title = f"fastrehearse: {summary.get('model', '')} on {summary.get('suite', '')} " \
            f"({summary.get('n_eval', '?')} held-out tasks)"
    table = Table(title=title)
    table.add_column("metric")
    table.add_column("before", justify="right")
    table.add_column("after", justify="right")
    for r in rows:
        table.add_row(*r)
    console = Console()
    console.print(table)
    md = "| metric | before | after |\n|---|---:|---:|\n" + "\n".join(f"| {a} | {b} | {c} |"
                                                                  for a, b, c in rows)
    if out_dir is not None:
        out = Path(out_dir)
        (out / "summary.json").write_text(json.dumps(summary, indent=2, default=float))
        (out / "summary.md").write_text(f"{title}\n\n{md}\n")
    return md
