"""The `fastrehearse` command.

    fastrehearse train --config configs/demo.yaml [--set optim.lr=1e-5 ...] [--resume | --overwrite]
    fastrehearse train --config configs/qwen3_8b_bfcl_multi_turn.yaml --dry-run --world-size 16
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

# The trainer (fastrehearse.train: torch and transformers, ~4 s) and yaml are imported inside the
# functions that run after argument parsing, so `fastrehearse --help` and `train --help` answer at
# once, and also on the kernels-only install, which has the command but not the [train] extra.


def train_parser(prog: str = "fastrehearse train") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Train a tool-use agent by world rehearsal "
                                "(SFT warm-up on gold trajectories, then role-wise GRPO).")
    p.add_argument("--config", required=True,
                   help="YAML file, or a packaged preset by name: demo, smoke, ... (configs/)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one config key, e.g. --set optim.lr=1e-5 (repeatable)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--resume", action="store_true",
                   help="continue from the latest complete checkpoint in run_dir (steps, optim, "
                        "logging, checkpoint and eval settings may change; docs/training.md)")
    g.add_argument("--overwrite", action="store_true",
                   help="replace the run run_dir holds (its checkpoints, metrics, export, config)")
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved config (the file, then --set) as YAML and exit; every key: docs/config.md")
    d = p.add_argument_group("dry run (no GPU, no weights, nothing written to run_dir)")
    d.add_argument("--dry-run", action="store_true",
                   help="build the run on torch's fake process group and print each rank's GPU memory")
    d.add_argument("--world-size", type=int, metavar="N", help="ranks to plan for (with --dry-run)")
    d.add_argument("--gpu-memory-gib", type=float, default=None, metavar="G",
                   help="GPU memory per rank to fit in (default 79.19: the usable HBM PyTorch reports "
                        "for an 80 GB H100; an H200 141GB reports 139.80)")
    d.add_argument("--dry-run-json", metavar="PATH", help="also write the plan as JSON")
    d.add_argument("--arch", metavar="DIR_OR_CONFIG_JSON",
                   help="architecture to plan when model.spec is not on this machine (default: the shipped "
                        "configs/models/<name of model.spec's folder>)")
    return p


def dry_run_main(args, prog: str) -> int:
    """Exit 0: the plan fits; 2: it does not (one line naming the overflow) or a usage mistake."""
    from fastrehearse.train.config import ConfigError, check_device, check_env, load_config
    from fastrehearse.train.dry_run import DEFAULT_BUDGET_GIB, plan, print_plan, write_json
    if args.world_size is None:
        print(f"{prog}: error: --dry-run needs --world-size N (the ranks to plan for)", file=sys.stderr)
        return 2
    if args.gpu_memory_gib is not None and not args.gpu_memory_gib > 0:
        print(f"{prog}: error: --gpu-memory-gib must be > 0, got {args.gpu_memory_gib}", file=sys.stderr)
        return 2
    if args.resume or args.overwrite:
        print(f"{prog}: error: --dry-run touches no run_dir: drop --resume / --overwrite", file=sys.stderr)
        return 2
    try:
        cfg = load_config(args.config, args.overrides)
        check_env(cfg)
        check_device(cfg)
        given = args.gpu_memory_gib is not None
        p = plan(cfg, args.world_size, args.gpu_memory_gib if given else DEFAULT_BUDGET_GIB, args.arch,
                 config_name=os.path.basename(args.config), budget_basis="given" if given else "assumed")
    except ConfigError as e:   # DryRunError included
        print(f"{prog}: config error: {e}", file=sys.stderr)
        return 2
    print_plan(p)
    if args.dry_run_json:
        write_json(p, args.dry_run_json)
    if not p.fits:
        print(f"{prog}: {p.overflow_line()}", file=sys.stderr)
        return 2
    return 0


def train_main(argv: list[str] | None = None, prog: str = "fastrehearse train") -> int:
    args = train_parser(prog).parse_args(argv)
    if args.dry_run:
        return dry_run_main(args, prog)
    for flag, val in (("--world-size", args.world_size), ("--dry-run-json", args.dry_run_json),
                      ("--arch", args.arch)):
        if val is not None:
            print(f"{prog}: error: {flag} only goes with --dry-run (a real run's world size is torchrun's "
                  f"--nnodes x --nproc_per_node)", file=sys.stderr)
            return 2
    from fastrehearse.train.config import ConfigError, load_config, preflight, to_dict
    try:
        cfg = load_config(args.config, args.overrides)
        if args.print_config:
            import yaml
            print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
            return 0
        preflight(cfg)      # model files, suite + options, device: before any weights load
    except ConfigError as e:
        print(f"{prog}: config error: {e}", file=sys.stderr)
        return 2
    from fastrehearse.train.loop import TrainingError, train
    from fastrehearse.train.failures import PeerFailed
    from fastrehearse.train.parallelize import NetworkConfigError
    # Every rank of a torchrun job reaches the same verdict; one of them says it.
    say = os.environ.get("RANK", "0") == "0"
    try:
        train(cfg, resume=args.resume, overwrite=args.overwrite)
    except (FileNotFoundError, ConfigError) as e:   # run_dir, resume settings, env splits, ...
        if say:
            print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except TrainingError as e:                      # DiskFullError, PeerFailed included
        if say or isinstance(e, PeerFailed):        # a peer's failure: the rank 0 may be the one gone
            where = "" if say else f" (rank {os.environ.get('RANK', '?')})"
            print(f"{prog}: training stopped{where}: {e}", file=sys.stderr)
        return 1
    except NetworkConfigError as e:                 # per host: the rank that found it says it
        print(f"{prog}: error (rank {os.environ.get('RANK', '0')}): {e}", file=sys.stderr)
        return 2
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
        rc = train_main(rest)
        from fastrehearse.train.parallelize import exit_worker   # torch: only once train has run
        return exit_worker(rc)
    if cmd == "eval":
        return eval_main(rest)
    print(f"fastrehearse: unknown command {cmd!r}\n{usage}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
