"""The paged attention kernel's plain-PyTorch reference, and inputs for it."""

from __future__ import annotations

import torch
from torch import nn

ALPHA, INV_S = 0.5, 1.0 / 64


def reference_paged_attention(q, k, v, cache, page_table, row_user, row_keys, row_candidate):
    """Gathers each row's keys by position (page, slot) and applies SiLU attention."""
    page_size = cache.shape[2]
    out = torch.zeros_like(q)
    for r in range(q.shape[0]):
        positions = torch.arange(int(row_keys[r]))
        pages, slots = page_table[row_user[r], positions // page_size], positions % page_size
        keys, values = cache[pages, 0, slots], cache[pages, 1, slots]  # [n, H, dh]
        if row_candidate[r]:
            keys, values = torch.cat([keys, k[r][None]]), torch.cat([values, v[r][None]])
        if keys.shape[0] == 0:
            continue
        weights = nn.functional.silu(ALPHA * torch.einsum("hd,nhd->nh", q[r], keys)) * INV_S
        out[r] = torch.einsum("nh,nhd->hd", weights, values)
    return out


def random_paged_inputs(seed: int, dtype=torch.float32, head_dim: int = 8):
    g = torch.Generator().manual_seed(seed)
    num_pages, page_size, heads = 8, 4, 2
    cache = torch.randn(num_pages, 2, page_size, heads, head_dim, generator=g).to(dtype)
    page_table = torch.tensor([[5, 2, 7], [0, 3, 1]])
    row_user = torch.tensor([0, 0, 1, 1, 1, 0])
    row_keys = torch.tensor([12, 12, 9, 1, 0, 7])
    row_candidate = torch.tensor([True, True, True, False, True, False])
    q, k, v = (torch.randn(6, heads, head_dim, generator=g).to(dtype) for _ in range(3))
    return q, k, v, cache, page_table, row_user, row_keys, row_candidate


def strided_like(t: torch.Tensor, layout: str) -> torch.Tensor:
    """t [N, H, dh] with the same values in another layout: "slices" as one of four column blocks of
    a projection's output (the model's q, k, v: rows apart by 4 H dh), "transposed" with each row's
    heads apart (no row of it contiguous), "contiguous" as it is."""
    if layout == "slices":
        wide = torch.randn(t.shape[0], 4, *t.shape[1:]).to(t.dtype)
        wide[:, 2] = t
        return wide.flatten(1).chunk(4, dim=1)[2].unflatten(1, t.shape[1:])
    if layout == "transposed":
        return t.transpose(1, 2).contiguous().transpose(1, 2)
    return t
