"""model.item_ids / context_ids: keys — requests carry the trainer's item keys and each contextual
feature's own keys; the checkpoint's item_keys and context_keys name the tables' rows and every
other id reads the table's last row (docs/checkpoint.md)."""

from __future__ import annotations

import pytest
import torch

from kvexport.cached import CachedRanker
from kvexport.config import MAX_CONTEXT_KEY, MAX_ITEM_KEY, ConfigError
from kvexport.model import build_model, random_batch
from kvexport.model.batch import Batch, UserRequest
from kvexport.model.checkpoint import CheckpointError, load_checkpoint
from kvexport.ops import wrappers as kv
from kvexport.ops.manager import KVCacheManager
from kvexport.trace.workload import Workload, WorkloadSpec, context_keys_of, item_keys_of
from tests.helpers.configs import tiny_config
from tests.helpers.reference import reference_forward


def keyed_config(name: str = "keyed", context_ids: str = "rows", **cache):
    return tiny_config(
        name=name,
        model={"item_ids": "keys", "context_ids": context_ids, "max_history_length": 48},
        kv_cache=cache,
        trace={"max_trace_history_length": 48},
    )


def user(user_id: int, items: list[int], candidates: list[int], context: tuple[int, ...] = (1, 2, 3)) -> UserRequest:
    n = len(items)
    return UserRequest(
        user_id, torch.tensor(items), torch.arange(n) % 4, torch.tensor(context), torch.tensor(candidates)
    )


def test_keys_and_unknown_ids_match_the_reference():
    """Keys read their rows, any other id the last row: the model agrees with the reference, whose
    mapping is a plain dict over the model's item_keys."""
    config = keyed_config()
    model = build_model(config, seed=3)
    keys = model.item_keys
    assert keys.tolist()[:3] == [1, 4, 7]
    batch = Batch.concat(
        [user(0, [1, 2, 4, 10**12, int(keys[-1])], [7, 8, 0]), user(1, [int(keys[-1]) + 1], [int(keys[5])])]
    )
    with torch.no_grad():
        torch.testing.assert_close(model(batch), reference_forward(model, batch, item_ids="keys"), rtol=1e-5, atol=1e-5)


def test_every_unknown_id_reads_one_row_and_a_key_its_own():
    config = keyed_config()
    model = build_model(config, seed=3)
    with torch.no_grad():
        unknown_a = model(Batch.concat([user(0, [1, 4], [2])]))
        unknown_b = model(Batch.concat([user(0, [1, 4], [10**15])]))
        known = model(Batch.concat([user(0, [1, 4], [7])]))
    torch.testing.assert_close(unknown_a, unknown_b, rtol=0, atol=0)
    assert (known - unknown_a).abs().max() > 1e-4


def test_context_keys_are_per_feature_and_match_the_reference():
    """The same id reads another row in another feature; unknown pairs read the last row."""
    config = keyed_config(context_ids="keys")
    model = build_model(config, seed=3)
    per_feature = context_keys_of(model)
    assert [keys[:2] for keys in per_feature] == [[1, 4], [1, 4], [1, 4]]
    batch = Batch.concat(
        [
            user(0, [1, 4], [7], context=(1, 1, 1)),
            user(1, [1], [4], context=(4, 2, 10**12)),
            user(2, [4], [1], context=(2, 5, 7)),
        ]
    )
    with torch.no_grad():
        torch.testing.assert_close(
            model(batch), reference_forward(model, batch, item_ids="keys", context_ids="keys"), rtol=1e-5, atol=1e-5
        )
        same_id = model(Batch.concat([user(0, [1], [7], context=(1, 4, 7))]))
        swapped = model(Batch.concat([user(0, [1], [7], context=(4, 1, 7))]))
        unknown_a = model(Batch.concat([user(0, [1], [7], context=(2, 4, 7))]))
        unknown_b = model(Batch.concat([user(0, [1], [7], context=(5, 4, 7))]))
    assert (same_id - swapped).abs().max() > 1e-6  # the tiny model divides attention by S = 1024
    torch.testing.assert_close(unknown_a, unknown_b, rtol=0, atol=0)


def test_cached_equals_recompute_with_keys_under_eviction():
    config = keyed_config("keyed-parity", context_ids="keys", device_pages=21, host_pages=42)
    model = build_model(config, seed=1)
    cache = KVCacheManager(config)
    cache.reset()
    spec = WorkloadSpec(
        num_users=10,
        min_history_length=8,
        max_history_length=48,
        max_new_events=6,
        num_candidates=6,
        rewrite_fraction=0.15,
    )
    workload = Workload(config.model, spec, seed=2, item_keys=item_keys_of(model), context_keys=context_keys_of(model))
    keys, seen_known, seen_unknown = set(model.item_keys.tolist()), 0, 0
    for step in range(30):
        batch = workload.next_batch(batch_size=1 + step % 3)
        seen_known += sum(int(i) in keys for i in batch.item_ids.tolist())
        seen_unknown += sum(int(i) not in keys for i in batch.item_ids.tolist())
        with torch.no_grad():
            cached, full = CachedRanker(model).run(batch), model(batch)
        assert torch.allclose(cached, full, rtol=0, atol=1e-4), f"request {step}: cached != recompute"
    stats = cache.stats()
    cache.close()
    assert stats["device_evictions"] > 0 and stats["hit_tokens"] > 0
    assert seen_known > 0 and seen_unknown > 0


@pytest.mark.parametrize(
    ("item", "message"),
    [
        (-1, r"^item_ids has -1, outside the item vocabulary \[0, 9223372036854775806\]"),
        (MAX_ITEM_KEY, r"^item_ids has 9223372036854775807, outside the item vocabulary"),
    ],
)
def test_keys_mode_refuses_only_ids_outside_int64s_non_negative_range(item, message):
    config = keyed_config()
    model = build_model(config, seed=0)
    batch = random_batch(config.model, seed=1, history_lengths=[3], num_candidates=[2])
    batch.item_ids[1] = item
    with pytest.raises(ValueError, match=message):
        kv.check_request("keyed-refusal", model.config.request_limits_json(), *batch.tensors())


def test_context_keys_stop_below_two_to_the_56():
    config = keyed_config(context_ids="keys")
    model = build_model(config, seed=0)
    batch = Batch.concat([user(0, [1], [4], context=(1, MAX_CONTEXT_KEY, 3))])
    with pytest.raises(
        ValueError,
        match=r"^context_ids has 72057594037927936, outside the context vocabulary "
        r"\[0, 72057594037927935\]",
    ):
        kv.check_request("keyed-refusal", model.config.request_limits_json(), *batch.tensors())


def test_a_large_key_is_a_valid_request():
    config = keyed_config()
    model = build_model(config, seed=0)
    batch = Batch.concat([user(0, [2**62, 1], [2**62 + 5])])
    _, _, token_ids, _, candidate_ids = kv.check_request(
        "keyed-valid", model.config.request_limits_json(), *batch.tensors()
    )
    assert token_ids.tolist() == [1, 2, 3, 2**62, 0, 1, 1] and candidate_ids.tolist() == [2**62 + 5]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"item_ids": "keys", "item_vocab_size": 1}, r"^model.item_vocab_size must be >= 2 with model.item_ids: keys"),
        (
            {"context_ids": "keys", "num_contextual_features": 0},
            r"^model.num_contextual_features must be 1..128 with model.context_ids: keys",
        ),
    ],
)
def test_a_keyed_config_that_cannot_hold_keys_is_refused(fields, message):
    with pytest.raises(ConfigError, match=message):
        tiny_config(model=fields)


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        (torch.tensor([1, 4, 4]), r"item_keys must ascend strictly, but key 2 \(4\) follows 4$"),
        (torch.tensor([5, 3, 9]), r"item_keys must ascend strictly, but key 1 \(3\) follows 5$"),
        (torch.tensor([-2, 3, 9]), r"item_keys has a negative key \(-2\)$"),
        (torch.tensor([1.0, 2.0, 3.0]), r"item_keys must be int64, got float32$"),
        (torch.tensor([7, 2, 9]), r"context_keys must ascend strictly, but key 1 \(2\) follows 7$"),
    ],
)
def test_a_checkpoint_with_bad_keys_is_refused_in_one_line(tmp_path, keys, message):
    config = tiny_config(
        model={"item_ids": "keys", "item_vocab_size": 4, "context_ids": "keys", "context_vocab_size": 4}
    )
    model = build_model(config)
    path = tmp_path / "keys.pt"
    torch.save({**model.state_dict(), message.split()[0]: keys}, path)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(path, model)


def test_an_item_key_past_what_combined_event_tokens_carry_is_refused(tmp_path):
    """With event_tokens combined the action's bits leave items below 2^(63 - bits): a checkpoint
    key above that is a row no request could reach, refused by name."""
    model = build_model(tiny_config(model={"item_ids": "keys", "item_vocab_size": 4, "event_tokens": "combined"}))
    limit = model.config.model.item_id_limit
    path = tmp_path / "keys.pt"
    torch.save({**model.state_dict(), "item_keys": torch.tensor([1, 2, limit])}, path)
    with pytest.raises(
        CheckpointError,
        match=rf"item_keys holds {limit}, past the item ids this config's requests "
        rf"may carry \(below {limit}\)$",
    ):
        load_checkpoint(path, model)
