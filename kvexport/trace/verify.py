"""`kvexport verify`: the package replays the recorded trace and must match every expectation.

Expected outputs come from the eager model (its cached path and its full recompute) and from its
float32 copy (the reference the build's tolerance was measured against), never from the package.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import torch

from kvexport.artifact import TRACE_KEYS, Artifact, check_files, check_manifest_against_package, open_artifact
from kvexport.errors import RequestFailed, UserError
from kvexport.host.package_file import read_package
from kvexport.io import load_tensor_file
from kvexport.native.isa import check_host
from kvexport.progress import Progress

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Comparison:
    max_abs: float
    max_rel: float
    passed: bool


def compare(output: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float) -> Comparison:
    """Elementwise |out - exp| <= atol + rtol * |exp|; max_rel is |out - exp| / (|exp| + atol)."""
    if output.shape != expected.shape:
        return Comparison(float("inf"), float("inf"), False)
    diff = (output.float().cpu() - expected.float().cpu()).abs()
    scale = expected.float().cpu().abs()
    passed = bool((diff <= atol + rtol * scale).all())
    return Comparison(
        float(diff.max()) if diff.numel() else 0.0,
        float((diff / (scale + atol)).max()) if diff.numel() else 0.0,
        passed,
    )


@dataclasses.dataclass(frozen=True)
class StepResult:
    index: int
    description: str
    batch_size: int
    vs_cached: Comparison
    vs_full: Comparison
    vs_reference: Comparison
    hit_tokens: int
    recomputed_tokens: int
    latency_ms: float

    @property
    def passed(self) -> bool:
        return self.vs_cached.passed and self.vs_full.passed and self.vs_reference.passed


@dataclasses.dataclass(frozen=True)
class VerifyReport:
    artifact: str
    files_checked: int
    atol: float
    rtol: float
    steps: list[StepResult]
    counters: dict[str, int]

    @property
    def passed(self) -> bool:
        return all(step.passed for step in self.steps)

    def to_json(self) -> dict:
        steps = [{**dataclasses.asdict(s), "passed": s.passed} for s in self.steps]
        return {
            "artifact": self.artifact,
            "runner": "python",
            "passed": self.passed,
            "files_checked": self.files_checked,
            "atol": self.atol,
            "rtol": self.rtol,
            "steps": steps,
            "counters": self.counters,
        }


def check_integrity(artifact: Artifact) -> int:
    """Every file against its manifest sha256, this CPU against what the artifact requires, then the
    manifest against the package's metadata (the C++ harness's order).

    Returns how many files were checked; raises as check_files / check_host /
    check_manifest_against_package.
    """
    files_checked = check_files(artifact)
    check_host(artifact.manifest.isa)
    check_manifest_against_package(artifact, read_package(artifact.package)[0])
    return files_checked


def _expect_failure(runner, request, index: int, expected_code: str) -> Comparison:
    """A step recorded as failing passes when the package refuses it with the expected error code."""
    try:
        runner.score(request, index=index)
    except RequestFailed as exc:
        return Comparison(0.0, 0.0, exc.code == expected_code)
    return Comparison(0.0, 0.0, False)


def load_reference(artifact: Artifact, step: dict) -> torch.Tensor:
    """The float32 reference output of a step, from the file its manifest entry names."""
    key, field = TRACE_KEYS["expected_reference"], TRACE_KEYS["reference_file"]
    if not step.get(field):
        raise UserError(f"trace step {step[TRACE_KEYS['file']]} lacks its {field}")
    path = artifact.root / step[field]
    data = load_tensor_file(path, "trace file")
    if not isinstance(data, dict) or not isinstance(data.get(key), torch.Tensor):
        raise UserError(f"trace file {path} lacks {key}")
    return data[key]


def verify_artifact(root: str | Path, atol: float | None = None, rtol: float | None = None) -> VerifyReport:
    """Checks sha256s, loads the package in a fresh runtime, replays the trace in order.

    atol/rtol override the manifest's tolerances (the manifest's own are checked against the package).
    """
    from kvexport.host.package import load

    artifact = open_artifact(root)
    files_checked = check_integrity(artifact)
    with load(artifact, check_files=False) as runner:  # checked just above
        return _replay(artifact, runner, files_checked, atol, rtol)


def _replay(artifact: Artifact, runner, files_checked: int, atol: float | None, rtol: float | None) -> VerifyReport:
    from kvexport.trace.record import load_trace_step

    tol = {
        "atol": artifact.tolerance["atol"] if atol is None else atol,
        "rtol": artifact.tolerance["rtol"] if rtol is None else rtol,
    }
    results = []
    progress = Progress("verify", len(artifact.trace_steps), log)
    for index, step in enumerate(artifact.trace_steps):
        expect_error = step.get(TRACE_KEYS["expect_error"], "")
        request, *expected = load_trace_step(artifact.root / step[TRACE_KEYS["file"]], not expect_error)
        if not expect_error:
            expected.append(load_reference(artifact, step))
        before = runner.stats()
        started = time.perf_counter()
        if expect_error:
            vs_cached = vs_full = vs_reference = _expect_failure(runner, request, index, expect_error)
        else:
            output = runner.score(request, index=index)
            vs_cached, vs_full, vs_reference = (compare(output, e, tol["atol"], tol["rtol"]) for e in expected)
        latency_ms = (time.perf_counter() - started) * 1e3
        after = runner.stats()
        if expect_error and after != before:  # a failed batch must leave the cache as it was
            vs_cached = vs_full = vs_reference = Comparison(0.0, 0.0, False)
        results.append(
            StepResult(
                index=index,
                description=step[TRACE_KEYS["description"]],
                batch_size=int(request["user_ids"].shape[0]),
                vs_cached=vs_cached,
                vs_full=vs_full,
                vs_reference=vs_reference,
                hit_tokens=after["hit_tokens"] - before["hit_tokens"],
                recomputed_tokens=after["recomputed_tokens"] - before["recomputed_tokens"],
                latency_ms=round(latency_ms, 3),
            )
        )
        progress.step()
    progress.finish()
    return VerifyReport(str(artifact.root), files_checked, tol["atol"], tol["rtol"], results, runner.stats())
