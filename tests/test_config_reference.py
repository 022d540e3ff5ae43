"""docs/config.md is generated from the config dataclasses (fastrehearse/train/config_reference.py):
it must equal a fresh generation, and it names every key the loader accepts."""
import dataclasses
from pathlib import Path

from fastrehearse.train.config import TrainConfig
from fastrehearse.train.config_reference import reference

DOC = Path(__file__).resolve().parent.parent / "docs" / "config.md"


def _keys(cls, prefix=""):
    for f in dataclasses.fields(cls):
        value = getattr(cls(), f.name)
        if dataclasses.is_dataclass(value):
            yield from _keys(type(value), f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}"


def test_docs_config_md_is_current():
    assert DOC.read_text() == reference(), (
        "docs/config.md is stale: python -m fastrehearse.train.config_reference > docs/config.md")


def test_every_key_is_documented_with_its_default():
    text = reference()
    keys = list(_keys(TrainConfig))
    assert len(keys) > 80
    missing = [k for k in keys if f"| `{k}` |" not in text]
    assert missing == []
    assert "| `algo.tis_cap` | float or None | `2.0` |" in text
