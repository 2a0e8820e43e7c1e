"""Inductor settings for a GPU package, measured side by side against Inductor's defaults.

Exports a config's KV-cached module once and compiles it with AOTInductor once per variant:
Inductor's defaults ("default", as `kvexport build` compiles), and each setting below on top of
them. The packages are loaded into this process and share one cache runtime (they compute the same
k/v). For each batch size, users with --length cached events get --new-events new ones and
--candidates candidates per call (kvexport.bench.suite.SweepRequests: every call reuses exactly the
cached prefix); the packages take turns, call by call, on a warm cache. Reported per batch: each
package's latency (median, p99 of --repeats), default / package taken pair by pair (median, min,
max), the CUDA kernels one call launches and their device time (torch profiler), and the largest
difference of its logits from the default package's for the same request from an empty cache
(reductions compiled differently may round differently in bf16). A setting this torch refuses is
recorded as that variant's error.

Variants: "no_split_reductions" (Inductor may split a reduction into several kernels when the
export example's few rows make that look worthwhile), "combo_kernels" (independent kernels
launched as one).

    python3 benchmarks/gpu/inductor_bench.py configs/hstu-kuairand-1k.yaml --device cuda \
        --json /tmp/inductor-bench.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from kvexport.bench.suite import SweepRequests
from kvexport.bench.timing import summary, timed_ms
from kvexport.config import load_config
from kvexport.export.build import runtime_name_for
from kvexport.export.compile import compile_package
from kvexport.export.wrap import CachedRanker, export_cached
from kvexport.host.program import load_program
from kvexport.model import build_model
from kvexport.ops import library
from kvexport.ops import wrappers as kv

VARIANTS = {"default": {}, "no_split_reductions": {"split_reductions": False}, "combo_kernels": {"combo_kernels": True}}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", type=Path)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", default="1,8,32", help="comma-separated batch sizes")
    parser.add_argument("--length", type=int, help="cached events per user (default: the most the config allows)")
    parser.add_argument("--new-events", type=int, default=32)
    parser.add_argument("--candidates", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help=f"comma-separated, among {', '.join(VARIANTS)} (default: all; default always runs)",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    args.batch = [int(b) for b in args.batch.split(",")]
    args.variants = ["default", *(v for v in args.variants.split(",") if v != "default")]
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant {unknown[0]}; choose among {', '.join(VARIANTS)}")
    return args


def kernels(compiled, tensors, device: torch.device) -> dict:
    """Kernels one call launches and their device time (GPU only)."""
    if device.type != "cuda":
        return {}
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        compiled(*tensors)
        torch.cuda.synchronize()
    launched = [
        e
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset"))
    ]
    return {
        "kernels_per_request": len(launched),
        "device_us_per_request": round(sum(e.device_time_total for e in launched), 1),
    }


def bench_batch(packages: dict, runtime: str, config, args, batch_size: int, device: torch.device) -> dict:
    requests = SweepRequests(
        config,
        args.length,
        batch_size,
        first_user=batch_size * 100_000,
        new_events=args.new_events,
        candidates=args.candidates,
    )
    first = requests.variant(0).tensors()
    logits = {}
    for name, compiled in packages.items():  # the same request from an empty cache
        kv.reset_runtime(runtime)
        logits[name] = compiled(*first).float().cpu()
    row: dict = {"batch_size": batch_size, "max_abs_logit": float(logits["default"].abs().max())}
    times: dict[str, list[float]] = {name: [] for name in packages}
    call = 1
    for i in range(args.warmup + args.repeats):
        for name, compiled in packages.items():
            tensors = requests.variant(call).tensors()
            call += 1
            ms = timed_ms(compiled, *tensors)
            if i >= args.warmup:
                times[name].append(ms)
    for name, compiled in packages.items():
        ratios = [a / b for a, b in zip(times["default"], times[name])]
        row[name] = {
            "ms": summary(times[name]),
            **kernels(compiled, requests.variant(call).tensors(), device),
            "max_abs_diff": float((logits[name] - logits["default"]).abs().max()),
            "default_over_this": {
                "median": round(statistics.median(ratios), 3),
                "min": round(min(ratios), 3),
                "max": round(max(ratios), 3),
            },
        }
        call += 1
    print(json.dumps(row), flush=True)
    return row


def main() -> int:
    args = parse_args()
    config = load_config(args.config)
    if args.length is None:
        args.length = config.model.max_history_length - args.new_events
    device = torch.device(args.device)
    library.load()
    model = build_model(config, None)
    runtime = runtime_name_for(config, model) + "-inductor-bench"
    model = model.to(device)
    program = export_cached(CachedRanker(model, runtime), config)
    del model
    result: dict = {
        "config": config.name,
        "device": str(device),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "variants": {name: VARIANTS[name] for name in args.variants},
        "compile_s": {},
        "rows": [],
    }
    with tempfile.TemporaryDirectory(prefix="kvexport-inductor-") as tmp:
        packages = {}
        for name in args.variants:
            options = VARIANTS[name]
            path = Path(tmp) / f"{name}.pt2"
            started = time.perf_counter()
            try:
                compile_package(program, path, {"kvexport.runtime_config": config.runtime_json()}, dict(options))
                packages[name] = load_program(path, device.index if device.index is not None else -1)
            except Exception as exc:  # noqa: BLE001 — a setting this torch refuses is a result too
                if name == "default":
                    raise
                result.setdefault("errors", {})[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
                print(json.dumps({name: result["errors"][name]}), flush=True)
                continue
            result["compile_s"][name] = round(time.perf_counter() - started, 1)
        del program
        kv.create_runtime(runtime, config.runtime_json(), device)
        try:
            result["rows"] = [bench_batch(packages, runtime, config, args, b, device) for b in args.batch]
        finally:
            kv.drop_runtime(runtime)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
