"""The invariant: cached output == full-recompute output, for every request, under eviction."""

from __future__ import annotations

import copy

import torch
import yaml

from kvexport.config import config_from_dict
from kvexport.model import build_model
from kvexport.ops.manager import KVCacheManager
from kvexport.trace.workload import Workload, WorkloadSpec
from tests.conftest import TINY


def small_cache_config():
    """The tiny model with room for ~3 users on the device tier and ~6 on the host tier."""
    raw = copy.deepcopy(yaml.safe_load(TINY.read_text()))
    raw["name"] = "parity"
    raw["model"]["max_history_length"] = 48  # <= 99 tokens = 7 pages per user
    raw["kv_cache"].update(device_pages=21, host_pages=42)
    raw["trace"]["max_trace_history_length"] = 48
    return config_from_dict(raw)


def test_cached_equals_recompute_under_eviction():
    config = small_cache_config()
    model = build_model(config, seed=1)
    cache = KVCacheManager(config)
    cache.reset()
    spec = WorkloadSpec(num_users=12, min_history_length=8, max_history_length=48, max_new_events=6,
                        num_candidates=6, rewrite_fraction=0.15)
    workload = Workload(config.model, spec, seed=2)
    partial_hits = 0
    for step in range(60):
        batch = workload.next_batch(batch_size=1 + step % 3)
        before = cache.stats()
        with torch.no_grad():
            cached = model.forward_cached(batch)
            full = model(batch)
        after = cache.stats()
        assert torch.allclose(cached, full, rtol=0, atol=1e-4), f"request {step}: cached != recompute"
        hits = after["hit_tokens"] - before["hit_tokens"]
        recomputed = after["recomputed_tokens"] - before["recomputed_tokens"]
        partial_hits += batch.batch_size == 1 and hits > 0 and recomputed > 0
    stats = cache.stats()
    cache.close()
    assert stats["lookups"] == sum(1 + s % 3 for s in range(60))
    assert stats["hit_tokens"] > 0 and partial_hits > 0
    assert stats["device_evictions"] > 0
    assert stats["offloads"] > 0
    assert stats["onboards"] > 0
    assert stats["prefix_truncations"] > 0
    assert workload.events["edit"] + workload.events["delete"] + workload.events["context"] > 0
