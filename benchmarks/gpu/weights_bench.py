"""Weights inside the package's shared library (AOTInductor's default) or beside it on disk.

Compiles a config's KV-cached module with AOTInductor twice: as kvexport builds it (constants linked
into the .so) and with the constants written to a separate binary blob in the package
(`aot_inductor.package_constants_on_disk_format = "binary_blob"`, which torch maps at load time).
With --package, the first is the model.pt2 of an artifact `kvexport build` made from the same config
without a checkpoint (its compile seconds from that build's manifest), and only the binary blob is
compiled here: a GPU check that has just built the config saves a compile of its 1 GB table.
Without it both compiles run in this process, one after the other: the second reuses kernels the
first compiled, so compare their compile times with that in mind. For each: compile seconds,
package bytes, load seconds (as kvexport.load loads: torch's loader without aoti_load_package's
host probe) and the first call's seconds (each load in a fresh process, the file just written so
in the page cache), and whether the two packages' logits are bitwise equal on the same request.

    python3 benchmarks/gpu/weights_bench.py configs/hstu-kuairand-1k.yaml --device cuda \
        [--package ARTIFACT] --json /tmp/weights-bench.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import torch

from kvexport.artifact import open_artifact
from kvexport.config import load_config
from kvexport.errors import UserError
from kvexport.export.build import runtime_name_for
from kvexport.export.compile import compile_package
from kvexport.export.wrap import CachedRanker, export_cached
from kvexport.model import build_model
from kvexport.ops import library

VARIANTS = {
    "in_so": {},
    "binary_blob": {"aot_inductor.package_constants_on_disk_format": "binary_blob"},
}

# Run in a fresh interpreter per variant: load the package, time it and one request, save the logits.
LOAD_AND_RUN = """
import json, sys, time, torch
from kvexport.bench.suite import SweepRequests
from kvexport.config import load_config
from kvexport.host.program import load_program
from kvexport.ops import library, wrappers as kv
config_path, package, device, runtime, logits_path = sys.argv[1:]
config = load_config(config_path)
library.load()
device = torch.device(device)
started = time.perf_counter()
compiled = load_program(package, device.index if device.index is not None else -1)
load_s = time.perf_counter() - started
kv.create_runtime(runtime, compiled.get_metadata()["kvexport.runtime_config"], device)
batch = SweepRequests(config, 256, 2, first_user=0, new_events=8, candidates=16).variant(0)
started = time.perf_counter()
logits = compiled(*batch.tensors())
if device.type == "cuda":
    torch.cuda.synchronize()
first_call_s = time.perf_counter() - started
torch.save(logits.cpu(), logits_path)
print(json.dumps({"load_s": round(load_s, 3), "first_call_s": round(first_call_s, 3)}))
"""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", type=Path)
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--package",
        type=Path,
        metavar="ARTIFACT",
        help="an artifact built from CONFIG without a checkpoint: its model.pt2 is the in_so variant",
    )
    parser.add_argument("--json", type=Path)
    return parser.parse_args()


def largest_members(package: Path, count: int = 3) -> dict[str, int]:
    """Where the package's bytes are: its largest files, uncompressed."""
    with zipfile.ZipFile(package) as archive:
        members = sorted(archive.infolist(), key=lambda m: m.file_size, reverse=True)[:count]
    return {m.filename.rsplit("/", 1)[-1].split(".", 1)[-1]: m.file_size for m in members}


def built_variant(root: Path, config, device: str) -> dict:
    """The in_so variant as `kvexport build` made it: its model.pt2, its runtime's name and its compile
    seconds. The artifact must hold the same seeded weights this script exports, or the logits differ."""
    built = open_artifact(root)
    if built.config.to_dict() != config.to_dict():
        raise UserError(f"{root} was built from another config than {config.name}'s")
    if built.manifest.weights.get("source") != "seed":
        raise UserError(f"{root} was built with a checkpoint; this script compares the seeded weights")
    if torch.device(built.device).type != torch.device(device).type:
        raise UserError(f"{root} was built for {built.device}, not {device}")
    return {
        "package": built.package,
        "runtime": built.runtime_name,
        "compile_s": built.manifest.timings_seconds["compile"],
        "compiled_by": "kvexport build",
    }


def main() -> int:
    args = parse_args()
    config = load_config(args.config)
    try:
        prebuilt = {"in_so": built_variant(args.package, config, args.device)} if args.package else {}
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    library.load()
    model = build_model(config, None)
    runtime = runtime_name_for(config, model) + "-weights-bench"
    model = model.to(args.device)
    started = time.perf_counter()
    program = export_cached(CachedRanker(model, runtime), config)
    result = {
        "config": config.name,
        "device": args.device,
        "torch": torch.__version__,
        "export_s": round(time.perf_counter() - started, 1),
        "variants": {},
    }
    del model
    logits = {}
    with tempfile.TemporaryDirectory(prefix="kvexport-weights-") as tmp:
        for name, options in VARIANTS.items():
            if name in prebuilt:
                package, package_runtime = prebuilt[name]["package"], prebuilt[name]["runtime"]
                row = {key: prebuilt[name][key] for key in ("compile_s", "compiled_by")}
            else:
                package, package_runtime = Path(tmp) / f"{name}.pt2", runtime
                started = time.perf_counter()
                try:
                    compile_package(program, package, {"kvexport.runtime_config": config.runtime_json()}, options)
                except Exception as exc:  # noqa: BLE001 — an option this torch lacks is a result too
                    result["variants"][name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
                    print(json.dumps({name: result["variants"][name]}), flush=True)
                    continue
                row = {"compile_s": round(time.perf_counter() - started, 1), "compiled_by": "this script"}
            row.update(package_bytes=package.stat().st_size, largest_members=largest_members(package))
            logits_path = Path(tmp) / f"{name}.logits"
            done = subprocess.run(
                [
                    sys.executable,
                    "-c",
                    LOAD_AND_RUN,
                    str(args.config),
                    str(package),
                    args.device,
                    package_runtime,
                    str(logits_path),
                ],
                capture_output=True,
                text=True,
                check=False,
            )
            if done.returncode != 0:
                row["error"] = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
            else:
                row.update(json.loads(done.stdout.strip().splitlines()[-1]))
                logits[name] = torch.load(logits_path, weights_only=True)
            result["variants"][name] = row
            print(json.dumps({name: row}), flush=True)
    if len(logits) == len(VARIANTS):
        result["logits_bitwise_equal"] = bool(torch.equal(logits["in_so"], logits["binary_blob"]))
    print(json.dumps({k: v for k, v in result.items() if k != "variants"}))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0 if len(logits) == len(VARIANTS) and result["logits_bitwise_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
