"""Cache runtime semantics with tiny capacities: exact page counts, LRU order, tiers, truncation."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from kvexport.cached import CachedRanker
from kvexport.ops import wrappers as kv
from tests.helpers.runtime import CONFIG, host_placement, kv_values, request, scratch_runtime, scratch_runtime_name


@pytest.fixture
def runtime():
    with scratch_runtime(CONFIG) as name:
        yield name


def test_cold_then_warm_then_grown(runtime):
    assert request(runtime, {1: [10, 11, 12]}) == [0]
    assert request(runtime, {1: [10, 11, 12]}) == [3]
    assert request(runtime, {1: [10, 11, 12, 13, 14]}) == [3]
    stats = kv.runtime_stats(runtime)
    assert stats["lookups"] == 3
    assert stats["hit_tokens"] == 6
    assert stats["recomputed_tokens"] == 5
    assert stats["device_pages_used"] == 3  # 5 tokens at page size 2
    assert stats["prefix_truncations"] == 0


def test_cached_kv_is_what_was_written(runtime):
    request(runtime, {1: [10, 11, 12]})
    request(runtime, {1: [10, 11, 12, 13]})
    stored = kv.read_user_kv(runtime, 1)  # [layers, 2, len, H, dh]
    assert stored.shape == (2, 2, 4, 1, 2)
    for layer in range(2):
        assert torch.equal(stored[layer, 0], kv_values([10, 11, 12, 13], layer))
        assert torch.equal(stored[layer, 1], kv_values([10, 11, 12, 13], layer))


def test_rewritten_history_truncates_to_common_prefix(runtime):
    request(runtime, {1: [10, 11, 12, 13, 14]})
    assert request(runtime, {1: [10, 11, 99, 13, 14, 15]}) == [2]
    stats = kv.runtime_stats(runtime)
    assert stats["prefix_truncations"] == 1
    assert stats["device_pages_used"] == 3
    assert torch.equal(kv.read_user_kv(runtime, 1)[0, 0], kv_values([10, 11, 99, 13, 14, 15], 0))


def test_shorter_history_truncates(runtime):
    request(runtime, {1: [10, 11, 12, 13, 14]})
    assert request(runtime, {1: [10, 11, 12]}) == [3]
    assert kv.runtime_stats(runtime)["prefix_truncations"] == 1
    assert kv.cached_length(runtime, 1) == 3
    assert kv.runtime_stats(runtime)["device_pages_used"] == 2


def test_lru_eviction_offloads_least_recent_user(runtime):
    request(runtime, {1: [1, 1, 1, 1]})  # 2 pages
    request(runtime, {2: [2, 2, 2, 2]})  # 2 pages
    request(runtime, {3: [3, 3]})  # 1 page
    request(runtime, {1: [1, 1, 1, 1]})  # touch 1: LRU order is now 2, 3, 1
    assert kv.device_users_lru(runtime) == [2, 3, 1]
    request(runtime, {4: [4, 4, 4, 4]})  # needs 2 pages, 1 free: evicts user 2 only
    assert kv.device_users_lru(runtime) == [3, 1, 4]
    stats = kv.runtime_stats(runtime)
    assert (stats["device_evictions"], stats["offloads"]) == (1, 1)
    assert (stats["host_users"], stats["host_pages_used"]) == (1, 2)
    assert stats["device_pages_used"] == 5
    assert kv.cached_length(runtime, 2) == 4  # still cached, on the host tier


def test_offload_onboard_round_trip_is_bit_exact(runtime):
    tokens = [5, 6, 7, 8, 9]
    request(runtime, {7: tokens})
    before = kv.read_user_kv(runtime, 7)
    assert kv.evict_user(runtime, 7)
    assert kv.runtime_stats(runtime)["device_users"] == 0
    assert request(runtime, {7: tokens + [10]}) == [5]
    stats = kv.runtime_stats(runtime)
    assert (stats["offloads"], stats["onboards"], stats["host_users"]) == (1, 1, 0)
    after = kv.read_user_kv(runtime, 7)
    assert torch.equal(after[:, :, :5], before)
    assert torch.equal(after[0, 0, 5], kv_values([10], 0)[0])


def test_onboard_of_diverged_user_keeps_only_common_prefix(runtime):
    request(runtime, {7: [5, 6, 7, 8, 9]})
    kv.evict_user(runtime, 7)
    assert request(runtime, {7: [5, 6, 7, 0, 9]}) == [3]
    stats = kv.runtime_stats(runtime)
    assert (stats["onboards"], stats["prefix_truncations"]) == (1, 1)


def test_host_tier_lru_evicts_oldest_offload(runtime):
    request(runtime, {1: [1, 1, 1, 1]})
    request(runtime, {2: [2, 2, 2, 2]})
    request(runtime, {3: [3, 3, 3, 3]})
    for user in (1, 2, 3):  # host holds 4 pages = 2 of these users
        kv.evict_user(runtime, user)
    stats = kv.runtime_stats(runtime)
    assert (stats["offloads"], stats["host_evictions"], stats["host_users"]) == (3, 1, 2)
    assert kv.cached_length(runtime, 1) == 0
    assert kv.cached_length(runtime, 2) == 4
    assert kv.cached_length(runtime, 3) == 4


def test_capacity_error_leaves_state_unchanged(runtime):
    request(runtime, {1: [1, 2, 3]})
    request(runtime, {2: [4, 5]})
    before = kv.runtime_stats(runtime)
    lru = kv.device_users_lru(runtime)
    with pytest.raises(ValueError, match="needs 7 device pages but kv_cache.device_pages is 6"):
        request(runtime, {3: [1] * 8, 4: [2] * 6})
    assert kv.runtime_stats(runtime) == before
    assert kv.device_users_lru(runtime) == lru
    assert request(runtime, {1: [1, 2, 3, 4]}) == [3]


def test_batch_users_are_never_evicted_for_each_other(runtime):
    request(runtime, {1: [1] * 4, 2: [2] * 4})
    assert request(runtime, {1: [1] * 4, 2: [2] * 4, 3: [3] * 4}) == [4, 4, 0]
    assert kv.runtime_stats(runtime)["device_evictions"] == 0
    assert request(runtime, {4: [4] * 4, 3: [3] * 4}) == [0, 4]
    assert kv.runtime_stats(runtime)["device_evictions"] == 1
    assert kv.device_users_lru(runtime)[0] == 2


def test_duplicate_user_in_batch_is_rejected(runtime):
    with pytest.raises(ValueError, match="user id 1 appears twice in one batch"):
        kv.begin_batch(
            runtime,
            CONFIG,
            torch.tensor([1, 1]),
            torch.tensor([1, 2]),
            torch.tensor([1, 1]),
            torch.tensor([1, 1]),
            host_placement(),
        )


def test_reset_empties_everything(runtime):
    request(runtime, {1: [1, 2, 3]})
    kv.evict_user(runtime, 1)
    kv.reset_runtime(runtime)
    assert all(value == 0 for value in kv.runtime_stats(runtime).values())
    assert request(runtime, {1: [1, 2, 3]}) == [0]


def test_runtimes_are_isolated_by_name(runtime):
    other = runtime + "-other"
    kv.create_runtime(other, CONFIG)
    try:
        request(runtime, {1: [1, 2, 3]})
        assert request(other, {1: [1, 2, 3]}) == [0]
    finally:
        kv.drop_runtime(other)


def test_same_name_with_other_config_is_refused(runtime):
    with pytest.raises(ValueError, match="already exists in this process with a different config"):
        kv.create_runtime(runtime, CONFIG.replace('"device_pages": 6', '"device_pages": 8'))


def _in_thread(target) -> threading.Thread:
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout=10)
    return thread


def test_aborted_batch_releases_the_runtime_to_other_threads(runtime):
    request(runtime, {1: [1, 2, 3]})
    # This thread now owns the runtime, as a request failing midway would.
    kv.begin_batch(
        runtime,
        CONFIG,
        torch.tensor([1]),
        torch.tensor([1, 2, 3, 4]),
        torch.tensor([4]),
        torch.tensor([1]),
        host_placement(),
    )
    kv.abort_batch(runtime)
    results = []
    assert not _in_thread(lambda: results.append(request(runtime, {1: [1, 2, 3, 4]}))).is_alive()
    assert results == [[3]]  # the aborted batch committed nothing


def test_refused_request_records_why_and_holds_nothing(tiny_config, tiny_model):
    from kvexport.model import random_batch
    from kvexport.model.batch import Batch

    name = scratch_runtime_name()
    good = random_batch(tiny_config.model, seed=0, history_lengths=[3], num_candidates=[2])
    bad = Batch(**{**good.to_dict(), "candidate_ids": torch.tensor([0, tiny_config.model.item_vocab_size])})
    try:
        with pytest.raises(ValueError, match="candidate_ids has 10000, outside the item vocabulary"):
            with torch.no_grad():
                CachedRanker(tiny_model, name).run(bad)  # refused by check_request, before begin_batch
        assert kv.last_error(name) == (
            "invalid_request",
            "candidate_ids has 10000, outside the item vocabulary [0, 9999]",
        )
        assert _in_thread(lambda: kv.last_error(name)).is_alive() is False
        with torch.no_grad():
            CachedRanker(tiny_model, name).run(good)
        assert kv.last_error(name) == ("ok", "")  # every request starts by clearing it
        stats = []
        assert not _in_thread(lambda: stats.append(kv.runtime_stats(name))).is_alive()
        assert stats[0]["lookups"] == 1  # the refused request never reached the runtime
    finally:
        kv.drop_runtime(name)


def test_a_user_of_the_callers_batch_in_flight_is_not_evicted(runtime):
    """evict_user from the thread whose batch holds that user is refused (ValueError), and the batch
    still commits; another user is evicted as usual."""
    request(runtime, {2: [5, 6, 7], 3: [9]})
    kv.begin_batch(
        runtime,
        CONFIG,
        torch.tensor([1, 2]),
        torch.tensor([1, 2, 3, 5, 6, 7, 8]),
        torch.tensor([3, 4]),
        torch.tensor([1, 1]),
        host_placement(),
    )
    for user in (1, 2):
        with pytest.raises(ValueError, match=f"^user {user} is in this thread's batch in flight: end or abort"):
            kv.evict_user(runtime, user)
    assert kv.evict_user(runtime, 3)
    kv.end_batch(runtime, torch.tensor([1, 2]), torch.zeros(1))
    assert kv.last_error(runtime)[0] == "ok"
    assert (kv.cached_length(runtime, 1), kv.cached_length(runtime, 2)) == (3, 4)


def test_failing_op_releases_its_batch_at_once(runtime):
    kv.begin_batch(
        runtime,
        CONFIG,
        torch.tensor([1]),
        torch.tensor([1, 2, 3]),
        torch.tensor([3]),
        torch.tensor([1]),
        host_placement(),
    )
    wrong_rows = torch.zeros(2, 1, 2)  # the plan has 1 candidate + 3 new prefix rows
    with pytest.raises(RuntimeError, match="expected k and v of 4 rows"):
        kv.paged_attention(runtime, 0, wrong_rows, wrong_rows, wrong_rows, 1.0, 1.0)
    assert kv.last_error(runtime)[0] == "internal"
    results = []
    assert not _in_thread(lambda: results.append(request(runtime, {1: [1, 2, 3]}))).is_alive()
    assert results == [[0]]  # nothing of the failed request was committed
    assert kv.runtime_stats(runtime)["stalled_batches"] == 0  # released by the failing op, not by time


def test_stalled_batch_goes_to_the_next_request_and_its_ops_then_fail():
    config = json.dumps({**json.loads(CONFIG), "stall_timeout_ms": 200})
    with scratch_runtime(config) as name:
        begun = threading.Event()
        later_error = []

        def host_that_stops_between_ops():
            kv.begin_batch(
                name,
                config,
                torch.tensor([7]),
                torch.tensor([1, 2]),
                torch.tensor([2]),
                torch.tensor([1]),
                host_placement(),
            )
            begun.set()  # the host now fails this request without calling anything
            time.sleep(0.6)
            rows = torch.zeros(3, 1, 2)
            try:
                kv.paged_attention(name, 0, rows, rows, rows, 1.0, 1.0)
            except RuntimeError:
                later_error.append(kv.last_error(name))

        stopped = threading.Thread(target=host_that_stops_between_ops)
        stopped.start()
        begun.wait(10)
        started = time.monotonic()
        results = []
        assert not _in_thread(lambda: results.append(request(name, {8: [5, 6]}, config=config))).is_alive()
        waited = time.monotonic() - started
        stopped.join(10)
        assert results == [[0]] and waited >= 0.15
        assert kv.runtime_stats(name)["stalled_batches"] == 1
        assert later_error and later_error[0][0] == "internal"
        assert "no batch in flight" in later_error[0][1]


BIG_CONFIG = json.dumps(
    {
        "num_layers": 2,
        "num_heads": 1,
        "head_dim": 2,
        "page_size": 16,
        "device_pages": 2200,
        "host_pages": 4,
        "dtype": "float32",
    }
)


def test_requests_of_many_tokens_compare_prefixes_on_several_threads_exactly():
    """Four users of 8,500 tokens (more than the 2^15 a request needs to compare its users on the
    OpenMP threads), each changed at its own position: each reuses exactly its common prefix."""
    users = {u: [(7919 * u + 31 * t) % 100_003 for t in range(8500)] for u in range(4)}
    changed_at = {0: 8500, 1: 0, 2: 4097, 3: 8499}  # 8500: unchanged, then grown by one token
    with scratch_runtime(BIG_CONFIG) as name:
        assert request(name, users, config=BIG_CONFIG) == [0] * 4
        again = {u: ts[: changed_at[u]] + [-1 - t for t in ts[changed_at[u] :]] + [5] for u, ts in users.items()}
        assert request(name, again, config=BIG_CONFIG) == [changed_at[u] for u in users]
        stats = kv.runtime_stats(name)
    assert stats["hit_tokens"] == sum(changed_at.values())
    assert stats["prefix_truncations"] == 3
