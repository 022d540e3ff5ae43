"""docs/config.md is generated from the config dataclasses (fastrehearse/train/config_reference.py):
it must equal a fresh generation, and it names every key the loader accepts."""
from pathlib import Path

import pytest
import yaml

from fastrehearse.train.config import ConfigError, TrainConfig, apply_override, leaves
from fastrehearse.train.config_reference import reference

DOC = Path(__file__).resolve().parent.parent / "docs" / "config.md"


def test_docs_config_md_is_current():
    assert DOC.read_text() == reference(), (
        "docs/config.md is stale: python -m fastrehearse.train.config_reference > docs/config.md")


def test_every_key_is_documented_with_its_default():
    text = reference()
    keys = dict(leaves(TrainConfig()))
    assert len(keys) > 80
    missing = [k for k in keys if f"| `{k}` |" not in text]
    assert missing == []
    assert "| `algo.tis_cap` | float or None | `2.0` |" in text
    # the rollout engine's keys are written under `rollout` itself (its config is composed in)
    assert "| `rollout.max_turns` | int | `6` |" in text and "rollout.engine" not in text
    assert "| `rollout.measure_fidelity` | bool | `True` |" in text          # the trainer's default
    # every documented key is one the loader accepts, set to its documented default
    for k, v in keys.items():
        if k != "env.options":
            apply_override(TrainConfig(), f"{k}={yaml.safe_dump(v, default_flow_style=True).strip()}")
    with pytest.raises(ConfigError, match="unknown config key 'rollout.engine'"):
        apply_override(TrainConfig(), "rollout.engine.mode=real")


def test_print_config_prints_the_resolved_yaml_and_loads_back(tmp_path, capsys):
    """`fastrehearse train --print-config`: the file plus --set, as YAML that loads to the same
    config; nothing run or written."""
    import yaml

    from fastrehearse.cli import main
    from fastrehearse.train.config import load_config, to_dict
    args = ["--config", "configs/smoke.yaml", "--set", "algo.tis_cap=3", "--set", f"run_dir={tmp_path / 'r'}"]
    assert main(["train", *args, "--print-config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["algo"]["tis_cap"] == 3.0 and printed == to_dict(load_config("configs/smoke.yaml", args[3::2]))
    out = tmp_path / "printed.yaml"
    out.write_text(yaml.safe_dump(printed))
    assert to_dict(load_config(str(out), [])) == printed
    assert not (tmp_path / "r").exists()
