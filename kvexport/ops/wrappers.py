"""Typed Python wrappers of the kvexport:: ops: the only way the model touches the cache runtime.

A *runtime* is named by a string (the model's config name); each process holds at most one
runtime per name. The stateful ops of one request run in this order:
begin_batch -> (append_kv, paged_attention) per layer -> end_batch.
"""

from __future__ import annotations

import torch

from kvexport.ops import library

# Order of the values returned by kvexport::runtime_stats.
STATS_FIELDS = (
    "lookups", "hit_tokens", "recomputed_tokens", "device_evictions", "offloads", "onboards",
    "host_evictions", "prefix_truncations", "device_pages_used", "device_users", "host_pages_used", "host_users",
)


def _ops():
    library.load()
    return torch.ops.kvexport


def begin_batch(runtime: str, config_json: str, user_ids: torch.Tensor, token_ids: torch.Tensor,
                token_lengths: torch.Tensor, num_candidates: torch.Tensor) -> torch.Tensor:
    """Plans a request: reuses each user's longest cached common prefix, evicts and allocates.

    user_ids [B], token_ids [sum(P)] (each user's prefix tokens, jagged), token_lengths [B] (P),
    num_candidates [B]. Creates the runtime from `config_json` on first use. Returns
    cached_lengths [B]: how many leading prefix tokens of each user are served from the cache.
    The model then computes new rows laid out as [all candidates][uncached prefix tokens,
    users in order, positions ascending], which append_kv and paged_attention rely on.
    """
    return _ops().begin_batch(runtime, config_json, user_ids, token_ids, token_lengths, num_candidates)


def append_kv(runtime: str, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
    """Stores one layer's k, v [N, H, dh] of the new prefix rows (candidate rows are not cached)."""
    _ops().append_kv(runtime, layer, k, v)


def paged_attention(runtime: str, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    alpha: float, inv_scaling_seqlen: float) -> torch.Tensor:
    """HSTU attention of the new rows q [N, H, dh] over the cached and new k/v -> [N, H, dh].

    Call after append_kv for the same layer: prefix rows read the cache up to themselves,
    candidates read the whole prefix and their own k, v.
    """
    return _ops().paged_attention(runtime, layer, q, k, v, alpha, inv_scaling_seqlen)


def end_batch(runtime: str, user_ids: torch.Tensor) -> None:
    """Commits the request: the users' caches now hold their whole prefix."""
    _ops().end_batch(runtime, user_ids)


def abort_batch(runtime: str) -> None:
    """Releases this thread's unfinished request without committing it (no-op without one).

    Call it when a request fails between begin_batch and end_batch: until then other threads
    wait for the runtime. Users keep only the prefixes that were already cached.
    """
    _ops().abort_batch(runtime)


def hstu_paged_attention(q, k, v, cache, page_table, row_user, row_keys, row_candidate,
                         alpha: float, inv_scaling_seqlen: float) -> torch.Tensor:
    """The kernel behind paged_attention with every input explicit (no runtime state).

    cache [pages, 2, page_size, H, dh], page_table [B, max_pages], row_user/row_keys/row_candidate [N].
    """
    return _ops().hstu_paged_attention(q, k, v, cache, page_table, row_user, row_keys, row_candidate,
                                       alpha, inv_scaling_seqlen)


def create_runtime(runtime: str, config_json: str, device: torch.device | str = "cpu") -> None:
    """Creates the named runtime (no-op when it exists with the same config and device)."""
    _ops().create_runtime(runtime, config_json, torch.device(device))


def runtime_stats(runtime: str) -> dict[str, int]:
    """Counters and occupancy of the named runtime."""
    values = _ops().runtime_stats(runtime).tolist()
    if len(values) != len(STATS_FIELDS):
        raise RuntimeError(f"kvexport bug: runtime_stats returned {len(values)} values for {len(STATS_FIELDS)} fields")
    return dict(zip(STATS_FIELDS, values))


def reset_runtime(runtime: str) -> None:
    """Empties both tiers and zeroes the counters."""
    _ops().reset_runtime(runtime)


def evict_user(runtime: str, user_id: int) -> bool:
    """Moves a user from the device tier to the offload tier; False if it was not on the device."""
    return _ops().evict_user(runtime, user_id)


def cached_length(runtime: str, user_id: int) -> int:
    """Prefix tokens cached for a user on either tier (0 if none)."""
    return _ops().cached_length(runtime, user_id)


def device_users_lru(runtime: str) -> list[int]:
    """Users on the device tier, least recently used first."""
    return _ops().device_users_lru(runtime).tolist()


def read_user_kv(runtime: str, user_id: int) -> torch.Tensor:
    """A device-tier user's cached k/v, [layers, 2, cached_length, H, dh] (a copy)."""
    return _ops().read_user_kv(runtime, user_id)


def drop_runtime(runtime: str) -> bool:
    """Removes the named runtime from this process; False if there was none."""
    return _ops().drop_runtime(runtime)
