"""Reading a large hash-keyed table as NVIDIA's trainer dumps it: time and peak memory.

Writes a table of `--rows` keys of `--dim` float32 values (about 1 GB by default) as dynamicemb
dumps of `--world` ranks into a temporary directory, then reads it with
kvexport.importers.nvidia.read_dynamic_table in a fresh process and reports its wall time and peak
resident memory against the table's size: a reader that held the dump and the sorted table at once
would peak at twice the table.

    .venv/bin/python benchmarks/import_table.py --json benchmarks/import-table.json
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

CHUNK = 1 << 18


def write_dump(directory: Path, rows: int, dim: int, world: int) -> None:
    """Keys 0..rows-1 scattered by a fixed permutation, rank r holding key % world == r, in chunks."""
    keys = torch.randperm(rows, generator=torch.Generator().manual_seed(0)) * 7919 % (1 << 40)
    for rank in range(world):
        mine = keys[keys % world == rank]
        suffix = f"rank_{rank}.world_size_{world}"
        (directory / f"table_emb_keys.{suffix}").write_bytes(bytes(mine.numpy()))
        with (directory / f"table_emb_values.{suffix}").open("wb") as out:
            for first in range(0, len(mine), CHUNK):
                count = min(CHUNK, len(mine) - first)
                out.write(bytes(torch.randn(count, dim).numpy()))


def read_in_this_process(directory: Path, dim: int) -> dict:
    from kvexport.importers.nvidia import read_dynamic_table

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.perf_counter()
    table = read_dynamic_table(directory, "table", dim)
    seconds = time.perf_counter() - started
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"rows": table.keys.numel(), "seconds": round(seconds, 2), "peak_rss_mib": round(peak_kib / 1024, 1),
            "rss_before_mib": round(before / 1024, 1),
            "table_mib": round(table.values.numel() * 4 / 2**20, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1 << 21)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--read", type=Path, help=argparse.SUPPRESS)  # the fresh process's part
    args = parser.parse_args()
    if args.read:
        print(json.dumps(read_in_this_process(args.read, args.dim)))
        return
    with tempfile.TemporaryDirectory(prefix="kvexport-import-bench-") as work:
        write_dump(Path(work), args.rows, args.dim, args.world)
        reader = subprocess.run([sys.executable, __file__, "--read", work, "--dim", str(args.dim)], check=True,
                                capture_output=True, text=True)
    result = {**json.loads(reader.stdout), "world": args.world, "dim": args.dim,
              "machine": f"{platform.machine()}, {torch.get_num_threads()} threads", "torch": torch.__version__}
    result["peak_over_table"] = round((result["peak_rss_mib"] - result["rss_before_mib"]) / result["table_mib"], 2)
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
