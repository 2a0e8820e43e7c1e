"""The attention kernel alone, per build of the op library: the cost of a portable build.

One process can load only one kvexport op library (they register the same ops), so each build is
timed in its own subprocess (`python -m kvexport.bench.kernel`), builds alternating within every
repetition. The shapes are a cached request's at L cached events: NEW_EVENTS new events (2 tokens
each, causal) and CANDIDATES candidates of one user, reading all C + 2L cached keys.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from kvexport.bench.suite import CANDIDATES, NEW_EVENTS
from kvexport.bench.timing import summary
from kvexport.config import Config
from kvexport.errors import UserError

log = logging.getLogger(__name__)
CALLS_PER_SAMPLE = 20  # one sample: the median of this many kernel calls, after as many warm-up calls
PORTABLE_ISA = "x86-64-v3"


@dataclasses.dataclass(frozen=True)
class KernelShape:
    """A cached request's attention for one user, as a config and L define it."""

    heads: int
    head_dim: int
    page_size: int
    contextual: int
    cached_events: int
    scaling_seqlen: int
    tokens_per_event: int = 2  # model.event_tokens: pairs 2, combined 1

    @classmethod
    def of(cls, config: Config, cached_events: int) -> KernelShape:
        m = config.model
        return cls(
            m.num_heads,
            m.head_dim,
            config.kv_cache.page_size,
            m.num_contextual_features,
            cached_events,
            m.scaling_seqlen,
            m.tokens_per_event,
        )


def attention_inputs(shape: KernelShape, seed: int = 0) -> tuple:
    """hstu_paged_attention's tensors for the request; the user's pages in shuffled order."""
    g = torch.Generator().manual_seed(seed)
    cached_keys = shape.contextual + shape.tokens_per_event * shape.cached_events
    new_rows = shape.tokens_per_event * NEW_EVENTS
    num_keys = cached_keys + new_rows  # the new rows' k/v are in the cache when attention runs
    pages = -(-num_keys // shape.page_size)
    cache = torch.randn(pages, 2, shape.page_size, shape.heads, shape.head_dim, generator=g)
    page_table = torch.randperm(pages, generator=g).view(1, pages)
    row_keys = torch.cat([torch.arange(cached_keys + 1, num_keys + 1), torch.full((CANDIDATES,), num_keys)])
    row_candidate = torch.cat([torch.zeros(new_rows, dtype=torch.bool), torch.ones(CANDIDATES, dtype=torch.bool)])
    rows = row_keys.numel()
    q, k, v = (torch.randn(rows, shape.heads, shape.head_dim, generator=g) for _ in range(3))
    return q, k, v, cache, page_table, torch.zeros(rows, dtype=torch.int64), row_keys, row_candidate


def time_kernel_here(library: Path, shape: KernelShape, calls: int) -> float:
    """Median ms of `calls` kernel calls (after as many warm-up calls) with `library` loaded here."""
    from kvexport.ops import library as ops_library
    from kvexport.ops import wrappers as kv

    ops_library.load(library)
    inputs = attention_inputs(shape)
    alpha, inv_scaling = 1.0 / shape.head_dim**0.5, 1.0 / shape.scaling_seqlen
    ms = []
    for i in range(2 * calls):
        started = time.perf_counter()
        kv.hstu_paged_attention(*inputs, alpha, inv_scaling)
        if i >= calls:
            ms.append((time.perf_counter() - started) * 1e3)
    return statistics.median(ms)


def time_kernel(library: Path, shape: KernelShape, workdir: Path) -> float:
    """time_kernel_here in a fresh subprocess (its own op library); returns its median ms."""
    out = workdir / "kernel.json"
    command = [
        sys.executable,
        "-m",
        "kvexport.bench.kernel",
        "--library",
        str(library),
        "--shape",
        json.dumps(dataclasses.asdict(shape)),
        "--json",
        str(out),
    ]
    result = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if result.returncode != 0:
        tail = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise UserError(f"kernel timing with {library} failed (exit {result.returncode}): {tail}")
    return json.loads(out.read_text())["ms"]


def kernel_builds(libraries: dict[str, Path], shape: KernelShape, warmup: int, repeats: int) -> dict:
    """Kernel latency per op-library build, builds alternating in each repetition; ratios to 'native'."""
    from kvexport.native.isa import library_isa

    samples: dict[str, list[float]] = {name: [] for name in libraries}
    with tempfile.TemporaryDirectory(prefix="kvexport-kernel-") as tmp:
        for i in range(warmup + repeats):
            for name, library in libraries.items():
                ms = time_kernel(library, shape, Path(tmp))
                if i >= warmup:
                    samples[name].append(ms)
    builds = {}
    for name, library in libraries.items():
        isa = library_isa(library)
        builds[name] = {
            "march": isa["march"],
            "multiversion": isa["multiversion"],
            "ms": summary(samples[name]),
            "over_native": summary([a / b for a, b in zip(samples[name], samples["native"])]),
        }
        log.info(
            "attention kernel, %s build (-march=%s%s): %.2f ms, x%.2f of native",
            name,
            isa["march"],
            f", clones {'/'.join(isa['multiversion'])}" if isa["multiversion"] else "",
            builds[name]["ms"]["median"],
            builds[name]["over_native"]["median"],
        )
    return {
        "cached_events": shape.cached_events,
        "new_events": NEW_EVENTS,
        "candidates": CANDIDATES,
        "calls_per_sample": CALLS_PER_SAMPLE,
        "torch_threads": torch.get_num_threads(),
        "builds": builds,
    }


def _main() -> None:
    parser = argparse.ArgumentParser(description="Times the attention kernel of one op library build.")
    parser.add_argument("--library", type=Path, required=True)
    parser.add_argument("--shape", type=json.loads, required=True, help="KernelShape as JSON")
    parser.add_argument("--json", type=Path, required=True, help='where to write {"ms": median}')
    args = parser.parse_args()
    ms = time_kernel_here(args.library, KernelShape(**args.shape), CALLS_PER_SAMPLE)
    args.json.write_text(json.dumps({"ms": ms}))


if __name__ == "__main__":
    _main()
