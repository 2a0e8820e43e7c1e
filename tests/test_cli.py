"""CLI skeleton: help, version, checkpoints, verbose tracebacks."""

from __future__ import annotations

import pickle
import subprocess
import sys

import torch
from click.testing import CliRunner

from kvexport import __version__
from kvexport.commands.cli import main
from kvexport.config import load_config
from kvexport.model import build_model
from tests.helpers import ROOT
from tests.helpers.configs import TINY


def test_help_lists_commands():
    result = CliRunner().invoke(main, ["--help"])
    assert result.exit_code == 0
    for command in ("init-checkpoint", "score", "show-config"):
        assert command in result.output


def test_every_command_and_its_defaults_load_without_torch():
    """The commands read their defaults from kvexport.options, which must not pull torch into
    `kvexport --help` or any command's --help."""
    code = (
        "import sys; from click.testing import CliRunner; from kvexport.commands.cli import main; "
        "assert all(CliRunner().invoke(main, [name, '--help']).exit_code == 0 for name in main.commands); "
        "assert 'torch' not in sys.modules, 'torch'"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_version():
    result = CliRunner().invoke(main, ["--version"])
    assert result.exit_code == 0
    assert __version__ in result.output


def test_checkpoint_round_trip(tmp_path):
    path = tmp_path / "ckpt.pt"
    result = CliRunner().invoke(main, ["init-checkpoint", str(TINY), "-o", str(path), "--seed", "7"])
    assert result.exit_code == 0, result.output
    config = load_config(TINY)
    loaded = build_model(config, checkpoint=path)
    seeded = build_model(config, seed=7)
    other = build_model(config, seed=8)
    for key, tensor in seeded.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], tensor), key
    assert not torch.equal(other.state_dict()["item_embedding.weight"], seeded.state_dict()["item_embedding.weight"])
    assert torch.load(path, weights_only=True).keys() == seeded.state_dict().keys()


def test_score_prints_logits_shape():
    result = CliRunner().invoke(main, ["score", str(TINY), "--batch-size", "3"])
    assert result.exit_code == 0, result.output
    assert "logits: (24, 3) torch.float32 for 3 users" in result.output


class _Exploit:
    def __reduce__(self):
        return (print, ("pwned",))


def test_malicious_checkpoint_is_refused(tmp_path):
    path = tmp_path / "evil.pt"
    path.write_bytes(pickle.dumps({"x": _Exploit()}))
    result = CliRunner().invoke(main, ["score", str(TINY), "--checkpoint", str(path)])
    assert result.exit_code == 2
    assert "is refused" in result.output
    assert "pwned" not in result.output


def test_mis_shaped_checkpoint(tmp_path):
    path = tmp_path / "ckpt.pt"
    state = build_model(load_config(TINY)).state_dict()
    state["head.0.weight"] = torch.zeros(3, 3)
    torch.save(state, path)
    result = CliRunner().invoke(main, ["score", str(TINY), "--checkpoint", str(path)])
    assert result.exit_code == 2
    assert "tensor head.0.weight has shape [3, 3], the config needs [64, 64]" in result.output


def test_verbose_shows_traceback(tmp_path):
    missing = str(tmp_path / "missing.yaml")
    quiet = subprocess.run([sys.executable, "-m", "kvexport", "score", missing], capture_output=True, text=True)
    loud = subprocess.run([sys.executable, "-m", "kvexport", "-v", "score", missing], capture_output=True, text=True)
    assert quiet.returncode == loud.returncode == 2
    assert quiet.stderr.strip().splitlines() == [f"error: cannot read config {missing}: No such file or directory"]
    assert "Traceback" in loud.stderr
