"""`--config NAME` takes a packaged preset (configs/NAME.yaml, shipped as `fastrehearse.configs`)
when no file of that name exists; a file always wins; an unknown name lists the presets."""
import dataclasses
from pathlib import Path

import pytest

from fastrehearse.train.config import ConfigError, load_config, preset_names, resolve_config_path

ROOT = Path(__file__).resolve().parents[1]


def test_preset_names_are_the_shipped_yaml_files():
    assert preset_names() == sorted(p.stem for p in (ROOT / "configs").glob("*.yaml"))


@pytest.mark.parametrize("name", ["smoke", "smoke.yaml"])
def test_preset_by_name_from_another_folder(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = resolve_config_path(name)
    assert path.is_file() and path.read_bytes() == (ROOT / "configs" / "smoke.yaml").read_bytes()
    assert dataclasses.asdict(load_config(name)) == dataclasses.asdict(load_config(ROOT / "configs/smoke.yaml"))


def test_a_file_of_that_name_wins(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "smoke.yaml").write_text((ROOT / "configs/smoke.yaml").read_text() + "\nsteps: 7\n")
    assert load_config("smoke.yaml").steps == 7
    assert load_config("smoke").steps == load_config(ROOT / "configs/smoke.yaml").steps != 7


def test_unknown_name_lists_the_presets(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"not found: 'smok' \(nor a packaged preset: .*smoke"):
        load_config("smok")
    with pytest.raises(ConfigError) as e:
        load_config("nodir/smoke.yaml")      # a path is a path: no preset look-up
    assert "preset" not in str(e.value)
