"""Where the host's time goes in one cached request of a CUDA package's step route (graphs replayed):
each of kvexport.host.step_runner.StepRunner.run's phases timed on its own, in steady state, median of
--repeats, beside the same request through StepRunner.run whole. Then what those phases are made of
on this host: a host-to-device copy from pinned and from pageable memory, a pinned allocation, and
a fresh 2 MB host allocation written once (page faults), each median of --repeats.

The workload is request_bench.py's (kvexport.bench.suite.SweepRequests: every repetition reuses
exactly the cached prefix, so every repetition replays the same bucket's graph).

    python3 benchmarks/gpu/host_phases.py OUT --batch 1,8,32 --json /tmp/host-phases.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import kvexport
from kvexport.artifact import open_artifact
from kvexport.bench.suite import SweepRequests
from kvexport.host.requests import check_batch
from kvexport.ops import wrappers as kv

PHASES = ("check_request", "begin_step", "copy_in", "replay", "logits_out", "end_batch", "device_wait")


def _us(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1e6, 1)


def phases(package, batch_size: int, args) -> dict:
    """StepRunner.run's phases on a bucket already captured, each timed on the host's clock (the
    last, device_wait, is the synchronisation that ends the request)."""
    runner, config = package._loaded.step, package.config
    requests = SweepRequests(
        config,
        args.length,
        batch_size,
        first_user=batch_size * 100_000,
        new_events=args.new_events,
        candidates=args.candidates,
    )
    variants = [check_batch(requests.variant(r), config) for r in range(2 * (args.warmup + args.repeats) + 2)]
    package.run(variants[0])
    package.run(variants[1])  # captures the bucket's graph
    torch.cuda.synchronize()
    samples: dict[str, list[float]] = {p: [] for p in PHASES}
    for i in range(args.warmup + args.repeats):
        batch = variants[i + 2]
        t = [time.perf_counter()]
        user_ids, token_lengths, token_ids, num_candidates, candidate_ids = kv.check_request(
            runner.runtime_name, runner._limits, *batch.tensors()
        )
        t.append(time.perf_counter())
        staged, layout = kv.begin_step(
            runner.runtime_name,
            runner._runtime_config,
            user_ids,
            token_ids,
            token_lengths,
            num_candidates,
            candidate_ids,
            runner._placement,
            runner._max_prefix_length,
        )
        t.append(time.perf_counter())
        bucket = runner._buckets[layout.bucket]
        with torch.cuda.stream(runner._stream):
            bucket.buffer.copy_(staged, non_blocking=True)
            t.append(time.perf_counter())
            bucket.graph.replay()
            t.append(time.perf_counter())
            logits = bucket.logits[: layout.real_candidates].clone()
            t.append(time.perf_counter())
        kv.end_batch(runner.runtime_name, user_ids, logits)
        t.append(time.perf_counter())
        torch.cuda.synchronize()
        t.append(time.perf_counter())
        if i >= args.warmup:
            for name, start, end in zip(PHASES, t, t[1:]):
                samples[name].append(end - start)
    whole = []
    for i in range(args.warmup + args.repeats):
        started = time.perf_counter()
        package.run(variants[args.warmup + args.repeats + 2 + i])
        torch.cuda.synchronize()
        if i >= args.warmup:
            whole.append(time.perf_counter() - started)
    row = {
        "batch_size": batch_size,
        "phases_us": {p: _us(samples[p]) for p in PHASES},
        "sum_of_phases_us": round(sum(_us(samples[p]) for p in PHASES), 1),
        "run_us": _us(whole),
        "staged_bytes": staged.numel() * staged.element_size(),
        "staged_pinned": staged.is_pinned(),
        "bucket": list(layout.bucket),
    }
    print(json.dumps(row), flush=True)
    return row


def primitives(args) -> dict:
    """What the phases are made of on this host, each alone."""
    device = torch.device("cuda")
    out: dict[str, float] = {}

    def median_us(run) -> float:
        samples = []
        for i in range(args.warmup + args.repeats):
            started = time.perf_counter()
            run()
            if i >= args.warmup:
                samples.append(time.perf_counter() - started)
        return _us(samples)

    for kib in (8, 256, 2048):
        n = kib * 128
        target = torch.empty(n, dtype=torch.int64, device=device)
        for kind, source in (
            ("pinned", torch.ones(n, dtype=torch.int64).pin_memory()),
            ("pageable", torch.ones(n, dtype=torch.int64)),
        ):

            def copy(source=source, target=target):
                target.copy_(source, non_blocking=True)
                torch.cuda.synchronize()

            out[f"h2d_{kind}_{kib}KiB_us"] = median_us(copy)
        out[f"pinned_alloc_{kib}KiB_us"] = median_us(lambda n=n: torch.empty(n, dtype=torch.int64, pin_memory=True))
    out["sync_only_us"] = median_us(torch.cuda.synchronize)
    out["fresh_2MiB_written_us"] = median_us(lambda: torch.empty(256 * 1024, dtype=torch.int64).fill_(1))
    print(json.dumps(out), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path, help="a CUDA artifact built with a step program")
    parser.add_argument("--length", type=int, default=4064, help="cached history events per user")
    parser.add_argument("--new-events", type=int, default=32)
    parser.add_argument("--candidates", type=int, default=100)
    parser.add_argument("--batch", default="1,8,32", help="comma-separated batch sizes")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=100)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    artifact = open_artifact(args.artifact)
    with kvexport.load(artifact, step_program=True, cuda_graphs=True) as package:
        if package._loaded.step is None or not package._loaded.step._graphs_on:
            raise SystemExit(f"error: {args.artifact} has no step program on a GPU (build it with --device cuda)")
        rows = [phases(package, int(b), args) for b in args.batch.split(",")]
    result = {
        "artifact": str(args.artifact),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "rows": rows,
        "primitives": primitives(args),
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
