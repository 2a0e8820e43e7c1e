"""Times the CUDA kernel of kvexport::hstu_paged_attention on the reference shape (bf16).

Per user: 2 * history + 6 cached prefix tokens, 2 * new_events new prefix rows (already in the cache
when attention runs; row i reads the keys up to its own position) and `candidates` candidate rows
(every cached key plus their own). Rows are laid out [candidates of all users][new prefix rows of all
users]; each user's pages are scattered over a shuffled pool; one cache per layer, layers in turn.

Times (median of --repeats calls after --warmup):
- kernel_ms: the kernels' own device time (the attention kernel plus, with a split over keys, the
  combine kernel), read from the CUDA profiler's kernel records. The pure op reads the row metadata
  on the host (a synchronising copy) to build its tiles, so CUDA events around a call would also
  time that host work; the runtime path builds the tiles once per request instead.
- op_ms: CUDA events around the whole op call, host work included.
- torch_naive_ms: CUDA events around a plain PyTorch version (gather each user's pages into
  contiguous k/v, bf16 matmul, SiLU, bf16 matmul).
Model of the bytes: each cached key and value is read once per (user, head) (bytes = users x keys x
heads x head_dim x 2 x 2); FLOPs = 4 x sum over rows of keys read x head_dim x heads. Fractions are
of this GPU's own ceilings, measured in the same process (device_peaks: a copy and a bf16 matrix
product; about 4.3 TB/s and 790 TFLOP/s on the H200, 3.0 TB/s on the H100).
max_abs_diff: kernel against the same computation in fp32 PyTorch (the inputs upcast).

Run with the op library built (python3 -m kvexport.native) and PYTHONPATH at the repository:
    python3 benchmarks/gpu/attention_bench.py --batch 1,8,32 --json /tmp/attention.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys

import torch

CONTEXTUAL = 6  # contextual tokens before the 2 * history events


def add_shape_arguments(parser: argparse.ArgumentParser) -> None:
    """The request's shape and the timing loop (this bench's and peers.py's)."""
    parser.add_argument("--batch", default="1,8,32", help="comma-separated batch sizes")
    parser.add_argument("--history", type=int, default=4096, help="cached events per user")
    parser.add_argument("--new-events", type=int, default=32, help="uncached events per user")
    parser.add_argument("--candidates", type=int, default=100, help="candidates per user")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--page-size", type=int, default=32)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_arguments(parser)
    parser.add_argument("--json", help="also write the JSON object here")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="only run the op (warmup + repeats calls per batch), for a profiler such as "
        "Nsight Compute, which takes the interface this script's own timing uses",
    )
    return parser.parse_args()


class Request:
    """One layer-stack's inputs for `batch` users of the reference shape, on the GPU."""

    def __init__(self, args: argparse.Namespace, batch: int):
        g = torch.Generator(device="cuda").manual_seed(args.seed + batch)
        dtype, dev = torch.bfloat16, "cuda"
        self.batch, self.heads, self.head_dim = batch, args.heads, args.head_dim
        cached = CONTEXTUAL + 2 * args.history
        new_rows = 2 * args.new_events
        self.keys = cached + new_rows  # the new rows' k/v are in the cache when attention runs
        self.pages_per_user = -(-self.keys // args.page_size)
        num_pages = batch * self.pages_per_user
        self.page_table = torch.randperm(num_pages, device=dev, generator=g).view(batch, self.pages_per_user)
        self.caches = [
            torch.randn(num_pages, 2, args.page_size, args.heads, args.head_dim, device=dev, generator=g, dtype=dtype)
            for _ in range(args.layers)
        ]
        cands, rows_per_user = args.candidates, args.candidates + new_rows
        rows = batch * rows_per_user
        self.q, self.k, self.v = (
            torch.randn(rows, args.heads, args.head_dim, device=dev, generator=g, dtype=dtype) for _ in range(3)
        )
        users = torch.arange(batch, device=dev)
        self.row_user = torch.cat([users.repeat_interleave(cands), users.repeat_interleave(new_rows)])
        prefix_keys = torch.arange(cached + 1, self.keys + 1, device=dev).repeat(batch)
        self.row_keys = torch.cat([torch.full((batch * cands,), self.keys, device=dev), prefix_keys])
        self.row_candidate = torch.cat(
            [
                torch.ones(batch * cands, dtype=torch.bool, device=dev),
                torch.zeros(batch * new_rows, dtype=torch.bool, device=dev),
            ]
        )
        # Each user's rows, for the PyTorch versions: [batch, rows_per_user].
        cand_rows = torch.arange(batch * cands, device=dev).view(batch, cands)
        prefix_rows = batch * cands + torch.arange(batch * new_rows, device=dev).view(batch, new_rows)
        self.user_rows = torch.cat([cand_rows, prefix_rows], dim=1)
        self.alpha = 1.0 / math.sqrt(args.head_dim)
        self.inv_scaling = 1.0 / 8192

    def kernel(self, layer: int) -> torch.Tensor:
        return torch.ops.kvexport.hstu_paged_attention(
            self.q,
            self.k,
            self.v,
            self.caches[layer],
            self.page_table,
            self.row_user,
            self.row_keys,
            self.row_candidate,
            self.alpha,
            self.inv_scaling,
        )

    def torch_reference(self, layer: int, dtype: torch.dtype) -> torch.Tensor:
        """Gathers every user's pages into contiguous k/v, then matmul -> SiLU -> matmul in `dtype`
        (accumulating in fp32), plus the candidates' own key."""
        kv = self.caches[layer][self.page_table].to(dtype)  # [B, pages, 2, page_size, H, dh]
        shape = (self.batch, -1, self.heads, self.head_dim)
        keys, values = kv[:, :, 0].reshape(shape), kv[:, :, 1].reshape(shape)
        q, k, v = (t[self.user_rows].to(dtype) for t in (self.q, self.k, self.v))  # [B, R, H, dh]
        scores = torch.einsum("brhd,bkhd->bhrk", q, keys).float()
        limit = self.row_keys[self.user_rows]  # [B, R]
        mask = torch.arange(keys.shape[1], device=q.device) < limit[:, None, :, None]
        weights = (torch.nn.functional.silu(self.alpha * scores) * self.inv_scaling).masked_fill(~mask, 0.0)
        out = torch.einsum("bhrk,bkhd->brhd", weights.to(dtype), values).float()
        self_score = torch.nn.functional.silu(self.alpha * (q.float() * k.float()).sum(-1)) * self.inv_scaling
        out += (self_score * self.row_candidate[self.user_rows][..., None])[..., None] * v.float()
        result = torch.empty(self.q.shape, dtype=torch.float32, device=q.device)
        result[self.user_rows] = out
        return result.to(self.q.dtype) if dtype != torch.float32 else result


def event_times(fn, layers: int, warmup: int, repeats: int) -> float:
    """Median ms of fn(layer) over `repeats` calls, layers in turn, by CUDA events."""
    for i in range(warmup):
        fn(i % layers)
    ms = []
    for i in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(i % layers)
        end.record()
        end.synchronize()
        ms.append(start.elapsed_time(end))
    return statistics.median(ms)


def device_peaks(warmup: int = 3, repeats: int = 10) -> dict:
    """This GPU's ceilings, measured here: a device-to-device copy of 1 GiB (bytes read plus bytes
    written, per second) and an 8192 x 8192 x 8192 bf16 matrix product on random data (FLOP/s),
    each the median of `repeats` after `warmup`. Fractions are of these, so that a run on another
    GPU than the one a target was set on (an H100 for an H200) is held to its own memory."""
    size, n = 1 << 30, 8192
    copy_ms = _copy_ms(size, warmup, repeats)
    matmul_ms = _matmul_ms(n, warmup, repeats)
    torch.cuda.empty_cache()
    return {
        "bytes_per_s": round(2 * size / (copy_ms / 1e3), -9),
        "flops": round(2 * n**3 / (matmul_ms / 1e3), -12),
        "measured": "a 1 GiB device-to-device copy (read + written) and an 8192^3 bf16 matmul, medians",
    }


def _copy_ms(size: int, warmup: int, repeats: int) -> float:
    """event_times of a device-to-device copy of `size` bytes (its buffers freed on return)."""
    source = torch.ones(size, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    return event_times(lambda _: target.copy_(source), 1, warmup, repeats)


def _matmul_ms(n: int, warmup: int, repeats: int) -> float:
    """event_times of an n x n x n bf16 matrix product on random data (its matrices freed on return)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    return event_times(lambda _: a @ b, 1, warmup, repeats)


def kernel_times(fn, layers: int, warmup: int, repeats: int, name: str = "kvexport") -> tuple[float, int]:
    """Median device ms per call of the kernels whose name contains `name` ("": every kernel but
    copies and fills), and how many such kernels a call launches."""
    from torch.profiler import ProfilerActivity, profile

    for i in range(warmup):
        fn(i % layers)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(repeats):
            fn(i % layers)
        torch.cuda.synchronize()
    kernels = sorted(
        (
            e
            for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA
            and name in e.name
            and not e.name.startswith(("Memcpy", "Memset"))
        ),
        key=lambda e: e.time_range.start,
    )
    if not kernels or len(kernels) % repeats:
        raise RuntimeError(f"{len(kernels)} kernels named *{name}* in {repeats} calls")
    per_call = len(kernels) // repeats
    totals = [
        sum(e.time_range.elapsed_us() for e in kernels[i : i + per_call]) / 1e3
        for i in range(0, len(kernels), per_call)
    ]
    return statistics.median(totals), per_call


def bench(args: argparse.Namespace, batch: int, peaks: dict) -> dict:
    result = _measure(Request(args, batch), args, batch, peaks)
    torch.cuda.empty_cache()  # the request's tensors are gone: the next batch has the memory
    return result


def _measure(request: Request, args: argparse.Namespace, batch: int, peaks: dict) -> dict:
    kernel_ms, kernels_per_call = kernel_times(request.kernel, args.layers, args.warmup, args.repeats)
    op_ms = event_times(request.kernel, args.layers, args.warmup, args.repeats)
    naive_ms = event_times(
        lambda layer: request.torch_reference(layer, torch.bfloat16), args.layers, 2, min(args.repeats, 20)
    )
    expected = request.torch_reference(0, torch.float32)
    actual = request.kernel(0).float()
    rows_keys = int(request.row_keys.sum())
    kv_bytes = batch * request.keys * args.heads * args.head_dim * 2 * 2
    flops = 4 * rows_keys * args.head_dim * args.heads
    seconds = kernel_ms / 1e3
    result = {
        "batch": batch,
        "rows": int(request.q.shape[0]),
        "keys_per_user": request.keys,
        "kernel_ms": round(kernel_ms, 4),
        "kernels_per_call": kernels_per_call,
        "op_ms": round(op_ms, 4),
        "torch_naive_ms": round(naive_ms, 4),
        "kv_bytes": kv_bytes,
        "flops": flops,
        "tb_per_s": round(kv_bytes / seconds / 1e12, 3),
        "bandwidth_fraction": round(kv_bytes / seconds / peaks["bytes_per_s"], 3),
        "tflop_per_s": round(flops / seconds / 1e12, 1),
        "compute_fraction": round(flops / seconds / peaks["flops"], 3),
        "speedup_vs_naive": round(naive_ms / kernel_ms, 2),
        "max_abs_diff": float((actual - expected).abs().max()),
        "max_abs_ref": float(expected.abs().max()),
    }
    return result


def main() -> int:
    args = parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"error": "no CUDA device"}))
        return 1
    from kvexport.ops import library

    library.load()
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference is plain fp32
    if args.profile:
        for batch in args.batch.split(","):
            request = Request(args, int(batch))
            for i in range(args.warmup + args.repeats):
                request.kernel(i % args.layers)
            torch.cuda.synchronize()
            del request
        return 0
    peaks = device_peaks()
    results = [bench(args, int(b), peaks) for b in args.batch.split(",")]
    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "shape": {
            "history": args.history,
            "new_events": args.new_events,
            "candidates": args.candidates,
            "heads": args.heads,
            "head_dim": args.head_dim,
            "page_size": args.page_size,
            "layers": args.layers,
            "dtype": "bfloat16",
        },
        "peaks": peaks,
        "byte_model": "each cached key and value read once per (user, head)",
        "results": results,
    }
    text = json.dumps(report)
    if args.json:
        with open(args.json, "w") as out:
            out.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
