"""`kvexport verify`: the package replays the recorded trace and must match both expectations.

Expected outputs come from the eager model (its cached path and its full recompute), never from
the package itself.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch

from kvexport.artifact import check_files, open_artifact


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


def verify_artifact(root: str | Path) -> VerifyReport:
    """Checks sha256s, loads the package in a fresh runtime, replays the trace in order."""
    from kvexport.runner import PackageRunner, load_trace_step

    artifact = open_artifact(root)
    files_checked = check_files(artifact)
    runner = PackageRunner(artifact)
    tol = artifact.tolerance
    results = []
    for index, step in enumerate(artifact.trace_steps):
        request, expected_cached, expected_full = load_trace_step(artifact.root / step["file"])
        before = runner.stats()
        started = time.perf_counter()
        output = runner.score(request, index)
        latency_ms = (time.perf_counter() - started) * 1e3
        after = runner.stats()
        results.append(StepResult(
            index=index, description=step["description"], batch_size=int(request["user_ids"].shape[0]),
            vs_cached=compare(output, expected_cached, tol["atol"], tol["rtol"]),
            vs_full=compare(output, expected_full, tol["atol"], tol["rtol"]),
            hit_tokens=after["hit_tokens"] - before["hit_tokens"],
            recomputed_tokens=after["recomputed_tokens"] - before["recomputed_tokens"],
            latency_ms=round(latency_ms, 3),
        ))
    return VerifyReport(str(artifact.root), files_checked, tol["atol"], tol["rtol"], results, runner.stats())
