"""Slowdown of the cached request and of the full recompute on a busy CPU host, at several history
lengths (`kvexport bench` measures only its longest): hstu-bench, batch 1, a busy process per CPU
in a session of its own (as unrelated programs run), idle and contended samples taken in turn.

    .venv/bin/python benchmarks/contention.py artifacts/hstu-bench --lengths 1024,4064 \\
        --json /tmp/results-2core-contention-lengths.json
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
from pathlib import Path

import torch

from kvexport.artifact import open_artifact
from kvexport.bench.contention import available_cpus, slowdowns
from kvexport.host.package import Package


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--lengths", default="1024,4064", help="cached events per user, comma-separated")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--json", type=Path, help="where to write the rows")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    runner = Package(open_artifact(args.artifact))
    rows = [
        slowdowns(runner, int(length), args.warmup, args.repeats, available_cpus(), own_sessions=True)
        for length in args.lengths.split(",")
    ]
    runner.close()
    if args.json:
        machine = {
            "platform": platform.platform(),
            "cpus": available_cpus(),
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
        }
        args.json.write_text(json.dumps({"machine": machine, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
