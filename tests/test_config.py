"""Every config rule, checked through the CLI: one line naming the field and value, exit 2."""

from __future__ import annotations

import copy

import pytest
import yaml
from click.testing import CliRunner

from kvexport.commands.cli import main
from kvexport.config import ConfigError, config_from_dict, load_config
from tests.helpers import ROOT
from tests.helpers.configs import TINY

BASE = yaml.safe_load(TINY.read_text())


def edited(section, key, value):
    raw = copy.deepcopy(BASE)
    target = raw if section is None else raw[section]
    if value is DELETE:
        del target[key]
    else:
        target[key] = value
    return raw


DELETE = object()

CASES = [
    (edited("model", "hidden_size", 65), "model.hidden_size (65) must equal model.num_heads (2) * model.head_dim (32)"),
    (edited("kv_cache", "page_size", 12), "kv_cache.page_size must be a power of two, got 12"),
    (edited("serving", "max_batch_size", 0), "serving.max_batch_size must be >= 1, got 0"),
    (edited("model", "item_vocab_size", 0), "model.item_vocab_size must be > 0, got 0"),
    (edited("model", "context_vocab_size", -3), "model.context_vocab_size must be > 0, got -3"),
    (edited("model", "action_vocab_size", 0), "model.action_vocab_size must be > 0, got 0"),
    (edited("model", "scaling_seqlen", DELETE), "missing key model.scaling_seqlen"),
    (edited("model", "num_layers", "two"), "model.num_layers must be int, got 'two'"),
    (edited("model", "num_heads", True), "model.num_heads must be int, got True"),
    (edited("model", "dtype", "float64"), "model.dtype must be one of float32, bfloat16, float16, got 'float64'"),
    (edited("model", "flash", 1), "unknown key model.flash"),
    (edited(None, "extras", {}), "unknown key extras"),
    (edited(None, "kv_cache", DELETE), "missing section kv_cache"),
    (edited(None, "name", "bad name"), "name must be non-empty and use only letters, digits"),
    (edited("kv_cache", "device_pages", 10), "kv_cache.device_pages (10) cannot hold one user"),
    (edited("kv_cache", "host_pages", -1), "kv_cache.host_pages must be >= 0, got -1"),
    (edited("serving", "device", "tpu"), "serving.device must be one of cpu, cuda, got 'tpu'"),
    (
        edited("serving", "cpu_isa", "znver4"),
        "serving.cpu_isa must be one of native, x86-64-v2, x86-64-v3, got 'znver4'",
    ),
    (edited("model", "num_contextual_features", -1), "model.num_contextual_features must be >= 0, got -1"),
    (edited("trace", "num_candidates", 65), "trace.num_candidates (65) exceeds model.max_num_candidates (64)"),
    (edited("trace", "max_trace_history_length", 600), "trace.max_trace_history_length (600) must lie between"),
    (edited(None, "model", [1, 2]), "model must be a mapping, got list"),
]


@pytest.mark.parametrize("raw,message", CASES, ids=[c[1][:40] for c in CASES])
def test_config_rule_through_cli(tmp_path, raw, message):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    result = CliRunner().invoke(main, ["show-config", str(path)])
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert result.output.count("\n") == 1
    assert "Traceback" not in result.output


def test_malformed_yaml_is_one_line(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("name: x\nmodel: [1, 2\n")
    result = CliRunner().invoke(main, ["show-config", str(path)])
    assert result.exit_code == 2
    assert "is not valid YAML at line" in result.output


def test_missing_config_file(tmp_path):
    result = CliRunner().invoke(main, ["show-config", str(tmp_path / "nope.yaml")])
    assert result.exit_code == 2
    assert "cannot read config" in result.output


@pytest.mark.parametrize("name", ["hstu-tiny.yaml", "hstu-kuairand-1k.yaml", "hstu-kuairand-1k-c1024.yaml"])
def test_shipped_configs_load(name):
    config = load_config(ROOT / "configs" / name)
    assert config.model.hidden_size == config.model.num_heads * config.model.head_dim


def test_tiny_shape_is_fixed():
    m = load_config(TINY).model
    assert (m.num_layers, m.hidden_size, m.num_heads, m.head_dim) == (2, 64, 2, 32)
    assert (m.num_contextual_features, m.max_history_length, m.max_num_candidates, m.num_tasks) == (3, 512, 64, 3)


def test_config_is_frozen():
    config = config_from_dict(BASE)
    with pytest.raises(AttributeError):
        config.model.num_layers = 3  # type: ignore[misc]


def test_config_error_is_value_error():
    with pytest.raises(ValueError):
        config_from_dict([])
    assert issubclass(ConfigError, ValueError)
