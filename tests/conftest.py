"""Shared fixtures. Expensive artifacts (op library, AOTI package, C++ harness) are session-scoped."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvexport.config import load_config
from kvexport.model import build_model

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "configs" / "hstu-tiny.yaml"


@pytest.fixture(scope="session")
def tiny_config():
    return load_config(TINY)


@pytest.fixture(scope="session")
def tiny_model(tiny_config):
    return build_model(tiny_config, seed=0)
