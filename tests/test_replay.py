"""The C++ replay harness on the shared tiny package: pass, mismatch, unusable input, parity with Python."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch
from click.testing import CliRunner

from kvexport.commands.cli import main
from kvexport.trace.replay import harness, replay_command
from kvexport.trace.verify import verify_artifact
from tests.helpers.artifacts import edit_manifest, rehash

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def replay_binary():
    return harness()


def run_harness(args, tmp_path):
    """Runs the harness with TMPDIR pointed at an empty directory, to see what it leaves behind."""
    temp = tmp_path / "tmpdir"
    temp.mkdir(exist_ok=True)
    result = subprocess.run(args, capture_output=True, text=True, env={**os.environ, "TMPDIR": str(temp)})
    return result, list(temp.iterdir())


def test_replay_passes_and_matches_python(replay_binary, tiny_artifact, tmp_path):
    report_path = tmp_path / "replay.json"
    result, leftovers = run_harness(replay_command(tiny_artifact, report_path), tmp_path)
    assert result.returncode == 0, result.stderr
    assert "verdict: PASS (cpp:" in result.stdout
    assert leftovers == []
    cpp = json.loads(report_path.read_text())
    python = verify_artifact(tiny_artifact).to_json()
    assert cpp["passed"] and python["passed"]
    assert len(cpp["steps"]) == len(python["steps"])
    for c, p in zip(cpp["steps"], python["steps"]):
        assert (c["description"], c["batch_size"]) == (p["description"], p["batch_size"])
        assert (c["hit_tokens"], c["recomputed_tokens"]) == (p["hit_tokens"], p["recomputed_tokens"])
        for key in ("vs_cached", "vs_full"):
            assert c[key]["max_abs"] == pytest.approx(p[key]["max_abs"], abs=1e-7)
    # Every counter of the cache; busy_host_requests counts what the host's load was during each run.
    load = "busy_host_requests"
    assert {k: v for k, v in cpp["counters"].items() if k != load} == {
        k: v for k, v in python["counters"].items() if k != load
    }


def test_replay_cli_repeat_reports_percentiles(replay_binary, tiny_artifact, tmp_path):
    report_path = tmp_path / "replay.json"
    result = CliRunner().invoke(main, ["replay", str(tiny_artifact), "--repeat", "3", "--json", str(report_path)])
    assert result.exit_code == 0
    steps = json.loads(report_path.read_text())["steps"]
    assert all(s["latency_p99_ms"] >= s["latency_p50_ms"] > 0 for s in steps)


def test_replay_with_threads_stays_correct(replay_binary, tiny_artifact, tmp_path):
    report_path = tmp_path / "replay.json"
    result, _ = run_harness(replay_command(tiny_artifact, report_path, repeat=2, threads=3), tmp_path)
    assert result.returncode == 0, result.stderr
    report = json.loads(report_path.read_text())
    assert report["threads"] == 3 and report["passed"]


def test_replay_fails_on_perturbed_expectation(replay_binary, artifact_copy, tmp_path):
    step = artifact_copy / "trace" / "step_0004.pt"
    data = torch.load(step, weights_only=True)
    data["expected_cached"] = data["expected_cached"] * 1.01 + 1e-3
    torch.save(data, step)
    rehash(artifact_copy, "trace/step_0004.pt")
    result, leftovers = run_harness(replay_command(artifact_copy), tmp_path)
    assert result.returncode == 1
    assert "manifest.json was edited: its trace does not match model.pt2's metadata" in result.stderr
    assert leftovers == []


def test_replay_comparison_detects_differences(replay_binary, tiny_artifact, tmp_path):
    report_path = tmp_path / "replay.json"
    result, leftovers = run_harness(replay_command(tiny_artifact, report_path, atol=0.0, rtol=0.0), tmp_path)
    assert result.returncode == 1
    assert "verdict: FAIL" in result.stdout
    steps = json.loads(report_path.read_text())["steps"]
    assert any(not s["passed"] and s["vs_full"]["max_abs"] > 0 for s in steps)
    assert leftovers == []


def test_replay_fails_on_modified_file(replay_binary, artifact_copy, tmp_path):
    path = artifact_copy / "trace" / "step_0000.pt"
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF
    path.write_bytes(bytes(data))
    result, _ = run_harness(replay_command(artifact_copy), tmp_path)
    assert result.returncode == 1
    assert "trace/step_0000.pt does not match its sha256" in result.stderr


def test_missing_required_library_is_named(replay_binary, artifact_copy, tmp_path):
    """A library the manifest requires and nobody passes is named before the package is loaded."""
    edit_manifest(artifact_copy, lambda manifest: manifest.update(required_libraries=["fbgemm_gpu_py", "kvexport_ops"]))
    result, _ = run_harness([str(replay_binary), "--artifact", str(artifact_copy)], tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip() == "error: the package needs op library fbgemm_gpu_py; pass it with --library PATH"


def test_unloaded_op_library_is_named_and_cleaned_up(replay_binary, artifact_copy, tmp_path):
    """An op library that defines none of the package's ops: the loader's schema error becomes a message."""
    source = tmp_path / "empty.cpp"
    source.write_text('extern "C" int kvexport_test_nothing() { return 0; }\n')
    library = artifact_copy / "lib" / "libkvexport_ops.so"
    subprocess.run(["g++", "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    rehash(artifact_copy, "lib/libkvexport_ops.so")
    result, leftovers = run_harness([str(replay_binary), "--artifact", str(artifact_copy)], tmp_path)
    assert result.returncode == 2
    assert "model.pt2 calls kvexport::check_request but no loaded library defines it" in result.stderr
    assert leftovers == []


def test_missing_op_library_in_artifact(replay_binary, artifact_copy, tmp_path):
    (artifact_copy / "lib" / "libkvexport_ops.so").unlink()
    result, _ = run_harness(replay_command(artifact_copy), tmp_path)
    assert result.returncode == 2
    assert "is incomplete: lib/libkvexport_ops.so is listed in the manifest but missing" in result.stderr


@pytest.mark.parametrize(
    "args,message",
    [
        ([], "--artifact is required"),
        (["--artifact"], "--artifact needs a value"),
        (["--artifact", "/nonexistent"], "artifact directory /nonexistent does not exist"),
        (["--artifact", ".", "--repeat", "0"], "--repeat must be a positive integer, got 0"),
        (["--bogus"], "unknown flag --bogus"),
    ],
)
def test_bad_flags_exit_2(replay_binary, tmp_path, args, message):
    result, _ = run_harness([str(replay_binary), *args], tmp_path)
    assert result.returncode == 2
    assert message in result.stderr


def test_incomplete_artifact_directory(replay_binary, tmp_path):
    (tmp_path / "empty").mkdir()
    result = CliRunner().invoke(main, ["replay", str(tmp_path / "empty")])
    assert result.exit_code == 2
    assert "is not a kvexport artifact: manifest.json is missing" in result.output


def test_replay_fails_when_expectations_come_from_other_weights(replay_binary, mismatched_artifact, tmp_path):
    report_path = tmp_path / "replay.json"
    result, leftovers = run_harness(replay_command(mismatched_artifact, report_path), tmp_path)
    assert result.returncode == 1
    assert "verdict: FAIL" in result.stdout
    cpp = json.loads(report_path.read_text())["steps"]
    python = verify_artifact(mismatched_artifact).to_json()["steps"]
    for c, p in zip(cpp, python):
        assert c["passed"] == p["passed"]
        assert c["vs_full"]["max_abs"] == pytest.approx(p["vs_full"]["max_abs"], abs=1e-7)
    assert sum(not s["passed"] for s in cpp) >= len(cpp) - 1
    assert leftovers == []
