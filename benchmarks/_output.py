"""Where a benchmark writes its JSON (torch-free, so roofline.py can use it without torch).

    add_output_args(parser)                       # --json PATH, --record
    path = output_path(args.json, "x_cpu.json", args.record)
"""
from __future__ import annotations

from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
# Where a benchmark writes unless told otherwise: a scratch folder (git-ignored), so a run never
# overwrites the committed figures that the README and docs cite from RESULTS.
SCRATCH = Path(__file__).resolve().parents[1] / "runs" / "bench"


def add_output_args(parser, json_help: str = "output JSON file") -> None:
    """--json PATH (an explicit file) and --record (write into benchmarks/results/, replacing
    the committed result); with neither, output goes to runs/bench/."""
    parser.add_argument("--json", type=Path, default=None,
                        help=f"{json_help} (default runs/bench/<name>; --record: benchmarks/results/)")
    parser.add_argument("--record", action="store_true",
                        help="write into benchmarks/results/, replacing the committed result "
                             "that the README and docs cite")


def output_path(explicit, name: str, record: bool) -> Path:
    """The file a benchmark writes: the explicit --json path, else `name` under benchmarks/results/
    with --record, else under runs/bench/. --json and --record together are refused (ambiguous)."""
    if explicit is not None and record:
        raise SystemExit("--json and --record: give one (--record writes the committed "
                         f"benchmarks/results/{name}, --json any other file)")
    if explicit is not None:
        return Path(explicit)
    return (RESULTS if record else SCRATCH) / name
