"""model.head: item_tower (DLRMv3's head): the query time's calendar code computed alike by the op
library, the model and an independent float32 reference; the head against the plain-PyTorch
reference; requests and configs refused by name."""

from __future__ import annotations

import pytest
import torch
import yaml

from kvexport.cached import CachedRanker
from kvexport.config import ConfigError, config_from_dict
from kvexport.errors import RequestError
from kvexport.host.requests import check_user_request
from kvexport.model import build_model, random_batch
from kvexport.model.batch import Batch, UserRequest
from kvexport.model.hstu import time_codes
from kvexport.ops import wrappers as kv
from tests.helpers.artifacts import assert_verifies_and_replays
from tests.helpers.configs import ITEM_TOWER, tiny_raw
from tests.helpers.reference import reference_forward, time_code


def tower_raw(**fields) -> dict:
    """hstu-tiny with the item-tower head and these model fields."""
    return tiny_raw(model={**ITEM_TOWER, **fields})


@pytest.fixture(scope="module")
def tower_config():
    return config_from_dict(tower_raw())


@pytest.fixture(scope="module")
def tower_model(tower_config):
    model = build_model(tower_config, seed=4)
    with torch.no_grad():  # norms off their identity init, so a swapped weight and bias show
        for name, parameter in model.head.named_parameters():
            if "norm" in name:
                parameter.uniform_(0.5, 1.5)
    return model


def boundary_times() -> list[int]:
    """Seconds around hour and day boundaries, where float32's 128-second steps decide the side."""
    times = []
    for boundary in (1_600_000_000 // 86400 * 86400 + 86400 * d + 3600 * h for d in range(8) for h in (0, 1, 23)):
        times += [boundary + delta for delta in (-193, -129, -64, -63, -1, 0, 1, 63, 64, 65, 127, 128, 191)]
    return times + [0, 59, 3599, 3600, 86399, 86400, 2**31, 2**40 + 12345]


def test_op_library_model_and_reference_agree_on_codes(tower_config):
    times = boundary_times()
    expected = [time_code(t, ITEM_TOWER["query_time_periods"]) for t in times]
    assert torch.equal(time_codes(torch.tensor(times), tower_config.model.query_time_periods), torch.tensor(expected))
    n = len(times)
    batch = Batch(
        user_ids=torch.arange(n),
        history_lengths=torch.ones(n, dtype=torch.int64),
        item_ids=torch.zeros(n, dtype=torch.int64),
        action_ids=torch.zeros(n, dtype=torch.int64),
        context_ids=torch.cat([torch.zeros(n, 3, dtype=torch.int64), torch.tensor(times)[:, None]], 1),
        num_candidates=torch.ones(n, dtype=torch.int64),
        candidate_ids=torch.arange(n) + 5,
    )
    raw = tower_raw()
    raw["serving"]["max_batch_size"] = n
    checked = kv.check_request("codes", config_from_dict(raw).request_limits_json(), *batch.tensors())[4]
    bits = tower_config.model.time_code_bits
    assert bits == 8
    assert torch.equal(checked >> bits, torch.arange(n) + 5)
    assert torch.equal(checked & 255, torch.tensor(expected))
    # Upstream's float32 seconds put some times within a minute of an hour in the next or last one.
    exact = [t // 3600 % 24 * 7 + t // 86400 % 7 for t in times]
    assert 0 < sum(e != x for e, x in zip(expected, exact)) < len(times) // 2


def test_head_matches_the_reference_and_reads_time_and_tower(tower_model, tower_config):
    batch = random_batch(tower_config.model, seed=3, history_lengths=[1, 9, 4], num_candidates=[3, 1, 6])
    periods = tower_config.model.query_time_periods
    with torch.no_grad():
        got = tower_model(batch)
        torch.testing.assert_close(
            got,
            reference_forward(tower_model, batch, head="item_tower", query_time_periods=periods),
            rtol=1e-5,
            atol=1e-5,
        )
        context = batch.context_ids.clone()
        context[:, -1] += 3600  # the next hour
        later = tower_model(Batch(**{**batch.to_dict(), "context_ids": context}))
        context[:, -1] = batch.context_ids[:, -1] // 3600 * 3600 + 1800  # the same hour, another minute
        same_hour = tower_model(Batch(**{**batch.to_dict(), "context_ids": context}))
        tower = tower_model.head.tower_embedding.weight
        tower[batch.candidate_ids[0]] += 1.0
        other_tower = tower_model(batch)
        tower[batch.candidate_ids[0]] -= 1.0
    assert (later - got).abs().amin(dim=1).max() > 1e-4
    torch.testing.assert_close(same_hour, got, rtol=0, atol=0)
    assert (other_tower[0] - got[0]).abs().max() > 1e-4 and torch.equal(other_tower[1:], got[1:])


def test_cached_path_matches_recompute_as_the_query_time_moves(tower_model, tower_config):
    from kvexport.ops.manager import KVCacheManager

    cache = KVCacheManager(tower_config)
    cache.reset()
    batch = random_batch(tower_config.model, seed=5, history_lengths=[12, 30], num_candidates=[4, 2])
    try:
        with torch.no_grad():
            for hours in range(4):
                context = batch.context_ids.clone()
                context[:, -1] += 3600 * hours
                request = Batch(**{**batch.to_dict(), "context_ids": context})
                torch.testing.assert_close(
                    CachedRanker(tower_model).run(request), tower_model(request), rtol=0, atol=1e-5
                )
        stats = cache.stats()
    finally:
        cache.close()
    prefix = 2 * 3 + 2 * (12 + 30)  # C + 2h a user, pairs: the query time is no token
    assert stats["hit_tokens"] == 3 * prefix


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda c: c[:, :-1], "context_ids has 3 features, the model has 3 and the query time"),
        (lambda c: torch.cat([c[:, :-1], -c[:, -1:]], 1), "context_ids' query time has -"),
    ],
)
def test_a_request_without_a_valid_query_time_is_refused(tower_config, change, message):
    batch = random_batch(tower_config.model, seed=3, history_lengths=[2], num_candidates=[1])
    bad = {**batch.to_dict(), "context_ids": change(batch.context_ids)}
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        kv.check_request("refusals", tower_config.request_limits_json(), *Batch(**bad).tensors())


def test_a_user_request_names_the_query_time(tower_config):
    user = UserRequest(1, torch.tensor([1]), torch.tensor([0]), torch.tensor([1, 2, 3]), torch.tensor([4]))
    with pytest.raises(
        RequestError,
        match="context_ids has 3 entries, the model takes 4 .its contextual features, then the query time.",
    ):
        check_user_request(user, tower_config, 0)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"head": "mlp"}, "model.query_time_periods is read only by model.head: item_tower"),
        ({"query_time_periods": []}, "model.query_time_periods must name at least one"),
        ({"query_time_periods": [[3600]]}, "model.query_time_periods must be a list of .int, int. pairs"),
        ({"query_time_periods": [[0, 24]]}, r"model.query_time_periods: \[0, 24\] must be positive"),
        ({"query_time_periods": [[60, 1000], [3600, 1000]]}, "make 1000000 codes; an item_tower head reads 2 to 65536"),
        ({"query_time_periods": [[3600, 1]]}, "make 1 codes; an item_tower head reads 2 to 65536"),
        ({"head_activation": "relu"}, "model.head_activation applies to model.head: mlp"),
    ],
)
def test_an_unusable_head_config_is_refused_by_name(fields, message):
    raw = tower_raw()
    raw["model"].update(fields)
    with pytest.raises(ConfigError, match=message):
        config_from_dict(raw)


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_item_tower_and_whole_prefix_context_on_the_gpu(tmp_path):
    """DLRMv3's switches and contextual rows reading the whole prefix, built for CUDA: verify passes
    (package, eager cached and full recompute against the float32 reference), and the C++ replay
    through the model and through CUDA graphs."""
    from kvexport.export.build import build_artifact
    from kvexport.model.checkpoint import save_checkpoint

    # A small S and larger projections, so that what the contextual rows read moves the logits well
    # past verify's tolerance (tests/test_cache_parity.py checks that it does).
    raw = tower_raw(
        event_tokens="combined",
        candidate_position="shared_row",
        silu_on="u",
        layer_output="concat",
        context_attention="whole_prefix",
        scaling_seqlen=4,
    )
    raw["name"] = "tower-gpu"
    config = tmp_path / "tower.yaml"
    config.write_text(yaml.safe_dump(raw))
    model = build_model(config_from_dict(raw), seed=2)
    with torch.no_grad():
        for layer in model.layers:
            layer.uvqk.weight.mul_(4)
            layer.output.weight.mul_(4)
    save_checkpoint(model, tmp_path / "tower.pt")
    package = build_artifact(config, tmp_path / "package", checkpoint=tmp_path / "tower.pt", device="cuda")
    assert_verifies_and_replays(package, tmp_path)
