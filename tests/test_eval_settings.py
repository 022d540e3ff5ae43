"""One definition of the evaluation's engine settings: EvalSettings holds the engine's own
RolloutConfig; the trainer builds it with EvalSettings.from_rollout (every field carried over,
on_max_new_tokens included), the CLI from its flags over EVAL_ROLLOUT, with the engine's names
(--max-turns; --max-steps an announced alias). No model runs here."""
import dataclasses
import json
from types import SimpleNamespace

import pytest

from fastrehearse.eval import cli
from fastrehearse.eval.runner import EVAL_ROLLOUT, EvalSettings, eval_engine
from fastrehearse.rollout import RolloutConfig
from fastrehearse.rollout.backends.vllm_options import VLLMOptions


@pytest.fixture(scope="module")
def tok():
    from fastrehearse.model import load_tokenizer
    return load_tokenizer("smollm2")


# every engine field set away from its default, so a field that is dropped on the way shows
TRAIN_ROLLOUT = dict(mode="hybrid", hybrid_p=0.2, temperature=0.7, top_p=0.9, max_new_tokens=40,
                     on_max_new_tokens="end_episode", max_turns=3, max_episode_tokens=999,
                     parallel_tool_calls=False, on_malformed="end_episode",
                     max_batch_size=5, max_chunk=7,
                     backend="vllm", vllm=VLLMOptions(kv_cache_gib=3, enforce_eager=True))


def test_from_rollout_carries_every_engine_field(tok, monkeypatch):
    # the engine's config is compared, no vLLM is started: the installed-vLLM check is not the
    # subject (a machine without vLLM's CPU build runs this test too)
    monkeypatch.setattr("fastrehearse.rollout.backends.vllm_backend.require_vllm", lambda: None)
    rc = RolloutConfig(**TRAIN_ROLLOUT)
    assert {f.name for f in dataclasses.fields(RolloutConfig)} - set(TRAIN_ROLLOUT) == \
        {"measure_fidelity"}          # the test covers every field the eval does not set itself
    s = EvalSettings.from_rollout(rc, seed=3, fidelity=True, temperature=0.0, mode="real")
    cfg = eval_engine(None, tok, s).config
    want = dict(TRAIN_ROLLOUT, temperature=0.0, mode="real", measure_fidelity=False)
    assert dataclasses.asdict(cfg) == dataclasses.asdict(RolloutConfig(**want))
    assert (s.seed, s.fidelity, s.max_turns, s.batch_size) == (3, True, 3, 5)
    # the fidelity pass: rehearse mode, measured, everything else the same
    fid = eval_engine(None, tok, s, mode="rehearse", measure_fidelity=True).config
    assert dataclasses.asdict(fid) == dataclasses.asdict(RolloutConfig(**dict(want, mode="rehearse",
                                                                             measure_fidelity=True)))


def test_from_rollout_takes_the_trainers_rollout_config():
    from fastrehearse.train.config import load_config
    cfg = load_config(None, ["rollout.on_max_new_tokens=end_episode", "rollout.group_size=4"])
    s = EvalSettings.from_rollout(cfg.rollout.engine, seed=0)
    assert type(s.rollout) is RolloutConfig
    assert s.rollout.on_max_new_tokens == "end_episode"


def test_trainer_evaluate_uses_every_rollout_field(monkeypatch):
    """train/rollouts.py evaluate builds its settings from the run's rollout config: a cut-turn
    rule of end_episode reaches the eval engine (the hand copy this replaces dropped it)."""
    from fastrehearse.train import rollouts
    from fastrehearse.train.config import load_config

    seen = {}

    class Stop(Exception):
        pass

    def capture(items, make_env, model, tok, policy, store, settings, **kw):
        seen["s"] = settings
        raise Stop

    monkeypatch.setattr(rollouts, "evaluate_items", capture)
    cfg = load_config("configs/smoke.yaml", ["rollout.on_max_new_tokens=end_episode",
                                             "rollout.on_malformed=end_episode",
                                             "eval.temperature=0.0"])
    run = SimpleNamespace(cfg=cfg, info=SimpleNamespace(rank=0, world_size=1), eval_tasks=[object()],
                          gen_model=SimpleNamespace(eval=lambda: None), tokenizer=None, suite=None)
    with pytest.raises(Stop):
        rollouts.evaluate(run, tag="before")
    r = seen["s"].rollout
    assert (r.on_max_new_tokens, r.on_malformed, r.temperature, r.mode) == \
        ("end_episode", "end_episode", 0.0, cfg.eval.mode)
    assert (r.max_turns, r.max_new_tokens, r.max_episode_tokens) == (
        cfg.rollout.engine.max_turns, cfg.rollout.engine.max_new_tokens, cfg.rollout.engine.max_episode_tokens)


def test_keyword_settings_and_unknown_names():
    s = EvalSettings(max_turns=4, batch_size=2, max_episode_tokens=None)
    assert (s.rollout.max_turns, s.rollout.max_batch_size, s.fit_context) == (4, 2, True)
    assert s.rollout.max_new_tokens == EVAL_ROLLOUT.max_new_tokens
    assert not EvalSettings(max_episode_tokens=512).fit_context
    with pytest.raises(TypeError, match="max_steps"):
        EvalSettings(max_steps=3)
    with pytest.raises(ValueError, match="max_turns"):
        EvalSettings(max_turns=0)


def _args(*extra):
    return cli.build_parser().parse_args(["--suite", "builtin", "--policy", "gold", "--out", "x",
                                          *extra])


def test_cli_flags_are_the_engine_settings(capsys):
    a = _args("--max-turns", "3", "--on-max-new-tokens", "end_episode", "--batch-size", "2")
    s = cli.settings(a, None)
    assert (s.rollout.max_turns, s.rollout.on_max_new_tokens, s.rollout.max_batch_size) == \
        (3, "end_episode", 2)
    d = _args()       # defaults: EVAL_ROLLOUT's
    s = cli.settings(d, None)
    for f in ("max_new_tokens", "temperature", "max_batch_size", "on_max_new_tokens", "on_malformed"):
        assert getattr(s.rollout, f) == getattr(EVAL_ROLLOUT, f), f
    assert s.fit_context
    assert _args("--max-steps", "5").max_turns == 5       # the old name: an alias


def test_max_steps_alias_is_announced(tmp_path, capsys):
    argv = ["--suite", "builtin", "--categories", "test:easy:task", "--policy", "gold", "--limit", "1",
            "--max-steps", "4", "--out", str(tmp_path / "a"), "--quiet"]
    assert cli.main(argv) == 0
    assert "--max-steps is the old name of --max-turns" in capsys.readouterr().err
    run = json.loads((tmp_path / "a" / "run.json").read_text())
    assert "max_turns" in run and "max_steps" not in run
    assert cli.main([x if x != "--max-steps" else "--max-turns" for x in argv]) == 0
    assert "old name" not in capsys.readouterr().err


def test_a_run_dir_written_with_the_old_names_resumes(tmp_path):
    """run.json of an engine run written before the rename (max_steps, no cut-turn / malformed
    keys) resumes under the new names instead of being refused as a different configuration."""
    out = tmp_path / "old"
    argv = ["--suite", "builtin", "--categories", "test:easy:task", "--policy", "gold", "--limit", "1",
            "--out", str(out), "--quiet"]
    assert cli.main(argv) == 0
    run = json.loads((out / "run.json").read_text())
    run["max_steps"] = run.pop("max_turns")
    del run["on_max_new_tokens"], run["on_malformed"]
    (out / "run.json").write_text(json.dumps(run))
    assert cli.main(argv) == 0
    assert cli.main(argv + ["--on-malformed", "end_episode"]) == 2      # a real change is refused


def test_device_and_dtype_default_to_auto():
    """`fastrehearse eval` picks CUDA and bfloat16 when a GPU is there, the CPU and float32
    otherwise (it defaulted to CPU float32 even on a GPU box); a bad value is one line."""
    import torch
    args = cli.build_parser().parse_args(["--suite", "builtin", "--policy", "gold", "--out", "x"])
    assert (args.device, args.dtype) == ("auto", "auto")
    want = ("cuda", "bfloat16") if torch.cuda.is_available() else ("cpu", "float32")
    assert cli.resolve_device_dtype("auto", "auto") == want
    assert cli.resolve_device_dtype("cpu", "bf16") == ("cpu", "bf16")
    with pytest.raises(cli.UsageError, match="--device must be auto, cpu or cuda"):
        cli.resolve_device_dtype("tpu", "auto")
    with pytest.raises(cli.UsageError, match=r"--dtype: .*float64"):
        cli.resolve_device_dtype("cpu", "float64")
    if not torch.cuda.is_available():
        with pytest.raises(cli.UsageError, match="--device cuda"):
            cli.resolve_device_dtype("cuda", "auto")


def test_offset_selects_a_disjoint_window_with_the_same_ids(tmp_path, capsys):
    """--offset K --limit N scores items K .. K+N-1 of each category (a pilot set disjoint from the
    reported first items), under the ids a full listing gives them; a negative offset is refused."""
    from fastrehearse.eval import suites
    full = [t.id for _, t in suites.build("builtin", ["test:rules"], 7).items]
    assert [t.id for _, t in suites.build("builtin", ["test:rules"], 3, offset=4).items] == full[4:7]
    assert [t.id for _, t in suites.build("builtin", ["test:rules"], None, offset=4).items][:3] == full[4:7]
    out = tmp_path / "pilot"
    argv = ["--suite", "builtin", "--categories", "test:rules", "--policy", "gold", "--limit", "2",
            "--offset", "5", "--out", str(out), "--quiet"]
    assert cli.main(argv) == 0
    ids = [json.loads(x)["id"] for x in (out / "items.jsonl").read_text().splitlines()]
    assert sorted(ids) == full[5:7]
    assert json.loads((out / "results.json").read_text())["offset"] == 5
    assert cli.main(argv[:-5] + ["--offset", "4", "--out", str(out), "--quiet"]) == 2  # another window: refused
    assert cli.main(argv[:-5] + ["--offset", "-1", "--out", str(tmp_path / "neg"), "--quiet"]) == 2
    assert "--offset must be >= 0" in capsys.readouterr().err
