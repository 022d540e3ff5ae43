"""User mistakes in `fastrehearse train` (docs/faults.md): one line naming the problem, exit code 2, no
traceback, and (where the mistake is in the config) before any weights load."""
import json
import struct
from pathlib import Path

import pytest
import torch
import yaml

from fastrehearse import cli
from fastrehearse.model import loader
from fastrehearse.train.config import ConfigError, load_config, preflight

ROOT = Path(__file__).resolve().parents[1]
SMOKE = str(ROOT / "configs" / "smoke.yaml")


@pytest.fixture
def no_weights(monkeypatch):
    """Any attempt to load a model fails the test: the error must come first."""
    def boom(*a, **k):
        raise AssertionError("the model was loaded before the config error was found")
    monkeypatch.setattr(loader, "load_model", boom)
    import fastrehearse.model as fm
    monkeypatch.setattr(fm, "load_model", boom)


def _train(capsys, tmp_path, *sets, args=()):
    argv = ["train", "--config", SMOKE, "--set", f"run_dir={tmp_path / 'run'}", *args]
    for s in sets:
        argv += ["--set", s]
    rc = cli.main(argv)
    err = capsys.readouterr().err.strip()
    return rc, err


def _one_line_2(rc, err, *needles):
    assert rc == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for n in needles:
        assert n in err, err


@pytest.mark.parametrize("sets, needles", [
    (["model.options.hiden_size=32"], ["'model.options.hiden_size'", "did you mean 'hidden_size'"]),
    (["env.options={levle: easy}"], ["'env.options.levle'", "did you mean 'level'"]),
    (["env.options.n_trian=8"], ["'env.options.n_trian'", "did you mean 'n_train'"]),
    (["env.options={n_train: lots}"], ["'env.options.n_train' must be int", "'lots'"]),
    (["rollout.max_chunck=4"], ["'rollout.max_chunck'", "did you mean 'max_chunk'"]),
    (["rollout.options={max_chunk: 4}"], ["'rollout.options'"]),
    (["env.suite=bfcll"], ["'env.suite' = 'bfcll' is not a suite", "did you mean 'bfcl'"]),
    (["optim.lr=0"], ["'optim.lr' must be > 0"]),
    (["optim.lr=inf"], ["'optim.lr' must be a finite number"]),
    (["sft.lr=0"], ["'sft.lr' must be > 0 when sft.steps > 0"]),
    (["env.train_split=nope"], ["config key 'env.train_split' = 'nope'"]),
])
def test_config_mistakes_fail_before_the_model_loads(capsys, tmp_path, no_weights, sets, needles):
    rc, err = _train(capsys, tmp_path, *sets)
    _one_line_2(rc, err, *needles)
    assert not (tmp_path / "run" / "config.yaml").exists()


def test_options_mapping_override_merges():
    """`--set env.options={level: mixed}` merges into the dict: n_train and tools stay."""
    cfg = load_config(SMOKE, ["env.options={level: mixed}"])
    assert cfg.env.options == {"level": "mixed", "tools": "task", "n_train": 64, "n_test": 16}
    cfg = load_config(SMOKE, ["model.options={hidden_size: 32}"])
    assert cfg.model.options.hidden_size == 32 and cfg.model.options.num_layers == 2


def test_loss_temperature_follows_rollout_unless_set():
    assert load_config(SMOKE, ["rollout.temperature=0.7"]).algo.loss.temperature == 0.7
    with pytest.raises(ConfigError, match="'algo.loss.temperature' \\(0.5\\) must equal"):
        load_config(SMOKE, ["rollout.temperature=0.7", "algo.loss.temperature=0.5"])


def _hf_dir(tmp_path, truncate=False, weights=True):
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
    if weights:
        from safetensors.torch import save_file
        save_file({"w": torch.zeros(64, 64)}, str(d / "model.safetensors"))
        if truncate:
            data = (d / "model.safetensors").read_bytes()
            (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    return d


@pytest.mark.parametrize("kind, needle", [("no_weights", "holds no weights"),
                                          ("truncated", "is truncated or not a safetensors file")])
def test_bad_model_directories(capsys, tmp_path, no_weights, kind, needle):
    d = _hf_dir(tmp_path, truncate=kind == "truncated", weights=kind != "no_weights")
    rc, err = _train(capsys, tmp_path, f"model.spec={d}", "model.options={}")
    _one_line_2(rc, err, needle, "'model.spec'")


def test_binary_config_file(capsys, tmp_path):
    p = tmp_path / "c.yaml"
    p.write_bytes(struct.pack("<8d", *range(8)) + b"\xff\xfe")
    rc = cli.main(["train", "--config", str(p)])
    _one_line_2(rc, capsys.readouterr().err.strip(), "is not a text (YAML) file")


def test_cuda_without_cuda(capsys, tmp_path, no_weights):
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    rc, err = _train(capsys, tmp_path, "device=cuda")
    _one_line_2(rc, err, "'device' = 'cuda' but CUDA is not available")


def test_run_dir_holding_a_run_is_refused(capsys, tmp_path, no_weights):
    """Training into a finished run's directory is refused: checkpoint rotation would keep that
    run's higher steps and delete each new checkpoint."""
    run = tmp_path / "run"
    (run / "checkpoints" / "step_00000005").mkdir(parents=True)
    (run / "checkpoints" / "step_00000005" / "COMPLETE").write_text("{}")
    (run / "metrics.jsonl").write_text('{"step": 5}\n')
    rc, err = _train(capsys, tmp_path)
    _one_line_2(rc, err, "already holds a run", "--resume", "--overwrite")
    assert (run / "checkpoints" / "step_00000005" / "COMPLETE").is_file()
    assert (run / "metrics.jsonl").read_text() == '{"step": 5}\n'
    with pytest.raises(SystemExit) as e:                # both flags: argparse refuses
        cli.main(["train", "--config", SMOKE, "--resume", "--overwrite"])
    assert e.value.code == 2


def test_resume_with_a_forbidden_change_is_refused_before_anything_is_written(capsys, tmp_path, no_weights):
    run = tmp_path / "run"
    ck = run / "checkpoints" / "step_00000003"
    ck.mkdir(parents=True)
    (ck / "COMPLETE").write_text("{}")
    cfg = load_config(SMOKE, [f"run_dir={run}"])
    from fastrehearse.train.config import dump_config
    dump_config(cfg, ck / "config.yaml")
    dump_config(cfg, run / "config.yaml")
    before = (run / "config.yaml").read_bytes()
    rc, err = _train(capsys, tmp_path, "seed=1", "model.options.hidden_size=32", "optim.lr=1e-3",
                     args=["--resume"])
    _one_line_2(rc, err, "--resume cannot change", "'seed' 0 -> 1", "'model.options.hidden_size' 64 -> 32")
    assert "optim.lr" not in err                        # allowed on resume
    assert (run / "config.yaml").read_bytes() == before
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "config.yaml"]


def test_presets_pass_preflight_where_their_model_exists():
    for p in sorted((ROOT / "configs").glob("*.yaml")):
        cfg = load_config(p)
        if cfg.model.spec.startswith("/") and not Path(cfg.model.spec).exists():
            continue
        preflight(cfg)
        assert yaml.safe_load(p.read_text())


def test_prompt_longer_than_max_episode_tokens_is_refused(capsys, tmp_path):
    """A prompt longer than rollout.max_episode_tokens is refused (exit 2), not trained on as 0
    tokens with exit 0."""
    rc, err = _train(capsys, tmp_path, "rollout.max_episode_tokens=64", "max_tokens=64")
    _one_line_2(rc, err, "'rollout.max_episode_tokens'", "nothing would be generated or trained")
    assert not (tmp_path / "run" / "config.yaml").exists()
