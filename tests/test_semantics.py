"""Semantics switches of the model (docs/design.md, side by side): each against the plain-PyTorch
reference, and through the package (build + verify: package, eager cached and eager full recompute
against the float32 reference)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import yaml
from click.testing import CliRunner

from kvexport.artifact import TRACE_KEYS
from kvexport.cli import main
from kvexport.config import ConfigError, config_from_dict
from kvexport.model import build_model, random_batch
from tests.conftest import TINY
from tests.reference import reference_forward


def tiny_with(**model_fields) -> dict:
    raw = yaml.safe_load(TINY.read_text())
    raw["model"].update(model_fields)
    return raw


def test_an_unknown_head_activation_is_refused_by_name():
    with pytest.raises(ConfigError, match=r"^model.head_activation must be one of silu, relu, got 'gelu'$"):
        config_from_dict(tiny_with(head_activation="gelu"))


def test_relu_head_matches_the_reference_and_differs_from_silu(tiny_model, tiny_config):
    relu_config = dataclasses.replace(tiny_config, model=dataclasses.replace(tiny_config.model, head_activation="relu"))
    relu_model = build_model(relu_config)
    relu_model.load_state_dict(tiny_model.state_dict())  # the same weights, only the head's activation differs
    batch = random_batch(tiny_config.model, seed=3, history_lengths=[1, 9, 4], num_candidates=[3, 1, 6])
    with torch.no_grad():
        relu, silu = relu_model(batch), tiny_model(batch)
        torch.testing.assert_close(relu, reference_forward(relu_model, batch, "relu"), rtol=1e-5, atol=1e-5)
    assert (relu - silu).abs().max() > 1e-3


@pytest.mark.slow
def test_a_relu_head_package_verifies(tmp_path, tiny_artifact, tiny_checkpoint):
    """Built from the checkpoint tiny_artifact was built from: only the head's activation differs."""
    config = tmp_path / "hstu-tiny-relu.yaml"
    config.write_text(yaml.safe_dump(tiny_with(head_activation="relu")))
    out = tmp_path / "relu"
    assert CliRunner().invoke(main, ["build", str(config), "-o", str(out), "--checkpoint", str(tiny_checkpoint)]).exit_code == 0
    result = CliRunner().invoke(main, ["verify", str(out)])
    assert result.exit_code == 0, result.output
    assert json.loads((out / "manifest.json").read_text())["config"]["model"]["head_activation"] == "relu"
    key = TRACE_KEYS["expected_cached"]
    relu_first = torch.load(out / "trace" / "step_0000.pt", weights_only=True)[key]
    silu_first = torch.load(tiny_artifact / "trace" / "step_0000.pt", weights_only=True)[key]
    assert relu_first.shape == silu_first.shape and (relu_first - silu_first).abs().max() > 1e-3
