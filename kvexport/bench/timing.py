"""Paired timing: two measurements alternate within each repetition, so machine noise hits both,
and their ratio is taken pair by pair."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def _wait_for_device() -> None:
    """CUDA work is asynchronous: a time is taken only once the device has finished it."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


def timed_ms(run: Callable[..., object], *args: object) -> float:
    """Wall milliseconds of run(*args), the device's work included."""
    _wait_for_device()
    started = time.perf_counter()
    run(*args)
    _wait_for_device()
    return (time.perf_counter() - started) * 1e3


def summary(samples: list[float]) -> dict[str, float]:
    """Median, 99th percentile (nearest rank) and spread (min, max) of a list of samples."""
    ranked = sorted(samples)
    p99 = ranked[min(len(ranked) - 1, max(0, -(-99 * len(ranked) // 100) - 1))]
    return {
        "median": round(statistics.median(samples), 4),
        "p99": round(p99, 4),
        "min": round(min(samples), 4),
        "max": round(max(samples), 4),
        "n": len(samples),
    }


def paired(
    measure_a: Callable[[int], float], measure_b: Callable[[int], float], warmup: int, repeats: int
) -> dict[str, dict[str, float]]:
    """Runs a then b `warmup + repeats` times (each returns milliseconds for repetition i).

    Returns the summaries of a, b and of the pairwise ratio a / b over the timed repetitions.
    """
    a_ms, b_ms = [], []
    for i in range(warmup + repeats):
        a, b = measure_a(i), measure_b(i)
        if i >= warmup:
            a_ms.append(a)
            b_ms.append(b)
    return {"a_ms": summary(a_ms), "b_ms": summary(b_ms), "ratio": summary([a / b for a, b in zip(a_ms, b_ms)])}
