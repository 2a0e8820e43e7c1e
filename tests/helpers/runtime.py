"""Scratch cache runtimes, and one request through the runtime's ops with deterministic k/v."""

from __future__ import annotations

import contextlib
import itertools
import json

import torch

from kvexport.ops import wrappers as kv

_runtime_names = itertools.count()
PAGE_SIZE = 2
# Two layers of one head of width 2: room for 6 pages on the device tier, 4 on the host tier.
CONFIG = json.dumps(
    {
        "num_layers": 2,
        "num_heads": 1,
        "head_dim": 2,
        "page_size": PAGE_SIZE,
        "device_pages": 6,
        "host_pages": 4,
        "dtype": "float32",
    }
)


def scratch_runtime_name() -> str:
    """A runtime name no other test uses."""
    return f"test-runtime-{next(_runtime_names)}"


def host_placement() -> torch.Tensor:
    """begin_batch's placement for a runtime on the CPU: any host tensor."""
    return torch.empty(0)


@contextlib.contextmanager
def scratch_runtime(config_json: str):
    """A fresh cache runtime with the given config, dropped afterwards."""
    name = scratch_runtime_name()
    kv.create_runtime(name, config_json)
    try:
        yield name
    finally:
        kv.drop_runtime(name)


def kv_values(tokens: list[int], layer: int) -> torch.Tensor:
    """Deterministic k/v rows derived from token ids and layer: [N, 1, 2]."""
    t = torch.tensor(tokens, dtype=torch.float32)
    return torch.stack([t + 0.25 * layer, -t - 0.5 * layer], dim=1).unsqueeze(1)


def request(runtime: str, users: dict[int, list[int]], num_candidates: int = 1, config: str = CONFIG) -> list[int]:
    """Runs one batch through the runtime ops, writing kv_values for the new tokens; returns cached
    lengths (each user's tokens before its first new one, as begin_batch's index of the new tokens
    says; checked to be a suffix of each user's tokens)."""
    user_ids = torch.tensor(list(users), dtype=torch.int64)
    tokens = torch.tensor([t for ts in users.values() for t in ts], dtype=torch.int64)
    lengths = torch.tensor([len(ts) for ts in users.values()], dtype=torch.int64)
    candidates = torch.full((len(users),), num_candidates, dtype=torch.int64)
    new = kv.begin_batch(runtime, config, user_ids, tokens, lengths, candidates, host_placement())
    new_index, new_positions = new.index.tolist(), new.positions.tolist()
    firsts = [sum(len(ts) for ts in list(users.values())[:b]) for b in range(len(users))]
    cached = [
        len(ts) - sum(first <= i < first + len(ts) for i in new_index) for first, ts in zip(firsts, users.values())
    ]
    assert new_index == [first + p for first, ts, c in zip(firsts, users.values(), cached) for p in range(c, len(ts))]
    assert new_positions == [p for ts, c in zip(users.values(), cached) for p in range(c, len(ts))]
    new_tokens = [t for (ts, c) in zip(users.values(), cached) for t in ts[c:]]
    num_rows = num_candidates * len(users) + len(new_tokens)
    for layer in range(2):
        rows = torch.cat([torch.zeros(num_candidates * len(users), 1, 2), kv_values(new_tokens, layer)])
        assert rows.shape[0] == num_rows
        kv.paged_attention(runtime, layer, rows, rows, rows, 1.0, 1.0)  # stores the new rows' k/v
    kv.end_batch(runtime, user_ids, rows)
    return cached
