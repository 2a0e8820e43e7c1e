"""`kvexport build` / verify / run / inspect on one shared tiny package."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from kvexport.artifact import open_artifact
from kvexport.commands.cli import main
from kvexport.host.package import Package
from kvexport.model import build_model, random_batch
from kvexport.trace.record import load_trace_step
from kvexport.trace.verify import verify_artifact
from tests.helpers.artifacts import edit_manifest, rehash
from tests.helpers.configs import TINY
from tests.helpers.hostile import good_request, package_corpus

pytestmark = pytest.mark.slow


def test_package_matches_both_expectations_on_every_step(tiny_artifact):
    report = verify_artifact(tiny_artifact)
    assert report.steps, "the trace has no steps"
    for step in report.steps:
        assert step.vs_cached.passed and step.vs_full.passed, step
        assert step.vs_full.max_abs <= 1e-4
    assert report.passed


def test_trace_covers_the_required_situations(tiny_artifact):
    report = verify_artifact(tiny_artifact)
    descriptions = " | ".join(s.description for s in report.steps)
    for needle in (
        "cold users",
        "appended events",
        "zero new events",
        "rewritten history",
        "changed context",
        "onboard from host tier",
    ):
        assert needle in descriptions
    sizes = {s.batch_size for s in report.steps}
    assert {1, 4} <= sizes
    zero_new = [s for s in report.steps if "zero new events" in s.description]
    assert zero_new and all(s.recomputed_tokens == 0 and s.hit_tokens > 0 for s in zero_new)
    assert report.counters["onboards"] > 0 and report.counters["offloads"] > 0
    assert report.counters["prefix_truncations"] > 0


def test_package_reproduces_the_checkpoint(tiny_artifact, tiny_checkpoint, tiny_config):
    model = build_model(tiny_config, checkpoint=tiny_checkpoint)
    default = build_model(tiny_config)
    batch = random_batch(
        tiny_config.model, seed=11, history_lengths=[1, 30, 7], num_candidates=[3, 1, 5], first_user_id=1000
    )
    runner = Package(open_artifact(tiny_artifact))
    with torch.no_grad():
        expected, other = model(batch), default(batch)
    got = runner.score(batch)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(got, other, atol=1e-3)


def test_package_serves_batch_one_single_event_and_maxima(tiny_artifact, tiny_config, tiny_checkpoint):
    m = tiny_config.model
    model = build_model(tiny_config, checkpoint=tiny_checkpoint)
    runner = Package(open_artifact(tiny_artifact))
    cases = [
        ([1], [1]),  # batch 1, a single event, a single candidate
        ([m.max_history_length], [m.max_num_candidates]),  # one user at both maxima
        ([3, 0, 9, 2], [1, 2, 3, 4]),  # max batch, one user without history
    ]
    for seed, (histories, candidates) in enumerate(cases):
        batch = random_batch(
            m, seed=seed, history_lengths=histories, num_candidates=candidates, first_user_id=2000 + 10 * seed
        )
        got = runner.score(batch)
        assert got.shape == (sum(candidates), m.num_tasks)
        with torch.no_grad():
            torch.testing.assert_close(got, model(batch), rtol=1e-4, atol=1e-4)


def test_verify_cli_passes(tiny_artifact, tmp_path):
    report_path = tmp_path / "report.json"
    result = CliRunner().invoke(main, ["verify", str(tiny_artifact), "--json", str(report_path)])
    assert result.exit_code == 0, result.output
    assert "verdict: PASS" in result.output
    report = json.loads(report_path.read_text())
    assert report["passed"] and len(report["steps"]) == len(open_artifact(tiny_artifact).trace_steps)


@pytest.mark.parametrize("victim", ["trace/step_0003.pt", "model.pt2"])
def test_tampered_byte_fails_verify_naming_the_file(artifact_copy, victim):
    path = artifact_copy / victim
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    result = CliRunner().invoke(main, ["verify", str(artifact_copy)])
    assert result.exit_code == 1
    assert f"{victim} does not match its sha256" in result.output


def test_deleted_trace_file_makes_the_artifact_unusable(artifact_copy):
    (artifact_copy / "trace" / "step_0001.pt").unlink()
    result = CliRunner().invoke(main, ["verify", str(artifact_copy)])
    assert result.exit_code == 2
    assert "is incomplete: trace/step_0001.pt is listed in the manifest but missing" in result.output


def test_perturbed_expectation_with_rehashed_manifest_is_caught(artifact_copy):
    """Re-hashing a perturbed expected output in manifest.json: the package's trace digest disagrees."""
    step = artifact_copy / "trace" / "step_0002.pt"
    data = torch.load(step, weights_only=True)
    data["expected_full"] = data["expected_full"] + 1e-2
    torch.save(data, step)
    rehash(artifact_copy, "trace/step_0002.pt")
    result = CliRunner().invoke(main, ["verify", str(artifact_copy)])
    assert result.exit_code == 1
    assert "manifest.json was edited: its trace does not match model.pt2's metadata" in result.output


@pytest.mark.parametrize(
    "field,value",
    [("tolerance", {"atol": 1.0, "rtol": 1.0}), ("required_libraries", ["fbgemm_gpu_py", "kvexport_ops"])],
)
def test_edited_manifest_is_caught(artifact_copy, field, value):
    edit_manifest(artifact_copy, lambda manifest: manifest.update({field: value}))
    result = CliRunner().invoke(main, ["verify", str(artifact_copy)])
    assert result.exit_code == 1
    assert f"manifest.json was edited: its {field} does not match" in result.output


def test_comparison_detects_differences(tiny_artifact):
    """With zero tolerance the package's float differences from the eager model must show as failures."""
    report = verify_artifact(tiny_artifact, atol=0.0, rtol=0.0)
    failing = [s for s in report.steps if not s.passed]
    assert failing and all(s.vs_full.max_abs > 0 for s in failing)
    result = CliRunner().invoke(main, ["verify", str(tiny_artifact), "--atol", "0", "--rtol", "0"])
    assert result.exit_code == 1
    assert "verdict: FAIL" in result.output


def test_capacity_error_step_passes_and_leaves_cache_usable(tiny_artifact):
    report = verify_artifact(tiny_artifact)
    capacity = [s for s in report.steps if "exceed device tier" in s.description]
    assert len(capacity) == 1 and capacity[0].passed and capacity[0].recomputed_tokens == 0
    after = report.steps[capacity[0].index + 1]
    assert after.passed and after.hit_tokens > 0


def test_python_runner_refuses_a_different_shipped_library(artifact_copy):
    """Python verification runs the process's op library; it must be the one the artifact ships."""
    lib = artifact_copy / "lib" / "libkvexport_ops.so"
    lib.write_bytes(lib.read_bytes() + b"\0")
    rehash(artifact_copy, "lib/libkvexport_ops.so")
    result = CliRunner().invoke(main, ["verify", str(artifact_copy)])
    assert result.exit_code == 2
    assert "libkvexport_ops.so differs from the op library loaded here" in result.output


def test_build_refuses_to_overwrite(tiny_artifact):
    result = CliRunner().invoke(main, ["build", str(TINY), "-o", str(tiny_artifact)])
    assert result.exit_code == 2
    assert "already exists (use --force to replace it)" in result.output


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, OSError(28, "No space left on device")])
def test_interrupted_or_failed_build_leaves_nothing(tmp_path, monkeypatch, interrupt):
    import kvexport.export.build as build

    def fail(*args, **kwargs):
        raise interrupt

    monkeypatch.setattr(build, "record_trace", fail)
    monkeypatch.setattr(
        build, "compile_package", lambda ep, path, metadata, configs=None: path.write_bytes(b"partial") or path
    )
    monkeypatch.setattr(build, "check_package_ops", lambda path, ops: ops)
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["build", str(TINY), "-o", str(out)])
    assert result.exit_code != 0
    if isinstance(interrupt, OSError):
        assert result.exit_code == 2
        assert "No space left on device" in result.output
    assert list(tmp_path.iterdir()) == []


def test_run_scores_a_request_file(tiny_artifact, tmp_path):
    artifact = open_artifact(tiny_artifact)
    steps = [load_trace_step(artifact.root / s["file"]) for s in artifact.trace_steps if "expect_error" not in s]
    requests = tmp_path / "requests.pt"
    torch.save([request for request, _, _ in steps], requests)
    output = tmp_path / "logits.pt"
    result = CliRunner().invoke(main, ["run", str(tiny_artifact), "--requests", str(requests), "--output", str(output)])
    assert result.exit_code == 0, result.output
    entries = torch.load(output, weights_only=True)
    assert len(entries) == len(steps)
    for entry, (request, _, expected_full) in zip(entries, steps):
        assert entry["status"] == "ok" and entry["logits"].dtype == torch.float32
        torch.testing.assert_close(entry["logits"], expected_full, rtol=1e-4, atol=1e-4)
        assert torch.equal(entry["user_ids"], request["user_ids"].repeat_interleave(request["num_candidates"]))


def _malformed(config):
    """The package-level hostile corpus (tests/helpers/hostile.py) plus what only a request file can get wrong."""
    missing = good_request(config)
    del missing["candidate_ids"]
    structural = [
        ({**good_request(config), "user_ids": torch.tensor([], dtype=torch.int64)}, "empty batch"),
        (missing, "missing candidate_ids"),
        ({**good_request(config), "extra": torch.zeros(1)}, "unknown field extra"),
        ({**good_request(config), "user_ids": [1, 2]}, "user_ids must be a tensor, got list"),
    ]
    return package_corpus(config) + structural


def test_run_rejects_each_malformed_request(tiny_artifact, tiny_config, tmp_path):
    for i, (request, message) in enumerate(_malformed(tiny_config)):
        requests, output = tmp_path / f"r{i}.pt", tmp_path / f"o{i}.pt"
        torch.save([good_request(tiny_config), request], requests)
        result = CliRunner().invoke(
            main, ["run", str(tiny_artifact), "--requests", str(requests), "--output", str(output)]
        )
        assert result.exit_code == 2, (message, result.output)
        assert result.output.startswith("error: batch 1: ") and message in result.output, result.output
        assert result.output.count("\n") == 1
        assert not output.exists()


def test_run_rejects_too_many_users_and_events(tiny_artifact, tiny_config, tmp_path):
    m = tiny_config.model
    too_many_users = random_batch(m, seed=0, history_lengths=[1] * 5, num_candidates=[1] * 5).to_dict()
    too_long = random_batch(m, seed=0, history_lengths=[m.max_history_length + 1], num_candidates=[1]).to_dict()
    for request, message in (
        (too_many_users, "5 users exceed serving.max_batch_size (4)"),
        (too_long, "history_lengths has 513, outside events [0, 512]"),
    ):
        requests = tmp_path / "r.pt"
        torch.save([request], requests)
        result = CliRunner().invoke(
            main, ["run", str(tiny_artifact), "--requests", str(requests), "--output", str(tmp_path / "o.pt")]
        )
        assert result.exit_code == 2
        assert message in result.output


def test_inspect_directory_and_package(tiny_artifact):
    for target in (tiny_artifact, tiny_artifact / "model.pt2"):
        result = CliRunner().invoke(main, ["inspect", str(target), "--json"])
        assert result.exit_code == 0, result.output
        info = json.loads(result.output)
        assert info["name"] == "hstu-tiny"
        assert "kvexport_ops" in info["required_libraries"]
        assert info["package_ops"]["kvexport::paged_attention"] == 2
    text = CliRunner().invoke(main, ["inspect", str(tiny_artifact)])
    assert "required_libraries" in text.output and "trace_steps" in text.output


def test_compare_flags_values_outside_tolerance():
    from kvexport.trace.verify import compare

    expected = torch.tensor([[1.0, -2.0], [0.5, 0.0]])
    assert compare(expected.clone(), expected, atol=1e-4, rtol=1e-4).passed
    close = expected + torch.tensor([[1e-4, 0.0], [0.0, 0.0]])  # within atol + rtol * 1.0
    assert compare(close, expected, atol=1e-4, rtol=1e-4).passed
    off = expected + torch.tensor([[0.0, 0.0], [0.0, 2e-4]])  # |exp| = 0: only atol applies
    result = compare(off, expected, atol=1e-4, rtol=1e-4)
    assert not result.passed and result.max_abs == pytest.approx(2e-4)
    assert not compare(expected[:1], expected, atol=1.0, rtol=1.0).passed  # shape mismatch


def test_verify_fails_when_expectations_come_from_other_weights(mismatched_artifact):
    result = CliRunner().invoke(main, ["verify", str(mismatched_artifact)])
    assert result.exit_code == 1
    assert "verdict: FAIL" in result.output
    report = verify_artifact(mismatched_artifact)
    checked = [s for s in report.steps if "must fail" not in s.description]
    assert all(not s.passed and s.vs_full.max_abs > 1e-3 for s in checked)


@pytest.mark.slow
def test_the_build_self_test_refuses_a_package_that_disagrees_with_its_trace(tmp_path, monkeypatch):
    """The build's last stage scores the trace's first request through the package in a fresh
    process: a trace recorded from other weights fails it, and nothing is left at OUT."""
    import kvexport.export.build as build
    from kvexport.native.selftest import SelfTestError
    from kvexport.trace.record import record_trace

    monkeypatch.setattr(
        build,
        "record_trace",
        lambda config, model, trace_dir: record_trace(config, build_model(config, seed=5), trace_dir),
    )
    out = tmp_path / "hstu-tiny"
    with pytest.raises(
        SelfTestError, match="after a refused request the package's next output differs from the recorded one$"
    ):
        build.build_artifact(TINY, out)
    assert list(tmp_path.iterdir()) == []
