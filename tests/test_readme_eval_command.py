"""The README's eval command for the demo's held-out table runs the trainer's own held-out eval:
the same items (configs/demo.yaml's eval split) and the same engine settings
(EvalSettings.from_rollout of the demo's rollout config, eval section), so the same checkpoint gives
the same per-item numbers (fastrehearse.train.rollouts.evaluate). A changed demo config or README
command that breaks this fails here."""
import dataclasses
import re
import shlex
from pathlib import Path

from fastrehearse.eval import suites
from fastrehearse.eval.cli import build_parser, settings
from fastrehearse.eval.runner import EvalSettings
from fastrehearse.train.config import load_config
from fastrehearse.train.tasks import build_tasks

ROOT = Path(__file__).resolve().parents[1]


def _readme_command() -> list[str]:
    text = (ROOT / "README.md").read_text()
    m = re.search(r"^fastrehearse eval [^\n]*--policy runs/demo/export(?:[^\n]*\\\n)*[^\n]*$", text, re.M)
    assert m and "held-out table" in m.group(0), "the README's demo eval command"
    argv = shlex.split(m.group(0).replace("\\\n", " "), comments=True)
    assert argv[:2] == ["fastrehearse", "eval"]
    return argv[2:]


def test_readme_eval_command_is_the_demo_eval():
    args = build_parser().parse_args(_readme_command())
    cfg = load_config(ROOT / "configs" / "demo.yaml")
    _, _, eval_tasks = build_tasks(cfg)
    run = suites.build(args.suite, args.categories, args.limit, args.max_turns, seed=args.seed)
    assert [t.id for _, t in run.items] == [t.id for t in eval_tasks]

    cli = settings(args, None)
    train = EvalSettings.from_rollout(cfg.rollout.engine, seed=cfg.seed, fidelity=cfg.eval.fidelity,
                                      temperature=cfg.eval.temperature, mode=cfg.eval.mode)
    assert (cli.seed, cli.fidelity, cli.fit_context) == (train.seed, train.fidelity, train.fit_context)
    a, b = dataclasses.asdict(cli.rollout), dataclasses.asdict(train.rollout)
    # one batch either way: every eval item decodes together
    assert min(a.pop("max_batch_size"), b.pop("max_batch_size")) >= len(eval_tasks)
    # measure_fidelity: the evaluation's own (eval_engine)
    a.pop("measure_fidelity"), b.pop("measure_fidelity")
    assert a == b
