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
from kvexport.commands.cli import main
from kvexport.config import ConfigError
from kvexport.model import build_model, random_batch
from tests.helpers import configs
from tests.helpers.configs import TINY
from tests.helpers.reference import reference_forward

SWITCHES = {
    "head_activation": "relu",
    "layer_norm_eps": 1e-6,
    "silu_on": "u",
    "layer_output": "concat",
    "item_ids": "keys",
    "context_ids": "keys",
    "event_tokens": "combined",
    "candidate_position": "shared_row",
    "context_attention": "whole_prefix",
}


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("head_activation", "gelu", "model.head_activation must be one of silu, relu, got 'gelu'"),
        ("silu_on", "uv", "model.silu_on must be one of uvqk, u, got 'uv'"),
        ("layer_output", "sum", "model.layer_output must be one of gated, concat, got 'sum'"),
        ("layer_norm_eps", 0, "model.layer_norm_eps must be a number in (0, 1), got 0"),
        ("layer_norm_eps", "small", "model.layer_norm_eps must be float, got 'small'"),
        ("item_ids", "hashed", "model.item_ids must be one of rows, keys, got 'hashed'"),
        ("context_ids", "hashed", "model.context_ids must be one of rows, keys, got 'hashed'"),
        ("event_tokens", "triples", "model.event_tokens must be one of pairs, combined, got 'triples'"),
        (
            "candidate_position",
            "first",
            "model.candidate_position must be one of after_prefix, shared_row, got 'first'",
        ),
        ("context_attention", "full", "model.context_attention must be one of causal, whole_prefix, got 'full'"),
    ],
)
def test_an_unknown_switch_value_is_refused_by_name(field, value, message):
    with pytest.raises(ConfigError, match=f"^{message.replace('(', '[(]').replace(')', '[)]')}$"):
        configs.tiny_config(model={field: value})


def test_yaml_exponent_notation_is_read_as_a_number(tmp_path):
    path = tmp_path / "eps.yaml"
    path.write_text(TINY.read_text().replace("model:\n", "model:\n  layer_norm_eps: 1e-6\n", 1))
    from kvexport.config import load_config

    assert load_config(path).model.layer_norm_eps == 1e-6


def switched_model(tiny_model, tiny_config, **switches):
    """tiny_model's weights (where their shapes allow) under other switches: seeded init for the rest."""
    config = dataclasses.replace(tiny_config, model=dataclasses.replace(tiny_config.model, **switches))
    model = build_model(config, seed=0)
    own = model.state_dict()
    tiny = tiny_model.state_dict()
    model.load_state_dict({k: tiny[k] if k in tiny and tiny[k].shape == v.shape else v for k, v in own.items()})
    return model


# context_attention moves the tiny model's logits by ~1e-8 only (its S is large, and the contextual rows'
# extra keys reach the candidates through a second division by S): tested on its own below.
ALONE = {name: value for name, value in SWITCHES.items() if name != "context_attention"}


@pytest.mark.parametrize("switch", [{name: value} for name, value in ALONE.items()] + [SWITCHES], ids=[*ALONE, "all"])
def test_each_switch_matches_the_reference_and_changes_the_output(tiny_model, tiny_config, switch):
    model = switched_model(tiny_model, tiny_config, **switch)
    batch = random_batch(tiny_config.model, seed=3, history_lengths=[1, 9, 4], num_candidates=[3, 1, 6])
    with torch.no_grad():
        got, default = model(batch), tiny_model(batch)
        torch.testing.assert_close(got, reference_forward(model, batch, **switch), rtol=1e-5, atol=1e-5)
    assert (got - default).abs().max() > 1e-6


def test_contextual_rows_reading_the_whole_prefix_match_the_reference(tiny_model, tiny_config):
    """With S small enough that attention matters, whole_prefix moves the logits and matches the
    reference's mask (contextual rows read every prefix token, later ones too)."""
    causal = switched_model(tiny_model, tiny_config, scaling_seqlen=4)
    whole = switched_model(tiny_model, tiny_config, scaling_seqlen=4, context_attention="whole_prefix")
    with torch.no_grad():  # the same larger projections in both, so that attention moves the state
        for model in (causal, whole):
            for layer in model.layers:
                layer.uvqk.weight.mul_(4)
                layer.output.weight.mul_(4)
    batch = random_batch(tiny_config.model, seed=3, history_lengths=[1, 9, 4], num_candidates=[3, 1, 6])
    with torch.no_grad():
        got = whole(batch)
        torch.testing.assert_close(
            got, reference_forward(whole, batch, context_attention="whole_prefix"), rtol=1e-5, atol=1e-5
        )
        torch.testing.assert_close(causal(batch), reference_forward(causal, batch), rtol=1e-5, atol=1e-5)
        assert (got - causal(batch)).abs().max() > 1e-3


@pytest.mark.slow
def test_a_package_with_every_switch_off_its_default_verifies(tmp_path, tiny_artifact, tiny_checkpoint):
    """Built from the checkpoint tiny_artifact was built from (relu, eps, silu_on; the concat
    output's wider projection, combined events' shorter position table, the item and context keys
    seeded anew; the trace draws keys and unknown ids): verify checks the package, the eager cached path and
    the eager full recompute against the float32 reference, step by step."""
    config = tmp_path / "hstu-tiny-switched.yaml"
    config.write_text(yaml.safe_dump(configs.tiny_raw(model=SWITCHES)))
    checkpoint = tmp_path / "switched.pt"
    state = torch.load(tiny_checkpoint, weights_only=True)
    wider = build_model(configs.tiny_config(model=SWITCHES), seed=1).state_dict()
    torch.save(
        {
            **{k: wider[k] if wider[k].shape != v.shape else v for k, v in state.items()},
            "item_keys": wider["item_keys"],
            "context_keys": wider["context_keys"],
        },
        checkpoint,
    )
    out = tmp_path / "switched"
    built = CliRunner().invoke(main, ["build", str(config), "-o", str(out), "--checkpoint", str(checkpoint)])
    assert built.exit_code == 0, built.output
    result = CliRunner().invoke(main, ["verify", str(out)])
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["config"]["model"]["silu_on"] == "u"
    assert manifest["dims"]["item_ids"] == manifest["dims"]["context_ids"] == "keys"
    key = TRACE_KEYS["expected_cached"]
    switched_first = torch.load(out / "trace" / "step_0000.pt", weights_only=True)[key]
    default_first = torch.load(tiny_artifact / "trace" / "step_0000.pt", weights_only=True)[key]
    assert switched_first.shape == default_first.shape and (switched_first - default_first).abs().max() > 1e-3
