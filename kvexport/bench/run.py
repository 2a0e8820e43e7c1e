"""Runs every benchmark of `kvexport bench` and writes the JSON (headline figures at the top) and plot."""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

from kvexport.artifact import open_artifact
from kvexport.bench import contention, kernel, suite
from kvexport.errors import UserError
from kvexport.host.package import Package
from kvexport.native.build import build_native
from kvexport.native.paths import OPS_LIBRARY
from kvexport.options import BenchOptions
from kvexport.trace.soak import eager_model_for

log = logging.getLogger(__name__)
# Packaging removes per-request overhead; past a few hundred events both paths spend their time
# in the same attention op, so the comparison is made on the shorter histories of the sweep.
EAGER_MAX_LENGTH = 256
CHEAP_REPEATS = 25
PORTABLE_FMV = f"{kernel.PORTABLE_ISA}+fmv"  # the portable build with its multiversioned kernel loop


def run_benchmarks(target: Path, options: BenchOptions, checkpoint: Path | None = None) -> dict:
    """target: a config (built here, cold and warm) or a built artifact directory (no build timing)."""
    lengths, warmup, repeats = list(options.lengths), options.warmup, options.repeats
    with tempfile.TemporaryDirectory(prefix="kvexport-bench-") as tmp:
        workdir = Path(tmp)
        if target.is_dir():
            build, artifact_dir = None, target
        elif target.is_file():
            if checkpoint is not None:
                raise UserError("--checkpoint applies to a built artifact; build with it first")
            build, artifact_dir = suite.build_cost(target, workdir)
        else:
            raise UserError(f"{target} is neither a config file nor an artifact directory")
        artifact = open_artifact(artifact_dir)
        config = artifact.config
        too_long = [n for n in lengths if n + suite.NEW_EVENTS > config.model.max_history_length]
        if too_long:
            raise UserError(
                f"--lengths {too_long[0]} + {suite.NEW_EVENTS} new events exceed "
                f"model.max_history_length ({config.model.max_history_length})"
            )
        runner = Package(artifact)
        model = eager_model_for(artifact, checkpoint).to(runner.device)
        on_cpu = runner.device.type == "cpu"
        batch_sizes = sorted({1, config.serving.max_batch_size})
        cache_rows = suite.cache_benefit(runner, lengths, batch_sizes, warmup, repeats)
        eager_lengths = [n for n in lengths if n <= EAGER_MAX_LENGTH] or lengths[:1]
        # Requests of a millisecond or two: more repetitions cost little and steady the medians.
        eager_rows = suite.package_vs_eager(
            runner, model, eager_lengths, batch_sizes, warmup + 2, max(repeats, CHEAP_REPEATS)
        )
        cpp = suite.cpp_vs_python(runner, max(repeats, 3), workdir)
        memory = suite.cache_memory(runner)
        # CPU contention and the CPU kernel's builds are about CPU packages.
        contended = contention.contention(runner, max(lengths), warmup, repeats) if on_cpu else None
    kernel_rows = (
        kernel.kernel_builds(kernel_libraries(), kernel.KernelShape.of(config, max(lengths)), warmup, repeats)
        if on_cpu
        else None
    )
    headline_cache = next(r for r in cache_rows if r["batch_size"] == 1 and r["cached_events"] == max(lengths))
    headline_eager = next(r for r in eager_rows if r["batch_size"] == 1 and r["cached_events"] == eager_lengths[0])
    return {
        "cache_speedup": headline_cache["speedup"]["median"],
        "package_speedup_vs_eager": headline_eager["speedup"]["median"],
        "cpp_over_python_latency": cpp["ratio"]["median"],
        "build_seconds_cold": build["seconds_cold"] if build else None,
        "build_seconds_warm": build["seconds_warm"] if build else None,
        "bytes_per_cached_token": memory["bytes_per_cached_token"],
        "contention_cached_slowdown": contended["other_sessions"]["cached_slowdown"]["median"] if contended else None,
        "contention_full_slowdown": contended["other_sessions"]["full_slowdown"]["median"] if contended else None,
        "portable_kernel_over_native": (
            kernel_rows["builds"][PORTABLE_FMV]["over_native"]["median"] if kernel_rows else None
        ),
        "portable_kernel_no_fmv_over_native": (
            kernel_rows["builds"][kernel.PORTABLE_ISA]["over_native"]["median"] if kernel_rows else None
        ),
        "config": config.name,
        "device": str(runner.device),
        "machine": suite.machine(),
        "settings": {
            "warmup": warmup,
            "repeats": repeats,
            "lengths": lengths,
            "new_events": suite.NEW_EVENTS,
            "candidates": suite.CANDIDATES,
        },
        "cache_benefit": cache_rows,
        "package_vs_eager": eager_rows,
        "cpp_vs_python": cpp,
        "build": build,
        "cache_memory": memory,
        "contention": contended,
        "kernel_builds": kernel_rows,
    }


def kernel_libraries() -> dict[str, Path]:
    """The op library builds whose kernels are compared: this host's (native), the portable
    baseline with the x86-64-v4 clone (what a portable deployment would ship) and without it.
    Portable builds live in their own build directories; the first bench builds them."""
    return {
        "native": OPS_LIBRARY,
        PORTABLE_FMV: build_native(("kvexport_ops",), isa=kernel.PORTABLE_ISA, multiversion=True),
        kernel.PORTABLE_ISA: build_native(("kvexport_ops",), isa=kernel.PORTABLE_ISA, multiversion=False),
    }


def plot(results: dict, path: Path) -> None:
    """Latency vs cached events, cached path and full recompute, per batch size (log axes)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for batch_size in sorted({r["batch_size"] for r in results["cache_benefit"]}):
        rows = [r for r in results["cache_benefit"] if r["batch_size"] == batch_size]
        lengths = [r["cached_events"] for r in rows]
        ax.plot(lengths, [r["full_ms"]["median"] for r in rows], "o-", label=f"full recompute, batch {batch_size}")
        ax.plot(
            lengths,
            [r["cached_ms"]["median"] for r in rows],
            "s--",
            label=f"cached ({suite.NEW_EVENTS} new events), batch {batch_size}",
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("cached history events L")
    ax.set_ylabel("package latency per request (ms, median)")
    ax.set_title(f"{results['config']}: KV-cached vs full recompute ({suite.CANDIDATES} candidates)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
