"""The `fastrehearse` command.

    fastrehearse train --config configs/demo.yaml [--set optim.lr=1e-5 ...] [--resume | --overwrite]
    fastrehearse eval  ...            (fastrehearse.eval.cli; see `fastrehearse eval --help`)

`torchrun --nproc_per_node=N -m fastrehearse.train --config PATH` runs the same training code.

Exit codes of `train`: 0 done (or stopped by SIGTERM after a checkpoint), 1 training stopped (the
reason, e.g. non-finite steps or a full disk, in one line), 2 a mistake in the command, the config,
the model path or run_dir, found before training (one line naming it). Under torchrun, rank 0
prints that line and torchrun adds its own report of the failed workers (its exit code is 1).
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys


def train_parser(prog: str = "fastrehearse train") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Train a tool-use agent by world rehearsal "
                                "(SFT warm-up on gold trajectories, then role-wise GRPO).")
    p.add_argument("--config", required=True, help="YAML file (see configs/)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one config key, e.g. --set optim.lr=1e-5 (repeatable)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--resume", action="store_true",
                   help="continue from the latest complete checkpoint in run_dir (steps, optim, "
                        "logging, checkpoint and eval settings may change; docs/training.md)")
    g.add_argument("--overwrite", action="store_true",
                   help="replace the run run_dir holds (its checkpoints, metrics, export, config)")
    return p


def train_main(argv: list[str] | None = None, prog: str = "fastrehearse train") -> int:
    args = train_parser(prog).parse_args(argv)
    from fastrehearse.train.config import ConfigError, load_config, preflight
    try:
        cfg = load_config(args.config, args.overrides)
        preflight(cfg)      # model files, suite + options, device: before any weights load
    except ConfigError as e:
        print(f"{prog}: config error: {e}", file=sys.stderr)
        return 2
    from fastrehearse.train.loop import TrainingError, train
    # Every rank of a torchrun job reaches the same verdict; one of them says it.
    say = os.environ.get("RANK", "0") == "0"
    try:
        train(cfg, resume=args.resume, overwrite=args.overwrite)
    except (FileNotFoundError, ConfigError) as e:   # run_dir, resume settings, env splits, ...
        if say:
            print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except TrainingError as e:                      # DiskFullError included
        if say:
            print(f"{prog}: training stopped: {e}", file=sys.stderr)
        return 1
    return 0


def eval_main(argv: list[str]) -> int:
    try:
        mod = importlib.import_module("fastrehearse.eval.cli")
    except ImportError as e:
        print(f"fastrehearse eval: the evaluation module is not available ({e}); "
              f"it lives in fastrehearse/eval/cli.py", file=sys.stderr)
        return 2
    if not hasattr(mod, "main"):
        print("fastrehearse eval: fastrehearse.eval.cli has no main()", file=sys.stderr)
        return 2
    rc = mod.main(argv)
    return int(rc or 0)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = "usage: fastrehearse {train,eval} ...  (fastrehearse <command> --help for details)"
    if not argv or argv[0] in ("-h", "--help"):
        print(usage)
        print(__doc__)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "train":
        return train_main(rest)
    if cmd == "eval":
        return eval_main(rest)
    print(f"fastrehearse: unknown command {cmd!r}\n{usage}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
