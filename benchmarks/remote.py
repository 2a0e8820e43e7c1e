"""The remote KV tier on CPU: a returning user served from the remote tier vs recomputed, bytes moved
and throughput, and the write-behind cost on the request path (benchmarks/RESULTS.md, *Remote tier*).

    .venv/bin/python benchmarks/remote.py --json /tmp/remote-2core.json
    .venv/bin/python benchmarks/remote.py --artifact OUT      # an hstu-bench-shaped artifact built already

Builds configs/hstu-bench.yaml into a temporary directory unless --artifact is given, and starts a
redis-server of its own on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from pathlib import Path

from kvexport.artifact import open_artifact
from kvexport.bench import remote
from kvexport.bench.suite import machine
from kvexport.errors import UserError
from kvexport.export.build import build_artifact

ROOT = Path(__file__).resolve().parent.parent
log = logging.getLogger("benchmarks.remote")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifact", type=Path, help="a built artifact (default: build configs/hstu-bench.yaml)")
    parser.add_argument("--lengths", default="1024,4096", help="cached history events, comma-separated")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, help="write the results here")
    return parser.parse_args()


def run(artifact_dir: Path, lengths: list[int], warmup: int, repeats: int) -> dict:
    artifact = open_artifact(artifact_dir)
    with remote.local_redis() as url:
        hits = remote.hit_vs_recompute(artifact, url, lengths, warmup, repeats)
        writes = remote.write_behind_cost(artifact, url, lengths, warmup, repeats)
    return {
        "config": artifact.config.name,
        "machine": machine(),
        "settings": {
            "lengths": lengths,
            "warmup": warmup,
            "repeats": repeats,
            "remote_read_budget_us": artifact.config.kv_cache.remote_read_budget_us,
        },
        "remote_hit_vs_recompute": hits,
        "write_behind": writes,
    }


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s", force=True)
    args = parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    try:
        with tempfile.TemporaryDirectory(prefix="kvexport-remote-bench-") as tmp:
            artifact = args.artifact or build_artifact(ROOT / "configs" / "hstu-bench.yaml", Path(tmp) / "hstu-bench")
            results = run(artifact, lengths, args.warmup, args.repeats)
    except UserError as exc:
        log.error("error: %s", exc)
        return exc.exit_code
    for row in results["remote_hit_vs_recompute"]:
        log.info(
            "L=%d: remote hit x%.1f faster than recompute (%.1f vs %.1f ms), %.1f MB read at %.2f GB/s",
            row["cached_events"],
            row["remote_speedup"]["median"],
            row["remote_hit_ms"]["median"],
            row["recompute_ms"]["median"],
            row["entry_bytes"] / 1e6,
            row["read_gb_per_s"],
        )
    for row in results["write_behind"]:
        log.info(
            "L=%d: device hit with on_evict x%.3f, after_batch x%.3f of no remote tier",
            row["cached_events"],
            row["on_evict_over_no_remote"]["median"],
            row["after_batch_over_no_remote"]["median"],
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
