"""kvexport's CUDA attention against torch's own fused attention kernels on the same bytes, side by
side in one process (the H200 workload of docs/design.md: 164 query rows per user, 100 candidates
and 64 new prefix rows, against 8,262 cached keys, 4 heads x 128, bf16, one layer).

- ours: kvexport::hstu_paged_attention's kernels on the paged cache (benchmarks/gpu/attention_bench.py's
  request: each user's pages scattered over a shuffled pool);
- each scaled_dot_product_attention backend torch has here (FlashAttention-2, cuDNN, memory-efficient)
  on contiguous q [B, H, 164, 128] and k, v [B, H, 8262, 128]: softmax attention without a mask, the
  least work any of them can do on these bytes.
Device time per call from the CUDA profiler's kernel records, median of --repeats after --warmup,
rotating over --layers sets of inputs (as many as the cache bench) so that no backend reads from L2.
Bandwidth fraction: the cached k/v bytes (each key and value once per user and head) over the time,
against this GPU's copy bandwidth measured in the same process (attention_bench.device_peaks).

    python3 benchmarks/gpu/peers.py --batch 1,8,32 --json /tmp/peers.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention_bench import Request, add_shape_arguments, device_peaks, kernel_times  # noqa: E402

BACKENDS = ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_arguments(parser)
    parser.add_argument("--json", type=Path)
    return parser.parse_args()


def sdpa_ms(request: Request, backend: str, args: argparse.Namespace) -> float | None:
    """Device ms of one backend's call on contiguous copies of the request's bytes; None where this
    torch or GPU has no such backend for the shape."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows = args.candidates + 2 * args.new_events
    g = torch.Generator(device="cuda").manual_seed(args.seed)
    shape = (request.batch, args.heads, request.keys, args.head_dim)
    q = torch.randn(request.batch, args.heads, rows, args.head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
    kvs = [
        (
            torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g),
            torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g),
        )
        for _ in range(args.layers)
    ]

    def call(layer: int) -> torch.Tensor:
        with sdpa_kernel(getattr(SDPBackend, backend)):
            return torch.nn.functional.scaled_dot_product_attention(q, *kvs[layer])

    try:
        call(0)
    except RuntimeError:
        return None
    return kernel_times(call, args.layers, args.warmup, args.repeats, name="")[0]


def off_alignment(t: torch.Tensor) -> torch.Tensor:
    """The same values with rows 4-byte but not 16-byte aligned: the Hopper kernel declines them."""
    rows = t.shape[0]
    wide = torch.empty(rows, t[0].numel() + 2, dtype=t.dtype, device=t.device)
    wide[:, 2:] = t.reshape(rows, -1)
    return wide[:, 2:].unflatten(1, t.shape[1:])


def fallback_ms(request: Request, args: argparse.Namespace) -> float:
    """Device ms of our sm80 (mma.sync) kernel on the same cache bytes, its q/k/v rows moved off
    16-byte alignment so that the dispatcher passes the Hopper kernel by (on other GPUs the same
    kernel as ours)."""
    q, k, v = (off_alignment(t) for t in (request.q, request.k, request.v))

    def call(layer: int) -> torch.Tensor:
        return torch.ops.kvexport.hstu_paged_attention(
            q,
            k,
            v,
            request.caches[layer],
            request.page_table,
            request.row_user,
            request.row_keys,
            request.row_candidate,
            request.alpha,
            request.inv_scaling,
        )

    return kernel_times(call, args.layers, args.warmup, args.repeats)[0]


def bench(args: argparse.Namespace, batch: int, peaks: dict) -> dict:
    request = Request(args, batch)
    ours_ms, _ = kernel_times(request.kernel, args.layers, args.warmup, args.repeats)
    sm80_ms = fallback_ms(request, args)
    kv_bytes = batch * request.keys * args.heads * args.head_dim * 2 * 2
    flops = 4 * int(request.row_keys.sum()) * args.heads * args.head_dim  # QK^T and PV, 2 FLOPs a MAC
    row = {
        "batch": batch,
        "keys_per_user": request.keys,
        "kv_bytes": kv_bytes,
        "flops": flops,
        "ours_us": round(ours_ms * 1e3, 1),
        "ours_bandwidth_fraction": round(kv_bytes / (ours_ms / 1e3) / peaks["bytes_per_s"], 3),
        "ours_tflops": round(flops / (ours_ms / 1e3) / 1e12, 1),
        "ours_matmul_fraction": round(flops / (ours_ms / 1e3) / peaks["flops"], 3),
        "ours_sm80_kernel_us": round(sm80_ms * 1e3, 1),
    }
    for backend in BACKENDS:
        ms = sdpa_ms(request, backend, args)
        row[f"{backend.lower()}_us"] = None if ms is None else round(ms * 1e3, 1)
    peers = [row[f"{b.lower()}_us"] for b in BACKENDS if row[f"{b.lower()}_us"] is not None]
    row["best_peer_us"] = min(peers) if peers else None
    row["speedup_vs_best_peer"] = round(min(peers) / row["ours_us"], 2) if peers else None
    del request
    torch.cuda.empty_cache()
    return row


def main() -> int:
    args = parse_args()
    if not torch.cuda.is_available():
        print("error: peers.py needs a CUDA device", file=sys.stderr)
        return 2
    from kvexport.ops import library

    library.load()
    peaks = device_peaks()
    rows = [bench(args, int(b), peaks) for b in args.batch.split(",")]
    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version(),
        "peaks": peaks,
        "rows": rows,
    }
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    for row in rows:
        peers = ", ".join(f"{b.lower().removesuffix('_attention')} {row[f'{b.lower()}_us']}" for b in BACKENDS)
        print(
            f"batch {row['batch']:3d}: ours {row['ours_us']} us ({row['ours_bandwidth_fraction']:.0%} of the bandwidth "
            f"bound, {row['ours_tflops']} TFLOP/s = {row['ours_matmul_fraction']:.0%} of the matmul peak); "
            f"sm80 kernel {row['ours_sm80_kernel_us']} us; "
            f"{peers} us; best peer / ours {row['speedup_vs_best_peer']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
