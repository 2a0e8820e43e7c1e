"""hstu-tiny with changed fields: one way to write the variants the tests use."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from kvexport.config import Config, config_from_dict
from tests.helpers import ROOT

TINY = ROOT / "configs" / "hstu-tiny.yaml"
# model fields of the item-tower head: hour of the day, day of the week
ITEM_TOWER = {"head": "item_tower", "query_time_periods": [[3600, 24], [86400, 7]]}


def tiny_raw(**overrides: Any) -> dict[str, Any]:
    """hstu-tiny.yaml as a mapping with `overrides`: a dict for a section (model, kv_cache, serving,
    trace, tolerance) updates that section's fields; any other value replaces the key (name=...)."""
    raw = yaml.safe_load(TINY.read_text())
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(raw.get(key), dict):
            raw[key].update(value)
        else:
            raw[key] = value
    return raw


def tiny_config(**overrides: Any) -> Config:
    """tiny_raw(**overrides) as a checked Config."""
    return config_from_dict(tiny_raw(**overrides))


def write_config(raw: dict[str, Any], path: Path) -> Path:
    """Writes a config mapping as YAML, as a user would; returns the path."""
    path.write_text(yaml.safe_dump(raw))
    return path
