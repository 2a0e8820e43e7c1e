"""`kvexport verify`: the package replays the recorded trace and must match both expectations.

Expected outputs come from the eager model (its cached path and its full recompute), never from
the package itself.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch

from kvexport.errors import UserError

from kvexport.artifact import Artifact, check_files, check_manifest_against_package, open_artifact
from kvexport.export.package import read_package


@dataclasses.dataclass(frozen=True)
class Comparison:
    max_abs: float
    max_rel: float
    passed: bool


def compare(output: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float) -> Comparison:
    """Elementwise |out - exp| <= atol + rtol * |exp|; max_rel is |out - exp| / (|exp| + atol)."""
    if output.shape != expected.shape:
        return Comparison(float("inf"), float("inf"), False)
    diff = (output.float() - expected.float()).abs()
    scale = expected.float().abs()
    passed = bool((diff <= atol + rtol * scale).all())
    return Comparison(float(diff.max()) if diff.numel() else 0.0,
                      float((diff / (scale + atol)).max()) if diff.numel() else 0.0, passed)


@dataclasses.dataclass(frozen=True)
class StepResult:
    index: int
    description: str
    batch_size: int
    vs_cached: Comparison
    vs_full: Comparison
    hit_tokens: int
    recomputed_tokens: int
    latency_ms: float

    @property
    def passed(self) -> bool:
        return self.vs_cached.passed and self.vs_full.passed


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
        return {"artifact": self.artifact, "runner": "python", "passed": self.passed,
                "files_checked": self.files_checked, "atol": self.atol, "rtol": self.rtol,
                "steps": steps, "counters": self.counters}


def check_integrity(artifact: Artifact) -> int:
    """Every file against its manifest sha256, then the manifest against the package's metadata.

    Returns how many files were checked; raises as check_files / check_manifest_against_package.
    """
    files_checked = check_files(artifact)
    check_manifest_against_package(artifact, read_package(artifact.package)[0])
    return files_checked


def _expect_failure(runner, request, index: int, expected: str) -> Comparison:
    """A step recorded as failing passes when the package refuses it with the expected message."""
    try:
        runner.score(request, index)
    except UserError as exc:
        return Comparison(0.0, 0.0, expected in str(exc))
    return Comparison(0.0, 0.0, False)


def verify_artifact(root: str | Path, atol: float | None = None, rtol: float | None = None) -> VerifyReport:
    """Checks sha256s, loads the package in a fresh runtime, replays the trace in order.

    atol/rtol override the manifest's tolerances (the manifest's own are checked against the package).
    """
    from kvexport.runner import PackageRunner, load_trace_step

    artifact = open_artifact(root)
    files_checked = check_integrity(artifact)
    runner = PackageRunner(artifact)
    tol = {"atol": artifact.tolerance["atol"] if atol is None else atol,
           "rtol": artifact.tolerance["rtol"] if rtol is None else rtol}
    results = []
    for index, step in enumerate(artifact.trace_steps):
        expect_error = step.get("expect_error", "")
        request, expected_cached, expected_full = load_trace_step(artifact.root / step["file"], not expect_error)
        before = runner.stats()
        started = time.perf_counter()
        if expect_error:
            vs_cached = vs_full = _expect_failure(runner, request, index, expect_error)
        else:
            output = runner.score(request, index)
            vs_cached = compare(output, expected_cached, tol["atol"], tol["rtol"])
            vs_full = compare(output, expected_full, tol["atol"], tol["rtol"])
        latency_ms = (time.perf_counter() - started) * 1e3
        after = runner.stats()
        if expect_error and after != before:
            vs_cached = vs_full = Comparison(0.0, 0.0, False)  # a failed batch must leave the cache as it was
        results.append(StepResult(
            index=index, description=step["description"], batch_size=int(request["user_ids"].shape[0]),
            vs_cached=vs_cached, vs_full=vs_full,
            hit_tokens=after["hit_tokens"] - before["hit_tokens"],
            recomputed_tokens=after["recomputed_tokens"] - before["recomputed_tokens"],
            latency_ms=round(latency_ms, 3),
        ))
    return VerifyReport(str(artifact.root), files_checked, tol["atol"], tol["rtol"], results, runner.stats())
