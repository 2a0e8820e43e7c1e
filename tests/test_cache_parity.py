"""The invariant: cached output == full-recompute output, for every request, under eviction."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvexport.cached import CachedRanker
from kvexport.model import build_model
from kvexport.ops.manager import KVCacheManager
from kvexport.trace.workload import Workload, WorkloadSpec
from tests.helpers.configs import tiny_config


def small_cache_config(**switches):
    """The tiny model with room for ~3 users on the device tier and ~6 on the host tier (pairs), under
    the given model switches."""
    return tiny_config(
        name="parity",
        model={**switches, "max_history_length": 48},  # <= 99 tokens = 7 pages a user
        kv_cache={"device_pages": 21, "host_pages": 42},
        trace={"max_trace_history_length": 48},
    )


DLRM_SWITCHES = {
    "event_tokens": "combined",
    "candidate_position": "shared_row",
    "head": "item_tower",
    "query_time_periods": [[3600, 24], [86400, 7]],
    "silu_on": "u",
    "layer_output": "concat",
}


@pytest.mark.parametrize(
    "switches",
    [
        {},
        {"event_tokens": "combined", "candidate_position": "shared_row"},
        DLRM_SWITCHES,
        {"context_attention": "whole_prefix", "scaling_seqlen": 4},
    ],
    ids=["default", "combined-shared-row", "dlrm-item-tower", "context-whole-prefix"],
)
def test_cached_equals_recompute_under_eviction(switches):
    config = small_cache_config(**switches)
    model = build_model(config, seed=1)
    whole_prefix = switches.get("context_attention") == "whole_prefix"
    if whole_prefix:
        # A small S and larger projections, so that what contextual rows read moves the logits
        # (on the tiny model's S of 1024 the mask changes them by ~1e-8): asserted below.
        causal = build_model(small_cache_config(**{**switches, "context_attention": "causal"}), seed=1)
        with torch.no_grad():
            for layer in model.layers:
                layer.uvqk.weight.mul_(4)
                layer.output.weight.mul_(4)
        causal.load_state_dict(model.state_dict())
        mask_moved = 0.0
    cache = KVCacheManager(config)
    cache.reset()
    spec = WorkloadSpec(
        num_users=12,
        min_history_length=8,
        max_history_length=48,
        max_new_events=6,
        num_candidates=6,
        rewrite_fraction=0.15,
    )
    workload = Workload(config.model, spec, seed=2)
    partial_hits = 0
    try:  # closed on failure too: the next test makes a runtime of the same name
        for step in range(60):
            batch = workload.next_batch(batch_size=1 + step % 3)
            before = cache.stats()
            with torch.no_grad():
                cached = CachedRanker(model).run(batch)
                full = model(batch)
            after = cache.stats()
            assert torch.allclose(cached, full, rtol=0, atol=1e-4), f"request {step}: cached != recompute"
            if whole_prefix:
                with torch.no_grad():
                    mask_moved = max(mask_moved, (causal(batch) - full).abs().max().item())
            hits = after["hit_tokens"] - before["hit_tokens"]
            recomputed = after["recomputed_tokens"] - before["recomputed_tokens"]
            partial_hits += batch.batch_size == 1 and hits > 0 and recomputed > 0
        stats = cache.stats()
    finally:
        cache.close()
    assert stats["lookups"] == sum(1 + s % 3 for s in range(60))
    # Contextual rows that read the whole prefix allow reuse only of an unchanged prefix.
    assert stats["hit_tokens"] > 0 and (partial_hits == 0 if whole_prefix else partial_hits > 0)
    assert not whole_prefix or mask_moved > 1e-3
    assert stats["device_evictions"] > 0
    assert stats["offloads"] > 0
    assert stats["onboards"] > 0
    assert stats["prefix_truncations"] > 0
    assert workload.events["edit"] + workload.events["delete"] + workload.events["context"] > 0


def test_a_combined_event_whose_action_changed_is_recomputed():
    """With one token an event, an event whose action alone changed is a new token: the cache keeps
    the events before it and recomputes from it, and the output is the full recompute's."""
    config = small_cache_config(event_tokens="combined")
    model = build_model(config, seed=1)
    cache = KVCacheManager(config)
    cache.reset()
    batch = Workload(
        config.model,
        WorkloadSpec(num_users=1, min_history_length=10, max_history_length=10, max_new_events=1, num_candidates=3),
        seed=4,
    ).next_batch(1)
    changed = batch.action_ids.clone()
    changed[6] = (changed[6] + 1) % config.model.action_vocab_size
    try:
        with torch.no_grad():
            CachedRanker(model).run(batch)
            before = cache.stats()
            second = dataclasses.replace(batch, action_ids=changed)
            cached, full = CachedRanker(model).run(second), model(second)
        after = cache.stats()
    finally:
        cache.close()
    assert torch.allclose(cached, full, rtol=0, atol=1e-4)
    assert (cached - model(batch)).abs().max() > 1e-6
    history = int(batch.history_lengths[0])
    assert after["hit_tokens"] - before["hit_tokens"] == config.model.num_contextual_features + 6
    assert after["recomputed_tokens"] - before["recomputed_tokens"] == history - 6
