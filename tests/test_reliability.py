"""Reliability: short soak under eviction, capacity errors, concurrency, hostile inputs."""

from __future__ import annotations

import json
import pickle

import pytest
import torch
from click.testing import CliRunner

from kvexport.artifact import open_artifact
from kvexport.commands.cli import main
from kvexport.config import load_config
from kvexport.errors import RequestFailed
from kvexport.host.package import Package
from kvexport.model import build_model, random_batch
from tests.helpers.configs import TINY, tiny_raw, write_config

pytestmark = pytest.mark.slow


def test_short_soak_has_no_mismatch_and_exercises_every_tier(tiny_artifact, tiny_checkpoint, tmp_path):
    report_path = tmp_path / "soak.json"
    result = CliRunner().invoke(
        main,
        [
            "soak",
            str(tiny_artifact),
            "--requests",
            "250",
            "--users",
            "40",
            "--seed",
            "3",
            "--checkpoint",
            str(tiny_checkpoint),
            "--json",
            str(report_path),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "verdict: PASS" in result.output
    report = json.loads(report_path.read_text())
    assert report["mismatches"] == 0 and report["requests"] == 250
    counters = report["counters"]
    for name in ("hit_tokens", "device_evictions", "offloads", "onboards", "host_evictions", "prefix_truncations"):
        assert counters[name] > 10, name
    for kind in ("edit", "delete", "context"):
        assert report["workload"][kind] > 0, kind


def test_soak_needs_the_build_checkpoint(tiny_artifact, tmp_path):
    result = CliRunner().invoke(main, ["soak", str(tiny_artifact), "--requests", "1"])
    assert result.exit_code == 2
    assert "was built from a checkpoint; pass the same file with --checkpoint" in result.output
    other = tmp_path / "other.pt"
    CliRunner().invoke(main, ["init-checkpoint", str(TINY), "-o", str(other), "--seed", "9"])
    result = CliRunner().invoke(main, ["soak", str(tiny_artifact), "--requests", "1", "--checkpoint", str(other)])
    assert result.exit_code == 2
    assert "is not the one" in result.output


def test_capacity_error_then_next_request_is_correct(tiny_artifact, tiny_checkpoint, tiny_config):
    m = tiny_config.model
    model = build_model(tiny_config, checkpoint=tiny_checkpoint)
    runner = Package(open_artifact(tiny_artifact))
    warm = random_batch(m, seed=1, history_lengths=[40], num_candidates=[4], first_user_id=5000)
    runner.score(warm)
    before = runner.stats()
    too_big = random_batch(
        m, seed=2, history_lengths=[m.max_history_length] * 2, num_candidates=[1, 1], first_user_id=6000
    )
    with pytest.raises(
        RequestFailed, match=r"^KV cache capacity exceeded: the batch of 2 users needs 130 device pages"
    ) as refused:
        runner.score(too_big)
    assert refused.value.code == "capacity_exceeded"  # from the runtime, not parsed from the exception
    assert runner.stats() == before
    with torch.no_grad():
        expected = model(warm)
    torch.testing.assert_close(runner.score(warm), expected, rtol=1e-4, atol=1e-4)
    assert runner.stats()["hit_tokens"] > before["hit_tokens"]


def test_capacity_error_through_run_is_one_line(tiny_artifact, tiny_config, tmp_path):
    m = tiny_config.model
    too_big = random_batch(m, seed=2, history_lengths=[m.max_history_length] * 2, num_candidates=[1, 1])
    requests = tmp_path / "requests.pt"
    torch.save([too_big.to_dict()], requests)
    result = CliRunner().invoke(
        main, ["run", str(tiny_artifact), "--requests", str(requests), "--output", str(tmp_path / "out.pt")]
    )
    assert result.exit_code == 2
    assert "error: batch 0: KV cache capacity exceeded" in result.output
    assert "Traceback" not in result.output
    [entry] = torch.load(tmp_path / "out.pt", weights_only=True)
    assert entry["status"].startswith("KV cache capacity exceeded") and entry["logits"] is None


class _Exploit:
    def __reduce__(self):
        return (print, ("pwned",))


def test_malicious_request_file_is_refused(tiny_artifact, tmp_path):
    requests = tmp_path / "evil.pt"
    requests.write_bytes(pickle.dumps([_Exploit()]))
    result = CliRunner().invoke(
        main, ["run", str(tiny_artifact), "--requests", str(requests), "--output", str(tmp_path / "out.pt")]
    )
    assert result.exit_code == 2
    assert "is refused: it is not a plain tensor file" in result.output
    assert "pwned" not in result.output


@pytest.mark.parametrize(
    "kind,message",
    [
        ("missing", "is missing tensor head.2.bias (1 missing)"),
        ("unexpected", "has unexpected tensor extra.weight (1 unexpected)"),
        ("not-a-dict", "must hold a dict of tensors"),
    ],
)
def test_bad_checkpoints_are_refused(tmp_path, kind, message):
    state = build_model(load_config(TINY)).state_dict()
    if kind == "missing":
        del state["head.2.bias"]
    elif kind == "unexpected":
        state["extra.weight"] = torch.zeros(1)
    else:
        state = [torch.zeros(1)]
    path = tmp_path / "ckpt.pt"
    torch.save(state, path)
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["build", str(TINY), "-o", str(out), "--checkpoint", str(path)])
    assert result.exit_code == 2
    assert message in result.output
    assert not out.exists() and list(tmp_path.iterdir()) == [path]


def test_truncated_package_fails_verify(artifact_copy):
    package = artifact_copy / "model.pt2"
    package.write_bytes(package.read_bytes()[: package.stat().st_size // 2])
    result = CliRunner().invoke(main, ["verify", str(artifact_copy)])
    assert result.exit_code == 1
    assert "model.pt2 does not match its sha256" in result.output


@pytest.mark.parametrize(
    "content,message",
    [
        ("{not json", "manifest.json is not valid JSON"),
        ('{"format_version": 1}', "manifest.json lacks the field config"),
        (
            '{"format_version": 99, "config": {}, "runtime_config": {}, "dims": {}, "files": {},'
            ' "trace": {"steps": []}, "tolerance": {}, "runtime_name": "x", "required_libraries": []}',
            "has format_version 99",
        ),
        (
            '{"format_version": 1, "config": {}, "runtime_config": {}, "dims": {}, "files": {}, "trace": {},'
            ' "tolerance": {}, "runtime_name": "x", "required_libraries": []}',
            "lacks the trace step list",
        ),
    ],
)
def test_unusable_manifest(artifact_copy, content, message):
    (artifact_copy / "manifest.json").write_text(content)
    for command in ("verify", "run", "inspect", "replay"):
        args = [command, str(artifact_copy)]
        if command == "run":
            args += ["--requests", "r.pt", "--output", "o.pt"]
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 2, (command, result.output)
        assert message in result.output


def test_unwritable_outputs(tiny_artifact, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    result = CliRunner().invoke(main, ["build", str(TINY), "-o", str(blocker / "out")])
    assert result.exit_code == 2 and "does not exist" in result.output
    requests = tmp_path / "requests.pt"
    torch.save([random_batch(load_config(TINY).model, 0, [1], [1]).to_dict()], requests)
    result = CliRunner().invoke(
        main, ["run", str(tiny_artifact), "--requests", str(requests), "--output", str(blocker / "out.pt")]
    )
    assert result.exit_code == 2 and "is not a directory" in result.output
    result = CliRunner().invoke(main, ["init-checkpoint", str(TINY), "-o", str(blocker / "c.pt")])
    assert result.exit_code == 2 and "cannot write -o" in result.output and "is not a directory" in result.output
    assert sorted(tmp_path.iterdir()) == sorted([blocker, requests])


def test_hostile_config_through_build_leaves_nothing(tmp_path):
    config = write_config(tiny_raw(model={"head_dim": 31}), tmp_path / "bad.yaml")
    result = CliRunner().invoke(main, ["build", str(config), "-o", str(tmp_path / "out")])
    assert result.exit_code == 2
    assert "model.hidden_size (64) must equal model.num_heads (2) * model.head_dim (31)" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.yaml"]
