"""The measurements of `kvexport bench` (docs/design.md §4 targets), each a function returning JSON rows."""

from __future__ import annotations

import json
import logging
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from kvexport.bench.timing import paired, timed_ms
from kvexport.cached import CachedRanker
from kvexport.config import Config
from kvexport.errors import UserError
from kvexport.host.package import Package
from kvexport.host.requests import check_batch
from kvexport.model import Batch
from kvexport.model.batch import UserRequest, random_context
from kvexport.model.hstu import DTYPES, HSTURanker
from kvexport.ops import wrappers as kv
from kvexport.ops.manager import KVCacheManager
from kvexport.trace.record import load_trace_step
from kvexport.trace.replay import replay_command

log = logging.getLogger(__name__)
NEW_EVENTS = 16
CANDIDATES = 64
PASSES_PER_SAMPLE = 3


def _run_quietly(command: list[str], env: dict[str, str] | None = None) -> None:
    """Runs a kvexport step; its failure becomes the step's own last error line."""
    result = subprocess.run(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if result.returncode != 0:
        lines = [line for line in result.stderr.strip().splitlines() if line.startswith("error:")]
        reason = lines[-1] if lines else (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise UserError(f"{Path(command[0]).name} {' '.join(command[1:3])} failed (exit {result.returncode}): {reason}")


def machine() -> dict:
    """Where the numbers were taken: CPU, cores, versions, and what the op library was built for."""
    from kvexport.native.isa import library_isa

    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "op_library_march": library_isa()["march"],
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def _cpu_model() -> str:
    """The CPU's model name as Linux reports it."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "")


class SweepRequests:
    """Users with L cached events plus `new_events` new ones and `candidates` candidates.

    Variant r changes only the item ids of the last `new_events` events, so after variant r-1 is
    cached, variant r reuses exactly the first C + 2L tokens and computes the new events:
    identical shapes and work for every repetition, without re-priming the cache.
    """

    def __init__(
        self,
        config: Config,
        cached_events: int,
        batch_size: int,
        first_user: int,
        new_events: int = NEW_EVENTS,
        candidates: int = CANDIDATES,
    ):
        m = config.model
        g = torch.Generator().manual_seed(cached_events * 31 + batch_size)
        n = cached_events + new_events
        self.vocab, self.new_events = m.item_vocab_size, new_events
        self.users = [
            UserRequest(
                first_user + b,
                torch.randint(0, m.item_vocab_size, (n,), generator=g),
                torch.randint(0, m.action_vocab_size, (n,), generator=g),
                random_context(m, g),
                torch.randint(0, m.item_vocab_size, (candidates,), generator=g),
            )
            for b in range(batch_size)
        ]

    def variant(self, r: int) -> Batch:
        users = []
        for u in self.users:
            items = u.item_ids.clone()
            items[-self.new_events :] = (items[-self.new_events :] + r) % self.vocab
            users.append(UserRequest(u.user_id, items, u.action_ids, u.context_ids, u.candidate_ids))
        return Batch.concat(users)


def cache_benefit(runner: Package, lengths: list[int], batch_sizes: list[int], warmup: int, repeats: int) -> list[dict]:
    """Package latency: cached path (NEW_EVENTS new) vs full recompute (empty cache), same shapes."""
    return [
        _cache_benefit_row(runner, length, batch_size, warmup, repeats)
        for batch_size in batch_sizes
        for length in lengths
    ]


def _cache_benefit_row(runner: Package, length: int, batch_size: int, warmup: int, repeats: int) -> dict:
    requests = SweepRequests(runner.config, length, batch_size, first_user=0)

    def full(r: int) -> float:
        kv.reset_runtime(runner.artifact.runtime_name)
        return timed_ms(runner.run, check_batch(requests.variant(2 * r), runner.config))

    def cached(r: int) -> float:
        return timed_ms(runner.run, check_batch(requests.variant(2 * r + 1), runner.config))

    result = paired(full, cached, warmup, repeats)
    log.info(
        "cache benefit L=%d B=%d: full %.1f ms, cached %.2f ms, x%.1f",
        length,
        batch_size,
        result["a_ms"]["median"],
        result["b_ms"]["median"],
        result["ratio"]["median"],
    )
    return {
        "cached_events": length,
        "new_events": NEW_EVENTS,
        "candidates": CANDIDATES,
        "batch_size": batch_size,
        "full_ms": result["a_ms"],
        "cached_ms": result["b_ms"],
        "speedup": result["ratio"],
    }


def package_vs_eager(
    runner: Package, model: HSTURanker, lengths: list[int], batch_sizes: list[int], warmup: int, repeats: int
) -> list[dict]:
    """Cached request through the package vs the eager model's cached path (each its own runtime)."""
    eager = KVCacheManager(runner.config, runtime_name=f"{runner.config.name}@bench-eager", device=runner.device)
    try:
        return [
            _package_vs_eager_row(runner, model, eager, batch_size, cached_events, warmup, repeats)
            for batch_size in batch_sizes
            for cached_events in lengths
        ]
    finally:
        eager.close()


def _package_vs_eager_row(
    runner: Package,
    model: HSTURanker,
    eager: KVCacheManager,
    batch_size: int,
    cached_events: int,
    warmup: int,
    repeats: int,
) -> dict:
    requests = SweepRequests(runner.config, cached_events, batch_size, first_user=10_000)
    eager.reset()
    kv.reset_runtime(runner.artifact.runtime_name)
    cached = CachedRanker(model, eager.name)
    with torch.no_grad():
        cached.run(requests.variant(0))
    runner.score(requests.variant(0))

    def eager_ms(r: int) -> float:
        with torch.no_grad():
            return timed_ms(cached.run, requests.variant(r + 1))

    def package_ms(r: int) -> float:
        return timed_ms(runner.run, check_batch(requests.variant(r + 1), runner.config))

    result = paired(eager_ms, package_ms, warmup, repeats)
    log.info(
        "package vs eager L=%d B=%d: eager %.2f ms, package %.2f ms, x%.2f",
        cached_events,
        batch_size,
        result["a_ms"]["median"],
        result["b_ms"]["median"],
        result["ratio"]["median"],
    )
    return {
        "batch_size": batch_size,
        "cached_events": cached_events,
        "new_events": NEW_EVENTS,
        "eager_ms": result["a_ms"],
        "package_ms": result["b_ms"],
        "speedup": result["ratio"],
    }


def cpp_vs_python(runner: Package, repeats: int, workdir: Path) -> dict:
    """Per-request latency over the trace: C++ harness vs the Python runner, pass by pass.

    Each repetition replays the whole trace PASSES_PER_SAMPLE times in Python and in the harness
    (each pass from an empty cache, on validated inputs) and sums the per-step medians; the ratio
    C++ / Python is taken per repetition.
    """
    artifact = runner.artifact
    timed = [i for i, s in enumerate(artifact.trace_steps) if "expect_error" not in s]
    batches = {
        i: check_batch(load_trace_step(artifact.root / artifact.trace_steps[i]["file"])[0], runner.config)
        for i in timed
    }
    report_path = workdir / "replay.json"

    def python_pass(_: int) -> float:
        step_ms: dict[int, list[float]] = {i: [] for i in timed}
        for _ in range(PASSES_PER_SAMPLE):
            kv.reset_runtime(artifact.runtime_name)
            for i in timed:
                step_ms[i].append(timed_ms(runner.run, batches[i]))
        return sum(statistics.median(ms) for ms in step_ms.values())

    def cpp_pass(_: int) -> float:
        command = replay_command(artifact.root, report_path, repeat=PASSES_PER_SAMPLE)
        _run_quietly(command)
        steps = json.loads(report_path.read_text())["steps"]
        return sum(steps[i]["latency_p50_ms"] for i in timed)

    result = paired(cpp_pass, python_pass, warmup=1, repeats=repeats)
    log.info(
        "C++ vs Python: %.2f ms vs %.2f ms per trace, ratio %.3f (median of pairs)",
        result["a_ms"]["median"],
        result["b_ms"]["median"],
        result["ratio"]["median"],
    )
    return {
        "steps": len(timed),
        "repeats": repeats,
        "cpp_ms_per_trace": result["a_ms"],
        "python_ms_per_trace": result["b_ms"],
        "ratio": result["ratio"],
    }


def build_cost(config_path: Path, workdir: Path) -> tuple[dict, Path]:
    """`kvexport build` twice in subprocesses: with an empty compile cache (cold), then warm."""
    cache = workdir / "inductor-cache"
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache))
    kvexport = [sys.executable, "-m", "kvexport"]
    result = {}
    for kind in ("cold", "warm"):
        out = workdir / f"build-{kind}"
        started = time.perf_counter()
        _run_quietly([*kvexport, "build", str(config_path), "-o", str(out)], env=env)
        result[f"seconds_{kind}"] = round(time.perf_counter() - started, 2)
        result[f"stages_{kind}"] = json.loads((out / "manifest.json").read_text())["timings_seconds"]
        log.info("build (%s compile cache): %.1f s", kind, result[f"seconds_{kind}"])
    result["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, 1)
    result["package_bytes"] = (workdir / "build-warm" / "model.pt2").stat().st_size
    shutil.rmtree(workdir / "build-cold")
    return result, workdir / "build-warm"


def cache_memory(runner: Package) -> dict:
    """Bytes per cached token and per user; tier occupancy after replaying the trace once."""
    c = runner.config
    m, kc = c.model, c.kv_cache
    element = torch.empty((), dtype=DTYPES[m.dtype]).element_size()
    per_token = m.num_layers * 2 * m.num_heads * m.head_dim * element
    kv.reset_runtime(runner.artifact.runtime_name)
    for step in runner.artifact.trace_steps:
        if "expect_error" not in step:
            runner.score(load_trace_step(runner.artifact.root / step["file"])[0])
    stats = runner.stats()
    max_user_pages = kc.pages_for(m.max_prefix_length)
    return {
        "bytes_per_cached_token": per_token,
        "bytes_per_page": per_token * kc.page_size,
        "bytes_per_user_at_max_history": max_user_pages * kc.page_size * per_token,
        "bytes_per_user_after_trace": (
            stats["device_pages_used"] * kc.page_size * per_token // max(1, stats["device_users"])
        ),
        "device_tier_bytes": kc.device_pages * kc.page_size * per_token,
        "device_occupancy": round(stats["device_pages_used"] / kc.device_pages, 4),
        "host_occupancy": round(stats["host_pages_used"] / kc.host_pages, 4) if kc.host_pages else 0.0,
        "counters_after_trace": stats,
    }
