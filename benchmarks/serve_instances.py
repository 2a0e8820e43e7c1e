"""Serving with K cache shards (`kvexport triton-repo --instances K`: K shard models, each one instance
in its own process with its own cache runtime, behind the router that sends each user's requests to
one shard): what a returning user finds in the cache; --no-routing: K instances of one model, Triton
handing each request to whichever is free (as before the router).

For K = 1, 2, 4 one plain tritonserver on the repository, driven by 16 clients (serve.py's workload:
each client one request at a time, its own 4 users returning with 4 more events each visit, so a
user's requests never overlap in time and reach the server in the order they were sent) for the
same time: throughput, p50 / p99, and from kvexport's counters, summed over the instances (each
labels its own samples): the cache hit ratio (prefix tokens read
from a cache over all prefix tokens of the requests), and the prefix truncations (requests whose
history does not extend what their instance had cached: the workload's histories start over after
the longest, at any K). This workload cannot send two requests of one user at once, so it says
nothing of concurrent requests of a user (tests/test_triton_repo.py holds those on one shard).

    .venv/bin/python benchmarks/serve_instances.py artifacts/hstu-bench --json /tmp/serve-instances.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import tempfile
import time
from pathlib import Path

from serve import Served, drive

from kvexport.artifact import open_artifact

CLIENTS = 16


METRICS_TIMEOUT_S = 30


def cache_counters(served: Served) -> dict[str, float]:
    """kvexport's cache counters, summed over the instances; the metrics port may open a moment after
    Triton reports ready."""
    deadline = time.monotonic() + METRICS_TIMEOUT_S
    while True:
        try:
            return {
                name: served.metric(f"kvexport_cache_{name}_total")
                for name in ("hit_tokens", "recomputed_tokens", "prefix_truncations", "lookups")
            }
        except (OSError, LookupError):  # not published yet
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--instances", default="1,2,4", help="comma-separated instance counts")
    parser.add_argument("--seconds", type=float, default=20.0, help="driving time per instance count")
    parser.add_argument(
        "--no-routing",
        dest="routing",
        action="store_false",
        help="K instances of one model, no router (Triton hands a request to any instance)",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    artifact = open_artifact(args.artifact)
    config = artifact.config
    results = {
        "model": config.name,
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "clients": CLIENTS,
        "seconds": args.seconds,
        "routing": args.routing,
        "load_before": [round(x, 2) for x in os.getloadavg()],
        "rows": [],
    }
    with tempfile.TemporaryDirectory(prefix="kvexport-serve-instances-") as work:
        for instances in (int(k) for k in args.instances.split(",")):
            served = Served(args.artifact, "repository", True, Path(work), instances, args.routing)
            try:
                before = cache_counters(served)
                row = drive(served, config.name, config, CLIENTS, args.seconds)
                after = cache_counters(served)
            finally:
                with contextlib.suppress(Exception):
                    served.stop()
            delta = {name: after[name] - before[name] for name in after}
            prefix_tokens = delta["hit_tokens"] + delta["recomputed_tokens"]
            row.update(
                instances=instances,
                hit_ratio=round(delta["hit_tokens"] / max(prefix_tokens, 1), 3),
                recomputed_tokens_per_request=round(delta["recomputed_tokens"] / max(row["requests"], 1), 1),
                prefix_truncations=int(delta["prefix_truncations"]),
                lookups=int(delta["lookups"]),
            )
            results["rows"].append(row)
            print(
                f"K = {instances}: {row['throughput_rps']:7.1f} req/s, p50 {row['p50_ms']:6.2f} ms, "
                f"p99 {row['p99_ms']:6.2f} ms, hit ratio {row['hit_ratio']:.3f}, recomputed tokens per request "
                f"{row['recomputed_tokens_per_request']}, prefix truncations "
                f"{row['prefix_truncations']} of {row['lookups']} lookups, mean batch {row['mean_batch']}",
                flush=True,
            )
    results["load_after"] = [round(x, 2) for x in os.getloadavg()]
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
