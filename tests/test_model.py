"""Eager model against the plain-PyTorch reference, and its independence properties."""

from __future__ import annotations

import pytest
import torch

from kvexport.model import Batch, random_batch
from kvexport.model.batch import sample_batch
from kvexport.model.hstu import prefix_tokens
from kvexport.options import SampleOptions
from tests.helpers.reference import reference_forward

SHAPES = [
    ([1], [1]),  # B=1, one event, one candidate
    ([7], [5]),  # B=1, many of each
    ([1, 9, 4], [3, 1, 6]),  # B>1, mixed
    ([12, 1, 30, 2], [1, 1, 8, 2]),
]


@pytest.mark.parametrize("histories,candidates", SHAPES)
def test_model_matches_reference(tiny_model, tiny_config, histories, candidates):
    batch = random_batch(tiny_config.model, seed=len(histories), history_lengths=histories, num_candidates=candidates)
    with torch.no_grad():
        got = tiny_model(batch)
        want = reference_forward(tiny_model, batch)
    assert got.shape == (sum(candidates), tiny_config.model.num_tasks)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_sample_batch_is_sized_by_the_trace(tiny_config):
    """User i has 8 (i + 1) events up to trace.max_trace_history_length (96) and
    trace.num_candidates (8) candidates; the seed decides the ids."""
    batch = sample_batch(tiny_config, SampleOptions(num_users=13, seed=1))
    assert batch.user_ids.tolist() == list(range(13))
    assert batch.history_lengths.tolist() == [8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 96]
    assert batch.num_candidates.tolist() == [8] * 13
    assert torch.equal(sample_batch(tiny_config, SampleOptions(num_users=13, seed=1)).item_ids, batch.item_ids)
    assert not torch.equal(sample_batch(tiny_config, SampleOptions(num_users=13, seed=2)).item_ids, batch.item_ids)


def test_prefix_tokens_layout():
    history_lengths = torch.tensor([2, 1])
    items, actions = torch.tensor([10, 11, 12]), torch.tensor([1, 2, 3])
    context = torch.tensor([[100, 101], [200, 201]])
    token_ids, positions, lengths, users = prefix_tokens(history_lengths, items, actions, context)
    assert token_ids.tolist() == [100, 101, 10, 1, 11, 2, 200, 201, 12, 3]
    assert positions.tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2, 3]
    assert lengths.tolist() == [6, 4]
    assert users.tolist() == [0] * 6 + [1] * 4


def test_candidates_do_not_see_each_other(tiny_model, tiny_config):
    batch = random_batch(tiny_config.model, seed=3, history_lengths=[5, 6], num_candidates=[4, 3])
    changed = batch.candidate_ids.clone()
    changed[1] = (changed[1] + 1) % tiny_config.model.item_vocab_size
    with torch.no_grad():
        before = tiny_model(batch)
        after = tiny_model(Batch(**{**batch.to_dict(), "candidate_ids": changed}))
    others = [i for i in range(7) if i != 1]
    assert torch.equal(before[others], after[others])
    assert not torch.equal(before[1], after[1])


def test_user_logits_do_not_depend_on_batch_mates(tiny_model, tiny_config):
    batch = random_batch(tiny_config.model, seed=4, history_lengths=[3, 8, 2], num_candidates=[2, 5, 1])
    single = Batch(
        user_ids=batch.user_ids[1:2],
        history_lengths=batch.history_lengths[1:2],
        item_ids=batch.item_ids[3:11],
        action_ids=batch.action_ids[3:11],
        context_ids=batch.context_ids[1:2],
        num_candidates=batch.num_candidates[1:2],
        candidate_ids=batch.candidate_ids[2:7],
    )
    with torch.no_grad():
        together = tiny_model(batch)[2:7]
        by_itself = tiny_model(single)
    torch.testing.assert_close(together, by_itself, rtol=1e-5, atol=1e-6)


def test_a_batch_splits_into_the_users_it_was_built_from(tiny_config):
    from kvexport.model.batch import random_user

    generator = torch.Generator().manual_seed(4)
    users = [random_user(tiny_config.model, generator, uid, n, t) for uid, n, t in ((3, 5, 2), (9, 0, 1), (1, 7, 4))]
    for got, want in zip(Batch.concat(users).users(), users, strict=True):
        assert got.user_id == want.user_id
        for name in ("item_ids", "action_ids", "context_ids", "candidate_ids"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name
