"""Resumable per-item results for one eval run directory.

Layout of `--out DIR`:
  DIR/run.json       the run's configuration (a rerun with a different configuration is refused,
                     so finished items are never mixed across configurations)
  DIR/items.jsonl    one JSON line per finished item, appended (and flushed) as each item completes
  DIR/results.json   the aggregate, rewritten at the end of every run

A rerun with the same DIR reads items.jsonl and skips every (category, id) already *scored* there.
An item that could not run (environment or user simulator unreachable, policy crash, checker
crash) is stored with `error` set and `score` None: it is not a result, it is never counted in
accuracy, and a rerun retries it (its newer line replaces the old one). A line cut short by a crash
mid-write is ignored (that item simply runs again).
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable


@dataclass
class ItemResult:
    id: str
    category: str
    score: float | None                # task success in [0, 1] from the benchmark's own checker;
                                       # None when the item could not run (see `error`)
    steps: int = 0                     # policy turns taken
    real_calls: int = 0                # env.execute calls made (committed calls only)
    gen_tokens: int = 0                # tokens generated for committed turns
    rehearsal_tokens: int = 0          # tokens generated in private rehearsals (test-time rehearsal)
    prompt_tokens: int = 0             # prompt tokens fed to the model (all generations)
    malformed: int = 0                 # turns whose tool-call text could not be parsed
    error: str | None = None           # why the item could not run (then score is None)
    time_s: float = 0.0
    fidelity: dict[str, float] | None = None   # world-model fidelity when measured (drift runs)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> tuple[str, str]:
        return (self.category, self.id)


class ResultStore:
    """Append-only JSONL of finished items plus the run's configuration."""

    def __init__(self, out_dir: str | os.PathLike, config: dict[str, Any]):
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.items_path = self.dir / "items.jsonl"
        self.config = config
        run_path = self.dir / "run.json"
        if run_path.exists():
            old = _upgrade_config(json.loads(run_path.read_text()))
            diff = {k: (old.get(k), config.get(k)) for k in set(old) | set(config)
                    if k not in _RESUME_FREE_KEYS and old.get(k) != config.get(k)}
            if diff.get("measure_fidelity") == (False, True):
                # Turning the fidelity pass on for a run scored without it is an upgrade, not a new
                # configuration: it is a separate pass that never changes a score, and it runs for
                # the scored items that lack fidelity (runner.fidelity_pending). Off again is refused.
                del diff["measure_fidelity"]
                if not diff:
                    run_path.write_text(json.dumps({**old, "measure_fidelity": True}, indent=2, sort_keys=True))
            if diff:
                raise ValueError(
                    f"--out {self.dir} holds a run with a different configuration "
                    f"(key: (old, new)) {diff}; use a fresh --out directory")
        else:
            run_path.write_text(json.dumps(config, indent=2, sort_keys=True))
        self._items: dict[tuple[str, str], ItemResult] = {}
        if self.items_path.exists() and self.items_path.stat().st_size:
            with open(self.items_path, "rb+") as f:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    f.write(b"\n")   # end a line cut short by a crash, so the next append is whole
        for r in self._read():
            self._items[r.key] = r

    def _read(self) -> Iterable[ItemResult]:
        if not self.items_path.exists():
            return
        with open(self.items_path) as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                try:
                    d = json.loads(line)
                except json.JSONDecodeError:
                    continue      # a line cut short by a crash: that item runs again
                yield ItemResult(**d)

    def done(self, category: str, item_id: str) -> bool:
        """Scored already (an item recorded as an error is not done: a rerun retries it)."""
        r = self._items.get((category, item_id))
        return r is not None and r.error is None

    def add(self, result: ItemResult) -> None:
        self._items[result.key] = result
        with open(self.items_path, "a") as f:
            f.write(json.dumps(asdict(result), sort_keys=True, default=str) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def items(self) -> list[ItemResult]:
        return list(self._items.values())

    def write_results(self, summary: dict[str, Any]) -> Path:
        path = self.dir / "results.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(summary, indent=2, sort_keys=False))
        os.replace(tmp, path)   # atomic: a reader never sees half a results.json
        return path


# Keys a rerun may change without invalidating finished items (more items, smaller batches).
_RESUME_FREE_KEYS = {"limit", "batch_size", "categories", "prefill_batch_cells", "time_limit_s"}
# An older run.json resumes: a key under its earlier name is read under the engine's name, and a
# key it lacks takes the value every run had before the key existed.
_RENAMED_KEYS = {"max_steps": "max_turns"}
_ADDED_KEYS = {"on_max_new_tokens": "end_turn", "on_malformed": "error_response", "offset": 0}


def _upgrade_config(old: dict[str, Any]) -> dict[str, Any]:
    if old.get("harness") != "engine":        # pre-engine runs are refused by their harness key
        return old
    new = {_RENAMED_KEYS.get(k, k): v for k, v in old.items()}
    return {**_ADDED_KEYS, **new}


def per_category(items: list[ItemResult]) -> dict[str, dict[str, Any]]:
    """{category: {"accuracy", "n", "errors", token and call means}}: accuracy and the means are over
    the n scored items; `errors` counts items that could not run (accuracy None when none ran)."""
    cats: dict[str, list[ItemResult]] = {}
    for r in items:
        cats.setdefault(r.category, []).append(r)
    out = {}
    for name in sorted(cats):
        errors = [r for r in cats[name] if r.error is not None]
        rs = [r for r in cats[name] if r.error is None]
        n = len(rs)
        entry: dict[str, Any] = {
            "accuracy": sum(r.score for r in rs) / n if n else None,
            "n": n,
            "errors": len(errors),
            "error_examples": sorted({r.error for r in errors})[:3],
            "malformed_turns": sum(r.malformed for r in rs),
            "mean_gen_tokens": sum(r.gen_tokens for r in rs) / max(n, 1),
            "mean_rehearsal_tokens": sum(r.rehearsal_tokens for r in rs) / max(n, 1),
            "mean_prompt_tokens": sum(r.prompt_tokens for r in rs) / max(n, 1),
            "mean_real_calls": sum(r.real_calls for r in rs) / max(n, 1),
        }
        fid = [r.fidelity for r in rs if r.fidelity]
        if fid:
            keys = sorted({k for f in fid for k in f})
            # a key some items lack (predictable / hidden: no such field in their rehearsals) is
            # averaged over the items that have it, never counted as 0 for the others
            entry["fidelity"] = {k: sum(f[k] for f in fid if k in f) / sum(k in f for f in fid) for k in keys}
            entry["fidelity"]["n_items"] = len(fid)
        drift = [r.extra["drift"] for r in rs if "drift" in r.extra]
        if drift:   # what the drift did: responses seen / changed, calls that hit a removed tool
            entry["drift"] = {k: sum(d.get(k, 0) for d in drift) for k in sorted({k for d in drift for k in d})}
            entry["drift"]["items_calling_removed_tool"] = sum(d.get("removed_tool_calls", 0) > 0 for d in drift)
        out[name] = entry
    return out
