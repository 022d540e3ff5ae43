"""Run metrics: progress bar, metrics.jsonl, a PNG of the curves, optional TensorBoard / wandb, and
the final rich table. Only rank 0 writes or prints; other ranks get a silent logger.

metrics.jsonl is the source of truth; the PNG, TensorBoard and wandb are views of it, so a failure
in any of them (a full disk while drawing curves.png, a missing package) is reported once and
training goes on. A failure to append to metrics.jsonl stops the run (DiskFullError when the disk
is full). A run killed mid-write can leave a torn last line: readers skip it, and a resumed run
cuts it off before appending.
"""
from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table
from tqdm.auto import tqdm

from .errors import DiskFullError, TrainingError, is_disk_full

PLOTTED = [("reward", "reward (task success)"), ("fidelity", "world-model fidelity"),
           ("loss", "loss"), ("tokens_per_s", "train tokens / s")]
EVAL_PLOTTED = ("eval_success", "held-out success (eval.every)")


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


NEWLINE = b"\n"


def read_metrics(path: str | Path, *, repair: bool = False) -> tuple[list[dict], list[str]]:
    """Rows of a metrics.jsonl and notes on what was skipped. A last line cut short by a kill (no
    newline, or not JSON) is skipped; with `repair` the file is cut back to its last complete line
    so appended rows start on a line of their own. A bad line elsewhere is skipped and noted."""
    p = Path(path)
    if not p.exists():
        return [], []
    data = p.read_bytes()
    rows, notes, keep, start = [], [], 0, 0
    while start < len(data):
        nl = data.find(b"\n", start)
        raw = data[start:] if nl == -1 else data[start:nl]
        nxt = len(data) if nl == -1 else nl + 1
        row = None
        if raw.strip():
            try:
                row = json.loads(raw)
            except ValueError:
                pass
            last = nl == -1 or not data[nxt:].strip()
            if not isinstance(row, dict) or nl == -1:   # no newline: its write never finished
                if last:
                    notes.append(f"{p}: skipped a torn last line ({len(raw)} bytes)")
                    break
                notes.append(f"{p}: skipped unreadable line {data.count(NEWLINE, 0, start) + 1}")
            else:
                rows.append(row)
        keep = start = nxt
    if repair and keep < len(data):
        with open(p, "r+b") as f:
            f.truncate(keep)
    return rows, notes


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
        self._view_failed: set[str] = set()
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # resumed run: keep history for the plot; a torn last line (killed mid-write) is cut off
        self.rows, notes = read_metrics(self.path, repair=True)
        for n in notes:
            print(f"[fastrehearse] {n}", flush=True)
        if progress and total_steps > 0:
            self.bar = tqdm(total=total_steps, desc="train", dynamic_ncols=True)
        # tensorboard and wandb are optional: imported only when the config asks for them
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.tb = SummaryWriter(str(self.run_dir / "tb"))
            except ImportError:
                print("[fastrehearse] log.tensorboard=true but the tensorboard package is not installed "
                      "(pip install tensorboard); metrics.jsonl and curves.png are still written", flush=True)
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

    def log(self, row: dict, *, advance: bool = True) -> None:
        """Append a row; advance: it is an optimizer step's row (moves the progress bar)."""
        if not self.enabled:
            return
        row = {"time": round(time.time(), 3), **row}
        self.rows.append(row)
        line = json.dumps(row, default=float) + "\n"
        try:
            with open(self.path, "a") as f:
                f.write(line)
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            if is_disk_full(e, self.path):
                raise DiskFullError(f"no space left on device at {self.path}") from None
            raise TrainingError(f"cannot append to {self.path}: {e}") from None
        step = row.get("step", len(self.rows))
        if self.bar is not None:
            post = {k: f"{row[k]:.3g}" for k in ("reward", "fidelity", "loss", "tokens_per_s")
                    if _finite(row.get(k))}
            self.bar.set_postfix(post, refresh=False)
            if advance:
                self.bar.update(1)
        if self.tb is not None:
            self._view("tensorboard", self._tb_row, row, step)
        if self.wandb is not None:
            self._view("wandb", lambda: self.wandb.log({k: v for k, v in row.items() if _finite(v)}, step=step))
        if self.plot_every and len(self.rows) % self.plot_every == 0:
            self.plot()

    def _tb_row(self, row: dict, step: int) -> None:
        for k, v in row.items():
            if _finite(v) and k != "time":
                self.tb.add_scalar(f"{row.get('stage', 'rl')}/{k}", v, step)
        self.tb.flush()

    def _view(self, name: str, fn, *args) -> None:
        """Run a view's update; a failure is reported once and never stops training."""
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - views are optional; metrics.jsonl has the data
            if name not in self._view_failed:
                self._view_failed.add(name)
                what = "no space left on device" if is_disk_full(e, self.run_dir) else f"{type(e).__name__}: {e}"
                self.write(f"[fastrehearse] {name} update failed ({what}); training continues, "
                           f"metrics.jsonl has every row")

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
        self._view("curves.png", self._plot)

    def _plot(self) -> None:
        # matplotlib (~0.3 s) only when a plot is drawn; the Agg backend is chosen before pyplot loads
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        plotted = PLOTTED + ([EVAL_PLOTTED] if any(r.get("stage") == "eval" for r in self.rows) else [])
        fig, axes = plt.subplots(1, len(plotted), figsize=(4.2 * len(plotted), 3.2))
        for ax, (key, title) in zip(axes, plotted):
            for stage, style in (("sft", "--"), ("rl", "-"), ("eval", ":")):
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
        try:
            fig.savefig(tmp, dpi=90)
            tmp.replace(self.png)   # a viewer never sees a half-written PNG
        finally:
            plt.close(fig)
            tmp.unlink(missing_ok=True)

    def close(self) -> None:
        if not self.enabled:
            return
        self.plot()
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self._view("tensorboard", self.tb.close)
        if self.wandb is not None:
            self._view("wandb", self.wandb.finish)


def final_table(summary: dict, out_dir: str | Path | None = None) -> str:
    """Print the before/after table (rich) and save it as summary.json + summary.md.

    summary: {"success_before", "success_after", "n_eval", "fidelity_before", "fidelity_after",
              "train_tokens_per_s", "rollout_tokens_per_s", "wall_s", ...}; missing values show "-".
    """

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
        for name, text in (("summary.json", json.dumps(summary, indent=2, default=float)),
                           ("summary.md", f"{title}\n\n{md}\n")):
            try:
                (out / name).write_text(text)
            except OSError as e:
                if is_disk_full(e, out / name):
                    raise DiskFullError(f"no space left on device at {out / name}") from None
                raise
    return md
