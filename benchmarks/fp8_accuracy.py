"""FP8 KV pages (docs/design.md §2.7) side by side with the model's own dtype, in one run: accuracy
against a float32 reference, the scale granularities' rounding error, device-tier users at the same
memory, the CPU attention kernel at L = 4096 and remote bytes per user.

    .venv/bin/python benchmarks/fp8_accuracy.py [--users 24] [--events 256 1024] [--out report.json]
    .venv/bin/python benchmarks/fp8_accuracy.py --parts attention_cpu_L4096  # the kernel alone

kuairand-1k's shape (configs/hstu-kuairand-1k.yaml) with random weights (seed 0) on the CPU, with
fewer users and shorter histories than its 4,096 events (the full recompute is what costs here).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from kvexport.bench.remote import RedisServer
from kvexport.config import FP8_PAGES, load_config
from kvexport.model import Batch, build_model
from kvexport.ops import library
from kvexport.ops import wrappers as kv
from kvexport.trace.ranking import roc_auc
from kvexport.trace.workload import Workload, WorkloadSpec

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "hstu-kuairand-1k.yaml"
TOP_K = 10


def configs(own_dtype: str):
    """kuairand-1k on the CPU in `own_dtype`: (unrounded, FP8 pages)."""
    base = load_config(CONFIG)
    model = dataclasses.replace(base.model, dtype=own_dtype)
    serving = dataclasses.replace(base.serving, device="cpu")
    own = dataclasses.replace(
        base, model=model, serving=serving, kv_cache=dataclasses.replace(base.kv_cache, dtype=own_dtype)
    )
    return own, dataclasses.replace(own, kv_cache=dataclasses.replace(own.kv_cache, dtype=FP8_PAGES))


def accuracy(args) -> dict:
    """Logits of each variant against the float32 unrounded model, user by user (full recompute,
    which equals the cached path by the invariant)."""
    own32, fp8_32 = configs("float32")
    reference = build_model(own32, seed=0).eval()
    variants = {
        "bfloat16": build_model(configs("bfloat16")[0], seed=0),
        "bfloat16 + FP8 pages": build_model(configs("bfloat16")[1], seed=0),
        "float32 + FP8 pages": build_model(fp8_32, seed=0),
    }
    spec = WorkloadSpec(
        num_users=args.users,
        min_history_length=args.events[0],
        max_history_length=args.events[1],
        max_new_events=1,
        num_candidates=own32.model.max_num_candidates,
        rewrite_fraction=0.0,
    )
    workload = Workload(own32.model, spec, seed=1)
    logits = {name: [] for name in ["float32", *variants]}
    for user_id in range(args.users):
        batch = Batch.concat([workload.request(workload.new_user(user_id), own32.model.max_num_candidates)])
        with torch.no_grad():
            logits["float32"].append(reference(batch).double())
            for name, model in variants.items():
                logits[name].append(model(batch).double())
    g = torch.Generator().manual_seed(2)
    reference_logits = torch.stack(logits["float32"])  # [users, T, tasks]
    standardised = (reference_logits - reference_logits.mean()) / reference_logits.std()
    labels = torch.rand(standardised.shape, generator=g, dtype=torch.float64) < torch.sigmoid(3 * standardised)
    table = {}
    for name in variants:
        got = torch.stack(logits[name])
        relative = (got - reference_logits).abs() / reference_logits.abs().amax(dim=(1, 2), keepdim=True)
        top = reference_logits.topk(TOP_K, dim=1).indices  # [users, K, tasks]
        kept = (got.topk(TOP_K, dim=1).indices == top).all(dim=1)  # [users, tasks]
        table[name] = {
            "logits_relative_error_max": float(relative.max()),
            "logits_relative_error_median": float(relative.median()),
            "top10_order_kept": float(kept.double().mean()),
            "roc_auc": [roc_auc(got[..., t].flatten(), labels[..., t].flatten()) for t in range(got.shape[-1])],
        }
    table["float32"] = {
        "roc_auc": [
            roc_auc(reference_logits[..., t].flatten(), labels[..., t].flatten())
            for t in range(reference_logits.shape[-1])
        ]
    }
    return table


def granularities(args) -> dict:
    """Relative RMS error of rounding the model's prefix k/v to e4m3 with scales per (row, head) as a
    power of two (kvexport's), per (row, head) exact, per (page of 32 rows, head) as a power of two,
    and per (layer, head) fixed from the same data's max (a calibrated static scale)."""
    config = configs("float32")[0]
    model = build_model(config, seed=0).eval()
    captured = []
    model.round_kv = lambda t: (captured.append(t.detach().clone()), t)[1]
    workload = Workload(
        config.model,
        WorkloadSpec(
            num_users=2,
            min_history_length=args.events[1],
            max_history_length=args.events[1],
            max_new_events=1,
            num_candidates=8,
            rewrite_fraction=0.0,
        ),
        seed=3,
    )
    with torch.no_grad():
        model(Batch.concat([workload.request(workload.new_user(0), 8)]))

    def e4m3(x, scale):
        return (x / scale).to(torch.float8_e4m3fn).float() * scale

    def pow2(amax):
        return torch.pow(2.0, torch.ceil(torch.log2(amax.clamp_min(1e-30) / 448)))

    errors = {"row_head_pow2": [], "row_head_exact": [], "page_head_pow2": [], "layer_head_static": []}
    for x in captured:  # [N, H, dh]
        n = x.shape[0] // 32 * 32
        x = x[:n]
        amax = x.abs().amax(-1, keepdim=True)
        page_amax = x.view(-1, 32, *x.shape[1:]).abs().amax(dim=(1, 3), keepdim=True)
        static = x.abs().amax(dim=(0, 2), keepdim=True) / 448
        rounded = {
            "row_head_pow2": e4m3(x, pow2(amax)),
            "row_head_exact": e4m3(x, amax.clamp_min(1e-30) / 448),
            "page_head_pow2": e4m3(x.view(-1, 32, *x.shape[1:]), pow2(page_amax)).view_as(x),
            "layer_head_static": e4m3(x, static),
        }
        for name, r in rounded.items():
            errors[name].append(float(((r - x).pow(2).mean() / x.pow(2).mean()).sqrt()))
    return {name: max(values) for name, values in errors.items()}


def capacity() -> dict:
    """Bytes a page takes and users of kuairand-1k at full history a device tier of the same bytes holds."""
    config = configs("bfloat16")[0]
    m, c = config.model, config.kv_cache
    pages_per_user = c.pages_for(m.max_prefix_length)
    bf16_page = 2 * c.page_size * m.num_heads * m.head_dim * 2
    fp8_page = 2 * c.page_size * m.num_heads * (m.head_dim + 1)  # e4m3 bytes and a scale byte per row and head
    memory = c.device_pages * bf16_page * m.num_layers
    users = {
        name: memory // (pages_per_user * page * m.num_layers)
        for name, page in (("bfloat16", bf16_page), ("fp8", fp8_page))
    }
    return {
        "device_tier_bytes": memory,
        "page_bytes": {"bfloat16": bf16_page, "fp8": fp8_page},
        "users_at_full_history": users,
        "ratio": users["fp8"] / users["bfloat16"],
    }


def attention_time(thread_counts: tuple[int, ...] = (1, 2), repeats: int = 30) -> list[dict]:
    """The CPU kernel on one user of 4,096 cached keys (16 new events, 64 candidates), kuairand's
    heads, bf16 pages against FP8 pages holding the same values: median microseconds per call at
    each thread count. The two alternate call by call, so that a load that comes and goes on a
    shared machine falls on both alike."""
    g = torch.Generator().manual_seed(0)
    heads, head_dim, page_size, keys, candidates, new = 4, 128, 32, 4096, 64, 32
    rows = new + candidates
    pages = (keys + rows) // page_size + 1
    values = torch.randn(pages, 2, page_size, heads, head_dim, generator=g)
    row_keys = torch.tensor([keys + i + 1 for i in range(new)] + [keys + new] * candidates)
    metadata = (
        torch.randperm(pages, generator=g).view(1, pages),
        torch.zeros(rows, dtype=torch.int64),
        row_keys,
        torch.arange(rows) >= new,
    )
    q, k, v = (torch.randn(rows, heads, head_dim, generator=g).bfloat16() for _ in range(3))
    caches = {"bfloat16": values.bfloat16(), "fp8": _fp8_pages_of(values)}
    before = torch.get_num_threads()
    results = []
    try:
        for threads in thread_counts:
            torch.set_num_threads(threads)
            samples = {name: [] for name in caches}
            for repeat in range(repeats + 3):  # the first 3 warm up
                for name, cache in caches.items():
                    start = time.perf_counter()
                    kv.hstu_paged_attention(q, k, v, cache, *metadata, 0.088, 1 / 8192)
                    if repeat >= 3:
                        samples[name].append((time.perf_counter() - start) * 1e6)
            times = {name: statistics.median(taken) for name, taken in samples.items()}
            results.append({"threads": threads, "us": times, "fp8_over_bf16": times["fp8"] / times["bfloat16"]})
    finally:
        torch.set_num_threads(before)
    return results


def _fp8_pages_of(values: torch.Tensor) -> torch.Tensor:
    """FP8 byte pages [P, page_bytes] holding `values` [P, 2, ps, H, dh] as the runtime stores them
    (runtime/fp8_pages.h's encoding and layout)."""
    num_pages, _, page_size, heads, head_dim = values.shape
    rows = values.reshape(-1, heads, head_dim)
    amax = rows.abs().amax(-1)
    mantissa, exponent = torch.frexp(amax)
    exponent = torch.where(mantissa <= 0.875, exponent - 9, exponent - 8)
    data = (rows / torch.pow(2.0, exponent.float()).unsqueeze(-1)).to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.cat([data.reshape(num_pages, -1), (exponent + 127).to(torch.uint8).reshape(num_pages, -1)], dim=1)


def remote_bytes(events: int) -> dict:
    """Bytes one user's remote entry takes, bf16 pages against FP8 pages (a redis-server of its own)."""
    result = {}
    with tempfile.TemporaryDirectory() as directory:
        server = RedisServer(Path(directory)).start()
        try:
            for name, extra in (("bfloat16", {}), ("fp8", {"kv_dtype": FP8_PAGES})):
                result[name] = _remote_entry_bytes(server.url, events, extra, f"fp8-bench-remote-{name}")
        finally:
            server.stop()
    result["ratio"] = result["fp8"] / result["bfloat16"]
    result["tokens"] = 6 + 2 * events
    return result


def _remote_entry_bytes(url: str, events: int, extra: dict, name: str) -> int:
    tokens = 6 + 2 * events
    config = json.dumps(
        {
            "num_layers": 3,
            "num_heads": 4,
            "head_dim": 128,
            "page_size": 32,
            "device_pages": tokens // 32 + 2,
            "host_pages": 0,
            "dtype": "bfloat16",
            **extra,
        }
    )
    kv.create_runtime(name, config)
    try:
        kv.attach_remote(name, url, "on_evict")
        ids = torch.arange(tokens)
        kv.begin_batch(name, config, torch.tensor([1]), ids, torch.tensor([tokens]), torch.tensor([1]), torch.empty(0))
        g = torch.Generator().manual_seed(0)
        for layer in range(3):
            rows = torch.randn(tokens + 1, 4, 128, generator=g).bfloat16()
            kv.paged_attention(name, layer, rows, rows, rows, 0.088, 1 / 8192)
        kv.end_batch(name, torch.tensor([1]), rows)
        kv.evict_user(name, 1)
        kv.flush_remote(name, 10_000)
        return kv.runtime_stats(name)["remote_bytes_out"]
    finally:
        kv.drop_runtime(name)


# The report's parts, each a function of the parsed arguments.
PARTS = {
    "accuracy_vs_float32": accuracy,
    "granularity_relative_rms": granularities,
    "capacity": lambda args: capacity(),
    "attention_cpu_L4096": lambda args: attention_time(),
    "remote_bytes_per_user": lambda args: remote_bytes(args.remote_events),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=24)
    parser.add_argument("--events", type=int, nargs=2, default=(256, 1024), metavar=("MIN", "MAX"))
    parser.add_argument("--remote-events", type=int, default=512)
    parser.add_argument("--parts", nargs="+", choices=list(PARTS), default=list(PARTS), help="the parts to run")
    parser.add_argument(
        "--op-library", type=Path, help="an op library other than the installed one (another commit's build)"
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.op_library:
        library.load(args.op_library)
    started = time.perf_counter()
    report = {
        "workload": {
            "config": "configs/hstu-kuairand-1k.yaml (device cpu), random weights seed 0",
            "users": args.users,
            "history_events": list(args.events),
            "candidates": 100,
        },
        **{name: PARTS[name](args) for name in args.parts},
    }
    report["seconds"] = time.perf_counter() - started
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
