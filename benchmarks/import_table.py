"""Reading a large hash-keyed table as NVIDIA's trainer dumps it: time and peak memory.

Writes a table of `--rows` keys of `--dim` float32 values (about 1 GB by default) as dynamicemb
dumps of `--world` ranks into a temporary directory, then reads it with
kvexport.importers.nvidia.read_dynamic_table in a fresh process and reports its wall time and peak
resident memory against the table's size: a reader that held the dump and the sorted table at once
would peak at twice the table. Then the whole `kvexport import-checkpoint --from nvidia` of a
one-layer ranker (hidden size `--dim`) whose item table is that table, in a fresh process: its
time and peak memory over a process that only imported torch and kvexport's CLI.

`--format dcp`: the same table in float16 as Meta's trainer saves it (torch.distributed.checkpoint,
one process, so one chunk), read whole with kvexport.importers.dcp.read_tensors in a fresh process,
then a random `--select` share of its rows (default 1%) with kvexport.importers.dcp.read_rows in
another: what a deployment that serves some of a trainer's items reads.

    .venv/bin/python benchmarks/import_table.py --json /tmp/import-table.json
    .venv/bin/python benchmarks/import_table.py --format dcp --rows 4194304 --json /tmp/import-dcp.json
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


COLLECTION = "model._embedding_collection._model_parallel_embedding_collection"


def write_ranker(save: Path, table_dumps: Path, dim: int, world: int) -> Path:
    """A recsys-examples save directory (iter1, `world` ranks) of a one-layer ranker whose item
    table is the dumped table; returns its gin file."""
    g = torch.Generator().manual_seed(1)
    state = {
        "_hstu_block._attention_layers.0._linear_uvqk_weight": torch.randn(dim, 4 * dim, generator=g),
        "_hstu_block._attention_layers.0._linear_uvqk_bias": torch.zeros(4 * dim),
        "_hstu_block._preprocessor._positional_encoder._position_embeddings_weight": torch.randn(64, dim, generator=g),
        "_mlp._mlp.0.weight": torch.randn(dim, dim, generator=g),
        "_mlp._mlp.0.bias": torch.zeros(dim),
        "_mlp._mlp.2.weight": torch.randn(2, dim, generator=g),
        "_mlp._mlp.2.bias": torch.zeros(2),
        "_embedding_collection._data_parallel_embedding_collection.embeddings.action_weights_weights": torch.randn(
            4 * dim, generator=g
        ),
    }
    for name in ("_input_layernorm", "_output_layernorm"):
        state[f"_hstu_block._attention_layers.0.{name}_weight"] = torch.ones(dim)
        state[f"_hstu_block._attention_layers.0.{name}_bias"] = torch.zeros(dim)
    state["_hstu_block._attention_layers.0._linear_proj_weight"] = torch.randn(dim, dim, generator=g)
    root = save / "iter1"
    (root / "torch_module").mkdir(parents=True)
    for rank in range(world):
        torch.save({"model_state_dict": state, "optimizer_state_dict": {}}, root / "torch_module" / f"model.{rank}.pth")
    (root / "dynamicemb_module").mkdir()
    (root / "dynamicemb_module" / COLLECTION).symlink_to(table_dumps)
    gin = save / "ranking.gin"
    gin.write_text(
        "\n".join(
            [
                "DatasetArgs.max_history_seqlen = 16",
                "DatasetArgs.max_num_candidates = 4",
                "NetworkArgs.num_layers = 1",
                "NetworkArgs.num_attention_heads = 2",
                f"NetworkArgs.hidden_size = {dim}",
                f"NetworkArgs.kv_channels = {dim // 2}",
                "NetworkArgs.num_position_buckets = 64",
                "NetworkArgs.dtype_str = 'float32'",
                f"RankingArgs.prediction_head_arch = [{dim}, 2]",
                "RankingArgs.num_tasks = 2",
            ]
        )
        + "\n"
    )
    return gin


def import_whole(work: Path, dim: int, world: int) -> dict:
    """`kvexport import-checkpoint` of write_ranker's checkpoint in a fresh process: seconds and peak RSS."""
    save = work / "save"
    gin = write_ranker(save, work / "dumps", dim, world)
    baseline_kib = _peak_kib("import kvexport.commands.cli")
    arguments = [
        "import-checkpoint",
        "--from",
        "nvidia",
        str(save),
        "--trainer-config",
        str(gin),
        "--table-rows",
        "action_weights=4",
        "--item-table",
        "table",
        "-o",
        str(work / "model.pt"),
    ]
    started = time.perf_counter()
    peak_kib = _peak_kib(f"from kvexport.commands.cli import main; main({arguments!r}, standalone_mode=False)")
    seconds = time.perf_counter() - started
    return {
        "import_seconds": round(seconds, 2),
        "import_peak_rss_mib": round(peak_kib / 1024, 1),
        "import_baseline_rss_mib": round(baseline_kib / 1024, 1),
        "checkpoint_mib": round((work / "model.pt").stat().st_size / 2**20, 1),
    }


def _peak_kib(code: str) -> int:
    """Peak resident memory (KiB) of a fresh Python process that imports torch, then runs `code`."""
    script = f"import resource, torch\n{code}\nprint(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"
    result = subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True)
    return int(result.stdout.split()[-1])


DCP_KEY = "sparse_dict._embedding_collection.embeddings.table.weight"


def write_dcp(directory: Path, rows: int, dim: int) -> None:
    import torch.distributed.checkpoint as dcp

    table = torch.empty(rows, dim, dtype=torch.float16)
    for first in range(0, rows, CHUNK):
        table[first : first + CHUNK] = torch.randn(min(CHUNK, rows - first), dim).half()
    dcp.save({DCP_KEY: table}, checkpoint_id=str(directory))


def read_dcp_in_this_process(directory: Path) -> dict:
    from kvexport.importers.dcp import read_tensors

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.perf_counter()
    table = read_tensors(directory, [DCP_KEY])[DCP_KEY]
    seconds = time.perf_counter() - started
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "rows": table.shape[0],
        "seconds": round(seconds, 2),
        "peak_rss_mib": round(peak_kib / 1024, 1),
        "rss_before_mib": round(before / 1024, 1),
        "table_mib": round(table.numel() * 2 / 2**20, 1),
    }


def read_dcp_rows_in_this_process(directory: Path, rows: int, share: float) -> dict:
    from kvexport.importers.dcp import read_rows

    wanted = torch.randperm(rows, generator=torch.Generator().manual_seed(2))[: int(rows * share)]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.perf_counter()
    selected = read_rows(directory, DCP_KEY, wanted)
    seconds = time.perf_counter() - started
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "selected_rows": selected.shape[0],
        "select_seconds": round(seconds, 2),
        "select_peak_rss_mib": round(peak_kib / 1024, 1),
        "select_rss_before_mib": round(before / 1024, 1),
        "selected_mib": round(selected.numel() * 2 / 2**20, 1),
    }


def read_in_this_process(directory: Path, dim: int) -> dict:
    from kvexport.importers.nvidia import read_dynamic_table

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.perf_counter()
    table = read_dynamic_table(directory, "table", dim)
    seconds = time.perf_counter() - started
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "rows": table.keys.numel(),
        "seconds": round(seconds, 2),
        "peak_rss_mib": round(peak_kib / 1024, 1),
        "rss_before_mib": round(before / 1024, 1),
        "table_mib": round(table.values.numel() * 4 / 2**20, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1 << 21)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--format", choices=["dynamicemb", "dcp"], default="dynamicemb")
    parser.add_argument("--select", type=float, default=0.01, help="--format dcp: the share of rows read by id")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--read-rows", type=Path, help=argparse.SUPPRESS)  # the second fresh process's part
    parser.add_argument("--read", type=Path, help=argparse.SUPPRESS)  # the fresh process's part
    parser.add_argument("--write", type=Path, help=argparse.SUPPRESS)  # writes a DCP table in a process of its own
    args = parser.parse_args()
    if args.read_rows:
        print(json.dumps(read_dcp_rows_in_this_process(args.read_rows, args.rows, args.select)))
        return
    if args.read:
        print(
            json.dumps(
                read_dcp_in_this_process(args.read)
                if args.format == "dcp"
                else read_in_this_process(args.read, args.dim)
            )
        )
        return
    if args.write:
        write_dcp(args.write, args.rows, args.dim)
        return
    if args.format == "dcp":
        with tempfile.TemporaryDirectory(prefix="kvexport-import-bench-") as work:
            # Written in a process of its own: a child's peak RSS counts what its parent held when it forked.
            subprocess.run(
                [sys.executable, __file__, "--write", work, "--rows", str(args.rows), "--dim", str(args.dim)],
                check=True,
                capture_output=True,
            )
            reader = subprocess.run(
                [sys.executable, __file__, "--read", work, "--format", "dcp"],
                check=True,
                capture_output=True,
                text=True,
            )
            selector = subprocess.run(
                [sys.executable, __file__, "--read-rows", work, "--rows", str(args.rows), "--select", str(args.select)],
                check=True,
                capture_output=True,
                text=True,
            )
        result = {
            **json.loads(reader.stdout),
            **json.loads(selector.stdout),
            "dim": args.dim,
            "format": "dcp",
            "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
            "torch": torch.__version__,
        }
        result["peak_over_table"] = round((result["peak_rss_mib"] - result["rss_before_mib"]) / result["table_mib"], 2)
        result["select_peak_over_table"] = round(
            (result["select_peak_rss_mib"] - result["select_rss_before_mib"]) / result["table_mib"], 3
        )
        print(json.dumps(result, indent=2))
        if args.json:
            args.json.write_text(json.dumps(result, indent=2) + "\n")
        return
    with tempfile.TemporaryDirectory(prefix="kvexport-import-bench-") as work:
        dumps = Path(work) / "dumps"
        dumps.mkdir()
        write_dump(dumps, args.rows, args.dim, args.world)
        reader = subprocess.run(
            [sys.executable, __file__, "--read", str(dumps), "--dim", str(args.dim)],
            check=True,
            capture_output=True,
            text=True,
        )
        whole = import_whole(Path(work), args.dim, args.world)
    result = {
        **json.loads(reader.stdout),
        **whole,
        "world": args.world,
        "dim": args.dim,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
        "torch": torch.__version__,
    }
    result["peak_over_table"] = round((result["peak_rss_mib"] - result["rss_before_mib"]) / result["table_mib"], 2)
    result["import_peak_over_table"] = round(
        (result["import_peak_rss_mib"] - result["import_baseline_rss_mib"]) / result["table_mib"], 2
    )
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
