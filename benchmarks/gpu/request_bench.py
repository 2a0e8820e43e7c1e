"""Request-level benchmark of a built package on its own device (the H200 workload of the CUDA work).

For each batch size: users with --length cached events, --new-events new ones and --candidates
candidates (kvexport.bench.suite.SweepRequests: every repetition has the same shapes and reuses
exactly the cached prefix). Reported per batch size:
- cached: the package call on a warm cache (p50, p99, min, max over --repeats);
- full: the package call on an empty cache (the full recompute; fewer repetitions);
- eager: the eager model's cached path on the same device, through its own runtime;
- kernels_per_request and attention_us_per_request: CUDA kernels launched by one cached package
  call, and the device time of those whose name contains "kvexport" (the attention kernels), from
  the torch profiler (CUDA packages only), with top_kernels: the costliest by name (calls, device
  time); "host": that call's time inside each kvexport op and
  each CUDA runtime call (launches, copies, synchronisations), and --trace-dir its Chrome trace.
Also the package's size and how long kvexport.load took (first load in this process).
Ratios: full / cached (cache benefit) and eager / cached (packaging benefit), medians of each.

--routes: how the package is run, side by side in this process (each loads it anew): "graphs"
(step.pt2 replayed as CUDA graphs, kvexport.load's default for a CUDA package), "step" (step.pt2
run directly) and "model" (model.pt2 runs the whole request, as plain hosts do). Routes other than
"model" need an artifact with a step program. The eager model is timed once, beside the first route.

    python3 benchmarks/gpu/request_bench.py OUT --length 4064 --new-events 32 --candidates 100 \
        --batch 1,8,32 --json /tmp/request-bench.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

import kvexport
from kvexport.artifact import open_artifact
from kvexport.bench.suite import SweepRequests
from kvexport.bench.timing import summary, timed_ms
from kvexport.cached import CachedRanker
from kvexport.errors import UserError
from kvexport.host.loading import package_device
from kvexport.host.requests import check_batch
from kvexport.ops import library
from kvexport.ops import wrappers as kv
from kvexport.ops.manager import KVCacheManager
from kvexport.trace.soak import eager_model_for


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path, nargs="?", help="a built artifact directory (kvexport build -o OUT)")
    parser.add_argument(
        "--length",
        type=int,
        help="cached history events per user (default: the most the config admits beside "
        "--new-events, model.max_history_length - new events: 4064 for hstu-kuairand-1k)",
    )
    parser.add_argument("--new-events", type=int, default=32)
    parser.add_argument("--candidates", type=int, default=100)
    parser.add_argument("--batch", default="1,8,32", help="comma-separated batch sizes")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--full-repeats", type=int, default=5, help="repetitions of the full recompute")
    parser.add_argument("--checkpoint", type=Path, help="the checkpoint the artifact was built from, if any")
    parser.add_argument(
        "--routes",
        help="comma-separated: graphs, step, model (see above; default: every route "
        "the artifact has, graphs on a GPU only)",
    )
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--trace-dir", type=Path, help="write a Chrome trace (host and device) of one cached call per batch size here"
    )
    parser.add_argument("--plot", type=Path, help="write a PNG of the medians per batch size (needs matplotlib)")
    parser.add_argument(
        "--replot", type=Path, metavar="JSON", help="only draw --plot from an earlier run's --json (no artifact needed)"
    )
    args = parser.parse_args()
    if args.replot and not args.plot:
        parser.error("--replot needs --plot")
    if not args.replot and args.artifact is None:
        parser.error("give an artifact directory (or --replot JSON --plot PNG)")
    args.batch = [int(b) for b in args.batch.split(",")]
    args.routes = args.routes.split(",") if args.routes else None
    unknown = [r for r in args.routes or () if r not in ROUTES]
    if unknown:
        parser.error(f"unknown route {unknown[0]} (routes: {', '.join(ROUTES)})")
    return args


# kvexport.load's arguments of each route.
ROUTES = {
    "graphs": {"step_program": True, "cuda_graphs": True},
    "step": {"step_program": True, "cuda_graphs": False},
    "model": {"step_program": False},
}
ROUTE_LABELS = {
    "graphs": "step.pt2 as CUDA graphs",
    "step": "step.pt2 without graphs",
    "model": "model.pt2 (plain hosts)",
}


def times(run, warmup: int, repeats: int) -> list[float]:
    return [ms for i, ms in enumerate(timed_ms(run, i) for i in range(warmup + repeats)) if i >= warmup]


# The ops a request runs, as the profiler names them.
OPS = tuple(
    f"{library.NAMESPACE}::{op}"
    for op in ("check_request", "upload", "begin_step", *library.STATEFUL_OPS, *library.STEP_OPS)
)


TOP_KERNELS = 12  # the costliest kernels by name, in the profile's top_kernels


def cuda_profile(package, batch, trace: Path | None) -> dict:
    """Where one cached call's time goes: the kernels it launches and their device time (kvexport's
    own: the attention kernels), and on the host the time inside each kvexport op and inside each
    CUDA runtime call (launches, copies, synchronisations), from the torch profiler. `trace`: a
    Chrome trace of the call."""
    from torch.profiler import ProfilerActivity, profile

    package.run(batch)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        started = time.perf_counter()
        package.run(batch)
        torch.cuda.synchronize()
        call_us = (time.perf_counter() - started) * 1e6
    if trace is not None:
        prof.export_chrome_trace(str(trace))
    events = prof.events()
    kernels = [
        e
        for e in events
        if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset"))
    ]
    ours = [e for e in kernels if "kvexport" in e.name]
    host = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    api: dict[str, dict] = {}
    for e in host:
        if e.name.startswith(("cuda", "cu")) and not e.name.startswith("cudnn"):
            row = api.setdefault(e.name, {"calls": 0, "us": 0.0})
            row["calls"] += 1
            row["us"] = round(row["us"] + e.cpu_time_total, 1)
    by_name: dict[str, dict] = {}
    for e in kernels:
        row = by_name.setdefault(e.name[:120], {"calls": 0, "us": 0.0})
        row["calls"] += 1
        row["us"] = round(row["us"] + e.device_time_total, 1)
    return {
        "kernels_per_request": len(kernels),
        "top_kernels": dict(sorted(by_name.items(), key=lambda item: -item[1]["us"])[:TOP_KERNELS]),
        "attention_us_per_request": round(sum(e.device_time_total for e in ours), 1),
        "all_kernels_us_per_request": round(sum(e.device_time_total for e in kernels), 1),
        "host": {
            "profiled_call_us": round(call_us, 1),
            "op_us": {op: round(sum(e.cpu_time_total for e in host if e.name == op), 1) for op in OPS},
            "cuda_api": dict(sorted(api.items(), key=lambda item: -item[1]["us"])),
        },
    }


def bench_batch(package, model, eager_runtime: str | None, args, batch_size: int, route: str) -> dict:
    config, device = package.config, package.device
    requests = SweepRequests(
        config,
        args.length,
        batch_size,
        first_user=batch_size * 100_000,
        new_events=args.new_events,
        candidates=args.candidates,
    )
    variants = [check_batch(requests.variant(r), config) for r in range(args.warmup + args.repeats + 2)]
    package.score(variants[0])  # primes the cache: every later variant reuses the cached prefix
    cached = times(lambda i: package.run(variants[i + 1]), args.warmup, args.repeats)

    def full(i: int) -> None:
        kv.reset_runtime(package.runtime_name)
        package.run(variants[i + 1])

    full_ms = times(full, 1, args.full_repeats)
    row = {
        "route": route,
        "batch_size": batch_size,
        "cached_events": args.length,
        "new_events": args.new_events,
        "candidates": args.candidates,
        "cached_ms": summary(cached),
        "full_ms": summary(full_ms),
    }
    row["cache_speedup"] = round(row["full_ms"]["median"] / row["cached_ms"]["median"], 2)
    if eager_runtime is not None:
        with torch.no_grad():
            kv.reset_runtime(eager_runtime)
            cached = CachedRanker(model, eager_runtime)
            cached.run(variants[0])
            eager = times(lambda i: cached.run(variants[i + 1]), args.warmup, args.repeats)
        row["eager_cached_ms"] = summary(eager)
        row["package_speedup_vs_eager"] = round(row["eager_cached_ms"]["median"] / row["cached_ms"]["median"], 2)
    if device.type == "cuda":
        trace = args.trace_dir / f"request-{route}-b{batch_size}.trace.json" if args.trace_dir else None
        row.update(cuda_profile(package, variants[-1], trace))
    print(json.dumps(row), flush=True)
    return row


def plot(result: dict, path: Path) -> None:
    """Package call (cached and full recompute), the eager cached path, and the device time of the
    cached call's kernels, per batch size: the gap between the call and its kernels is host time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_route: dict[str, list[dict]] = {}
    for row in result["rows"]:
        by_route.setdefault(row.get("route", "model"), []).append(row)  # runs before routes: model.pt2
    rows = next(iter(by_route.values()))  # the first route's, timed beside the eager model
    batches = [r["batch_size"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(batches, [r["full_ms"]["median"] for r in rows], "o-", label="package, full recompute (empty cache)")
    ax.plot(batches, [r["eager_cached_ms"]["median"] for r in rows], "^-", label="eager model, cached")
    for (route, route_rows), marker in zip(by_route.items(), "sDv"):
        ax.plot(
            batches,
            [r["cached_ms"]["median"] for r in route_rows],
            f"{marker}-",
            label=f"package, cached: {ROUTE_LABELS[route]}",
        )
    if "all_kernels_us_per_request" in rows[0]:
        ax.plot(
            batches,
            [r["all_kernels_us_per_request"] / 1000 for r in rows],
            "s--",
            label="package, cached: its kernels' device time",
        )
        ax.plot(batches, [r["attention_us_per_request"] / 1000 for r in rows], "x:", label="of which attention kernels")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_xlabel("users per request (batch)")
    ax.set_ylabel("ms per request (median)")
    first = rows[0]
    ax.set_title(
        f"{result.get('gpu') or result['device']}: {first['cached_events']} cached + {first['new_events']} new "
        f"events, {first['candidates']} candidates",
        fontsize=10,
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    args = parse_args()
    if args.replot:
        plot(json.loads(args.replot.read_text()), args.plot)
        return 0
    if args.trace_dir:
        args.trace_dir.mkdir(parents=True, exist_ok=True)
    artifact = open_artifact(args.artifact)
    limit = artifact.config.model.max_history_length
    if args.length is None:
        args.length = limit - args.new_events
    if args.length + args.new_events > limit:
        print(f"error: --length + --new-events exceed model.max_history_length ({limit})", file=sys.stderr)
        return 2
    device = package_device(artifact)
    if args.routes is None:
        args.routes = (
            (["graphs"] if device.type == "cuda" else []) + ["step", "model"] if artifact.step_package else ["model"]
        )
    if artifact.step_package is None and args.routes != ["model"]:
        print(
            f"error: {args.artifact} has no step program (build it with --step-program); use --routes model",
            file=sys.stderr,
        )
        return 2
    rows, load_s = [], {}
    model = eager_model_for(artifact, args.checkpoint).to(device)
    eager = KVCacheManager(artifact.config, runtime_name=f"{artifact.config.name}@request-bench", device=device)
    try:
        for i, route in enumerate(args.routes):
            started = time.perf_counter()
            with kvexport.load(artifact, **ROUTES[route]) as package:
                load_s[route] = round(time.perf_counter() - started, 2)
                rows += [
                    bench_batch(package, model, eager.name if i == 0 else None, args, b, route) for b in args.batch
                ]
    finally:
        eager.close()
    result = {
        "artifact": str(args.artifact),
        "device": str(device),
        "torch": torch.__version__,
        "load_s": load_s,
        "package_bytes": artifact.package.stat().st_size,
        "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None,
        "rows": rows,
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    if args.plot:
        plot(result, args.plot)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
