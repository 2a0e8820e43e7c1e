"""The CPU attention kernel alone (kvexport::hstu_paged_attention), one thread, on the shapes of a
cached request and of a long full recompute: microseconds per call, median of repeats.

    .venv/bin/python benchmarks/attention_cpu.py

Compare two builds of the op library by running it after each (`python -m kvexport.native`).
"""

from __future__ import annotations

import statistics
import time

import torch

from kvexport.ops import wrappers as kv

PAGE_SIZE, CANDIDATES, ALPHA, INV_S = 16, 64, 0.5, 1 / 64
# (rows, cached keys, heads, head size): hstu-bench's cached requests at L = 64 and 256 (96 new
# rows: 16 events and 64 candidates), the same at head size 64, and the H200 workload's shape.
SHAPES = ((96, 130, 2, 32), (96, 514, 2, 32), (96, 130, 4, 64), (164, 4000, 4, 128))


def inputs(rows: int, keys: int, heads: int, head_dim: int, generator: torch.Generator) -> tuple:
    """One user: rows - CANDIDATES new prefix rows (causal) after `keys` cached ones, then candidates."""
    pages = (keys + rows + PAGE_SIZE - 1) // PAGE_SIZE
    cache = torch.randn(pages, 2, PAGE_SIZE, heads, head_dim, generator=generator)
    page_table = torch.randperm(pages, generator=generator).view(1, pages)
    new = rows - CANDIDATES
    row_keys = torch.tensor([keys + i + 1 for i in range(new)] + [keys + new] * CANDIDATES)
    row_candidate = torch.arange(rows) >= new
    q, k, v = (torch.randn(rows, heads, head_dim, generator=generator) for _ in range(3))
    return q, k, v, cache, page_table, torch.zeros(rows, dtype=torch.int64), row_keys, row_candidate, ALPHA, INV_S


def main() -> None:
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    for shape in SHAPES:
        args = inputs(*shape, generator)
        calls = max(3, int(2e7 / (shape[0] * shape[1] * shape[2] * shape[3])))
        for _ in range(calls):
            kv.hstu_paged_attention(*args)
        samples = []
        for _ in range(7):
            started = time.perf_counter()
            for _ in range(calls):
                kv.hstu_paged_attention(*args)
            samples.append((time.perf_counter() - started) / calls * 1e6)
        rows, keys, heads, head_dim = shape
        print(
            f"{rows} rows over {keys} cached keys, {heads} heads x {head_dim}: "
            f"{statistics.median(samples):9.1f} us (median of 7)"
        )


if __name__ == "__main__":
    main()
