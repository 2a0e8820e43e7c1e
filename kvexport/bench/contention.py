"""Latency under CPU contention: the cached path and the full recompute on a host that is not idle.

A serving host runs other work. This benchmark starts CPU-bound busy processes (one per CPU this
process may use, so with torch's intra-op threads the CPUs are oversubscribed about twice) and
measures how much each path slows down, repetition by repetition: idle, then contended, on the
same shapes. Twice: with the busy processes in sessions of their own, as other programs run (Linux
then shares the CPUs between sessions first: autogroup, as cgroups do between services), and in
this process's session (the CPUs shared thread by thread).
"""

from __future__ import annotations

import contextlib
import logging
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator

import torch

from kvexport.bench.suite import CANDIDATES, NEW_EVENTS, SweepRequests
from kvexport.bench.timing import summary, timed_ms
from kvexport.host.package import Package
from kvexport.host.requests import check_batch
from kvexport.ops import wrappers as kv

log = logging.getLogger(__name__)
# A busy loop that also ends when the bench does, however it ends (its parent changes).
BUSY_LOOP = "import os\nparent = os.getppid()\nwhile os.getppid() == parent:\n    pass\n"
SETTLE_SECONDS = 0.2  # for the busy processes to start spinning before a measurement
CACHED_PER_SAMPLE = 5  # cached requests are short: a sample is the median of a few


def available_cpus() -> int:
    """CPUs this process may run on (its affinity, which a container may restrict)."""
    return len(os.sched_getaffinity(0))


@contextlib.contextmanager
def busy_processes(count: int, own_sessions: bool = True) -> Iterator[list[subprocess.Popen]]:
    """`count` CPU-bound processes for the duration of the block, killed on exit from it.

    own_sessions: each in a session of its own, as an unrelated program would run; else in this
    process's session.
    """
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", BUSY_LOOP],
            start_new_session=own_sessions,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for _ in range(count)
    ]
    try:
        time.sleep(SETTLE_SECONDS)
        yield processes
    finally:
        for process in processes:
            process.kill()
        for process in processes:
            process.wait()


def _sample(runner: Package, requests: SweepRequests, variant: int) -> tuple[float, float]:
    """(full recompute ms, cached ms): one request from an empty cache, then cached ones."""
    kv.reset_runtime(runner.artifact.runtime_name)
    batch = check_batch(requests.variant(variant), runner.config)
    full = timed_ms(runner.run, batch)
    cached = []
    for i in range(1, CACHED_PER_SAMPLE + 1):
        batch = check_batch(requests.variant(variant + i), runner.config)
        cached.append(timed_ms(runner.run, batch))
    return full, statistics.median(cached)


def contention(runner: Package, length: int, warmup: int, repeats: int, busy: int | None = None) -> dict:
    """Slowdowns with busy processes in their own sessions ("other_sessions", the headline) and in
    this one ("same_session"); `busy` defaults to one per available CPU."""
    busy = available_cpus() if busy is None else busy
    return {
        "other_sessions": slowdowns(runner, length, warmup, repeats, busy, own_sessions=True),
        "same_session": slowdowns(runner, length, warmup, repeats, busy, own_sessions=False),
    }


def slowdowns(runner: Package, length: int, warmup: int, repeats: int, busy: int, own_sessions: bool) -> dict:
    """Slowdown (contended / idle, per repetition) of the cached path and of the full recompute at
    L = length, batch 1, with `busy` busy processes."""
    requests = SweepRequests(runner.config, length, 1, first_user=20_000)
    samples = []
    variant = 0
    for i in range(warmup + repeats):
        idle = _sample(runner, requests, variant)
        with busy_processes(busy, own_sessions):
            contended = _sample(runner, requests, variant + CACHED_PER_SAMPLE + 1)
        variant += 2 * (CACHED_PER_SAMPLE + 1)
        if i >= warmup:
            samples.append((idle, contended))
    row = {
        "cached_events": length,
        "new_events": NEW_EVENTS,
        "candidates": CANDIDATES,
        "batch_size": 1,
        "busy_processes": busy,
        "busy_in_own_sessions": own_sessions,
        "cpus": available_cpus(),
        "torch_threads": torch.get_num_threads(),
        "full_idle_ms": summary([s[0][0] for s in samples]),
        "full_contended_ms": summary([s[1][0] for s in samples]),
        "cached_idle_ms": summary([s[0][1] for s in samples]),
        "cached_contended_ms": summary([s[1][1] for s in samples]),
        "full_slowdown": summary([s[1][0] / s[0][0] for s in samples]),
        "cached_slowdown": summary([s[1][1] / s[0][1] for s in samples]),
    }
    log.info(
        "contention L=%d, %d busy processes (%s) on %d CPUs: full recompute x%.2f (%.0f -> %.0f ms), "
        "cached x%.2f (%.1f -> %.1f ms)",
        length,
        busy,
        "own sessions" if own_sessions else "this session",
        row["cpus"],
        row["full_slowdown"]["median"],
        row["full_idle_ms"]["median"],
        row["full_contended_ms"]["median"],
        row["cached_slowdown"]["median"],
        row["cached_idle_ms"]["median"],
        row["cached_contended_ms"]["median"],
    )
    return row
