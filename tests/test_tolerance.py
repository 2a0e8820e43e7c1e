"""The build's tolerance is measured, not guessed.

At build time the eager model's outputs (cached and full recompute, in its dtype) are measured
against the full recompute of a float32 copy of it, and atol is derived from that error. Here:
the recorded reference is checked against the plain-PyTorch reference of tests/helpers/reference.py, and
the derived tolerance must accept the eager outputs and reject outputs scaled by 1.1 or 0.5, for
float32 and bfloat16 (comparison level, eager model only); end to end, `kvexport verify` must fail
a package whose outputs are 10% off its trace while every sha256 and digest is consistent.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import subprocess
import zipfile

import pytest
import torch
from click.testing import CliRunner

from kvexport.artifact import MANIFEST, TRACE_KEYS, open_artifact, sha256_of, trace_digest
from kvexport.commands.cli import main
from kvexport.config import Config, load_config
from kvexport.export.build import _tolerance
from kvexport.model import Batch, build_model
from kvexport.ops import library
from kvexport.trace.record import EXPECTED_CACHED, EXPECTED_FULL, EXPECTED_REFERENCE, RecordedTrace, record_trace
from kvexport.trace.replay import replay_command
from kvexport.trace.verify import compare
from tests.helpers.configs import tiny_raw, write_config
from tests.helpers.reference import reference_forward


@dataclasses.dataclass(frozen=True)
class Recorded:
    config: Config
    model: torch.nn.Module
    trace: RecordedTrace
    steps: list[tuple[dict, torch.Tensor, torch.Tensor, torch.Tensor]]  # request, cached, full, reference

    @property
    def tolerance(self) -> dict[str, float]:
        return _tolerance(self.config, self.trace)


def _tiny_config(dtype: str, directory) -> Config:
    """The tiny config in another dtype, written to a YAML file as a user would."""
    # its own name: its own trace runtime, apart from other tests'
    raw = tiny_raw(name=f"hstu-tiny-{dtype}", model={"dtype": dtype})
    return load_config(write_config(raw, directory / "config.yaml"))


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def recorded(request, tmp_path_factory) -> Recorded:
    """A trace recorded with the eager model alone (no package is built)."""
    directory = tmp_path_factory.mktemp(f"trace-{request.param}")
    config = _tiny_config(request.param, directory)
    model = build_model(config, seed=3)
    library.load()
    trace = record_trace(config, model, directory / "trace")
    steps = []
    for step in trace.steps:
        if TRACE_KEYS["expect_error"] in step:
            continue
        data = torch.load(directory / step[TRACE_KEYS["file"]], weights_only=True)
        reference = torch.load(directory / step[TRACE_KEYS["reference_file"]], weights_only=True)
        request_tensors = {k: v for k, v in data.items() if k not in (EXPECTED_CACHED, EXPECTED_FULL)}
        steps.append((request_tensors, data[EXPECTED_CACHED], data[EXPECTED_FULL], reference[EXPECTED_REFERENCE]))
    return Recorded(config, model, trace, steps)


def test_recorded_reference_is_the_float32_model(recorded):
    """Checked against tests/helpers/reference.py (its own math), on every fourth step to keep it quick."""
    float32_copy = copy.deepcopy(recorded.model).float()
    for request, _, _, reference in recorded.steps[::4]:
        assert reference.dtype == torch.float32
        with torch.no_grad():
            expected = reference_forward(float32_copy, Batch(**request))
        torch.testing.assert_close(reference, expected, atol=1e-6, rtol=0)


def test_measured_error_is_the_eager_outputs_distance_to_the_reference(recorded):
    worst = max(
        float((out - reference).abs().max()) for _, cached, full, reference in recorded.steps for out in (cached, full)
    )
    assert recorded.trace.eager_error == worst
    tolerance = recorded.tolerance
    assert tolerance["measured_max_abs_error"] == worst and tolerance["rtol"] == 0.0
    assert tolerance["atol"] >= tolerance["margin"] * worst and tolerance["atol"] > 0


def test_tolerance_accepts_the_eager_outputs(recorded):
    atol, rtol = recorded.tolerance["atol"], recorded.tolerance["rtol"]
    for _, cached, full, reference in recorded.steps:
        for output, expected in ((cached, reference), (full, reference), (cached, full), (full, cached)):
            assert compare(output, expected, atol, rtol).passed


@pytest.mark.parametrize("scale", [1.1, 0.5])
def test_tolerance_rejects_scaled_outputs_on_every_step(recorded, scale):
    atol, rtol = recorded.tolerance["atol"], recorded.tolerance["rtol"]
    for _, cached, full, reference in recorded.steps:
        for expected in (cached, full, reference):
            assert not compare(cached * scale, expected, atol, rtol).passed


def _rescale_expectations(artifact, scale: float) -> None:
    """Divides every expected output of the trace by `scale`, so the package computes `scale` times
    what the trace expects, and rewrites every sha256 and the package's trace digest to match, as a
    thorough tamperer would: only the numeric comparison is left to notice."""
    manifest = json.loads((artifact / MANIFEST).read_text())
    for step in manifest["trace"]["steps"]:
        if TRACE_KEYS["expect_error"] in step:
            continue
        for rel, keys in (
            (step[TRACE_KEYS["file"]], (EXPECTED_CACHED, EXPECTED_FULL)),
            (step[TRACE_KEYS["reference_file"]], (EXPECTED_REFERENCE,)),
        ):
            data = torch.load(artifact / rel, weights_only=True)
            data.update({key: data[key] / scale for key in keys})
            torch.save(data, artifact / rel)
            manifest["files"][rel] = sha256_of(artifact / rel)
    _set_package_metadata(
        artifact / "model.pt2", "kvexport.trace_digest", trace_digest(manifest["trace"]["steps"], manifest["files"])
    )
    manifest["files"]["model.pt2"] = sha256_of(artifact / "model.pt2")
    (artifact / MANIFEST).write_text(json.dumps(manifest, indent=2))


def _set_package_metadata(package, key: str, value: str) -> None:
    """Rewrites one entry of the metadata files inside an AOTInductor package (a zip archive)."""
    with zipfile.ZipFile(package) as archive:
        members = [(info, archive.read(info)) for info in archive.infolist()]
    with zipfile.ZipFile(package, "w") as archive:
        for info, data in members:
            if info.filename.endswith("_metadata.json"):
                data = json.dumps({**json.loads(data), key: value}).encode()
            archive.writestr(info, data)


def _served_steps(artifact, report_path) -> list[dict]:
    """The report's steps that have outputs (not those recorded as failing)."""
    must_fail = {i for i, s in enumerate(open_artifact(artifact).trace_steps) if TRACE_KEYS["expect_error"] in s}
    return [s for s in json.loads(report_path.read_text())["steps"] if s["index"] not in must_fail]


@pytest.mark.slow
@pytest.mark.parametrize("scale,exit_code", [(1.0, 0), (1.1, 1)])
def test_verify_fails_a_package_ten_percent_off(artifact_copy, tmp_path, scale, exit_code):
    """scale 1.0 is the control: the rewrite alone leaves a passing artifact."""
    _rescale_expectations(artifact_copy, scale)
    report_path = tmp_path / "report.json"
    result = CliRunner().invoke(main, ["verify", str(artifact_copy), "--json", str(report_path)])
    assert result.exit_code == exit_code, result.output
    assert "sha256" not in result.output and "was edited" not in result.output
    steps = _served_steps(artifact_copy, report_path)
    failing = [
        s for s in steps if not (s["vs_cached"]["passed"] or s["vs_full"]["passed"] or s["vs_reference"]["passed"])
    ]
    assert len(failing) == (len(steps) if scale != 1.0 else 0)


@pytest.mark.slow
def test_replay_fails_a_package_ten_percent_off(artifact_copy, tmp_path):
    """The same artifact through the C++ harness."""
    _rescale_expectations(artifact_copy, 1.1)
    report_path = tmp_path / "replay.json"
    result = subprocess.run(replay_command(artifact_copy, report_path), capture_output=True, text=True)
    assert result.returncode == 1, result.stderr
    assert "verdict: FAIL" in result.stdout
    steps = _served_steps(artifact_copy, report_path)
    assert steps and all(not s["vs_reference"]["passed"] and not s["vs_cached"]["passed"] for s in steps)


@pytest.mark.slow
def test_artifact_records_its_tolerance_with_its_measurement(tiny_artifact):
    tolerance = open_artifact(tiny_artifact).tolerance
    assert tolerance["margin"] == 4.0 and tolerance["rtol"] == 0.0 and tolerance["atol_source"] == "measured"
    assert tolerance["atol"] >= tolerance["margin"] * tolerance["measured_max_abs_error"]


def test_config_overrides_the_derived_tolerance(tmp_path):
    raw = tiny_raw(tolerance={"margin": 8, "atol": 0.01})
    path = write_config(raw, tmp_path / "config.yaml")
    config = load_config(path)

    class Measured:
        eager_error = 1e-5

        def tolerance(self, dtype, margin, atol_floor, rtol):
            return RecordedTrace.tolerance(self, dtype, margin, atol_floor, rtol)

    tolerance = _tolerance(config, Measured())
    assert tolerance["atol"] == 0.01 and tolerance["atol_source"] == "config"
    assert tolerance["measured_max_abs_error"] == 1e-5 and tolerance["margin"] == 8
    raw["tolerance"] = {"margin": 0.5}
    write_config(raw, path)
    with pytest.raises(ValueError, match="tolerance.margin must be a finite number >= 1, got 0.5"):
        load_config(path)
