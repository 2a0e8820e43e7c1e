"""The Meta DlrmHSTU fixture and reference forward: the checkpoint written in the trainer's layout by
1 and 2 gloo processes reads back through kvexport's readers; the reference runs on what was read;
hand-computed pieces of the spec's formulas; properties a wrong reference would fail (the batch's
normaliser, query time, the contextual gate, the mask, every tensor read)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from kvexport.importers.dcp import read_metadata, read_tensors
from kvexport.importers.sharded import load_trainer_file
from tests.helpers.meta_fixture import (
    BATCH,
    FEATURES,
    POSITION_ROWS,
    SPARSE_KEY,
    TABLE_FQN,
    TABLE_ROWS,
    TIME_ROWS,
    synthetic_state,
    write_checkpoint,
)
from tests.helpers.meta_reference import (
    POST,
    PRE,
    action_features,
    attention_mask,
    dlrm_hstu_forward,
    position_indices,
    stu_layer,
    swish_layer_norm,
    time_buckets,
    time_features,
)
from tests.helpers.network import free_port

T0 = 1_699_200_000  # a whole hour (and a multiple of float32's 128 s step there): 2023-11-05 16:00 UTC
UNUSED = PRE + "_additional_embedding_mlp."  # DlrmHSTU skips it when no feature is "additional"


def user(
    contextual: list, num_history: int, candidates: list[int], bits: list[int], spacing: int, query_time: int = T0
) -> dict:
    """A user whose events are `spacing` seconds apart, the newest `spacing` before the query time."""
    return {
        "contextual": contextual,
        "history": [(7 * i + 3) % TABLE_ROWS["video_id"] for i in range(num_history)],
        "actions": [bits[i % len(bits)] for i in range(num_history)],
        "timestamps": [query_time - spacing * (num_history - i) for i in range(num_history)],
        "candidates": candidates,
        "query_time": query_time,
    }


def periods(state) -> tuple[torch.Tensor, torch.Tensor]:
    """The postprocessor's period buffers: seconds per unit, units per cycle."""
    dense, _ = state
    return dense[POST + "_period_units"], dense[POST + "_units_per_period"]


SHORT = user([3, 2], 5, [7, 8], [1, 2, 4, 5, 7], 9000)  # U + T = 7: user_active_degree's gate (6) open
LONG = user([9, 4], 14, [11], [3, 6, 0], 400)  # C + U = 16: the oldest event at the last position row
GATED = user([1, 1], 2, [5, 6], [1], 100)  # U + T = 4: user_active_degree zeroed


@pytest.fixture(scope="module")
def state():
    return synthetic_state()


@pytest.fixture(scope="module", params=[1, 2], ids=["world1", "world2"])
def written(request, tmp_path_factory) -> tuple[Path, int]:
    out = tmp_path_factory.mktemp(f"meta-world{request.param}")
    return write_checkpoint(out, request.param, free_port()), request.param


def read_back(root: Path) -> tuple[dict, dict]:
    """(dense_dict, tables by name) as kvexport's readers return them."""
    dense = load_trainer_file(root / "non_sparse.ckpt", "Meta checkpoint", part="dense_dict")["dense_dict"]
    sparse = read_tensors(root / "sparse")
    return dense, {name: sparse[SPARSE_KEY.format(name)] for name in TABLE_ROWS}


def test_non_sparse_ckpt_holds_the_trainers_entries_and_the_dense_state(written, state):
    root, _ = written
    assert root.name == str(BATCH) and sorted(p.name for p in root.iterdir()) == ["non_sparse.ckpt", "sparse"]
    saved = torch.load(root / "non_sparse.ckpt", weights_only=True)
    assert list(saved) == [
        "dense_dict",
        "optimizer_dict",
        "class_metrics",
        "reg_metrics",
        "global_step",
        "sparse_tensor_keys",
    ]
    assert saved["sparse_tensor_keys"] == {TABLE_FQN.format(name) for name in TABLE_ROWS}
    assert saved["global_step"] == {"train": BATCH, "eval": 0}
    dense, _ = read_back(root)
    expected, _ = state
    assert list(dense) == list(expected)
    for name, tensor in expected.items():
        assert dense[name].dtype == tensor.dtype and torch.equal(dense[name], tensor), name
    assert dense[PRE + "_action_encoder._combined_action_weights"].dtype == torch.int64


def test_sparse_is_a_dcp_of_row_sharded_float16_tables(written, state):
    root, world = written
    _, expected = state
    assert len(list((root / "sparse").glob("*.distcp"))) == world
    entries = read_metadata(root / "sparse").field("state_dict_metadata")
    assert set(entries) == {SPARSE_KEY.format(name) for name in TABLE_ROWS}
    assert all(len(entry.field("chunks")) == world for entry in entries.values())
    _, tables = read_back(root)
    for name, rows in expected.items():
        assert tables[name].dtype == torch.float16 and torch.equal(tables[name], rows), name


def test_the_reference_on_what_was_read_back_equals_it_on_what_was_written(written, state):
    dense, tables = read_back(written[0])
    logits = dlrm_hstu_forward(dense, tables, [SHORT, LONG, GATED], FEATURES)
    assert logits.shape == (5, 2) and logits.dtype == torch.float32
    assert torch.equal(logits, dlrm_hstu_forward(*state, [SHORT, LONG, GATED], FEATURES))


def test_positions_count_back_from_the_end_of_the_history():
    # C = 2, U = 3, T = 2: contextual 0, 1; events oldest first C + U - k + 1 = 5, 4, 3; candidates C = 2
    assert position_indices(2, 3, 2, 8192) == [0, 1, 5, 4, 3, 2, 2]
    assert position_indices(2, 3, 2, 5) == [0, 1, 4, 4, 3, 2, 2]  # capped at the last row, 4
    assert position_indices(2, 14, 1, POSITION_ROWS)[2] == POSITION_ROWS - 1  # LONG's oldest event: 16 -> 15


def test_time_buckets_are_the_truncated_root_of_minutes_before_the_query():
    query_time = 10_000
    timestamps = torch.tensor(
        [0, query_time - 240, query_time - 59, query_time - 539, query_time - 540, query_time, query_time + 500]
    )
    # minutes 166.7, 4, 0.98, 8.98, 9, 0 (1e-6), negative (1e-6): roots 12.9, 2, 0.99, 2.997, 3, ~0, ~0
    assert time_buckets(timestamps, query_time, 2049).tolist() == [12, 2, 0, 2, 3, 0, 0]
    assert time_buckets(timestamps, query_time, 10).tolist() == [9, 2, 0, 2, 3, 0, 0]


def test_time_features_are_hour_of_day_and_day_of_week_angles_of_float32_seconds():
    day = 19670 * 86400  # a day number divisible by 7
    taus = torch.tensor([day + 5 * 3600, day + 3 * 86400 + 18 * 3600 + 1800, day + 3 * 86400 + 18 * 3600])
    features = time_features(taus, torch.tensor([[3600.0, 86400.0]]), torch.tensor([[24.0, 7.0]]))
    # hour 5 of day 0; hour 18 of day 3; the last is 18:00 sharp, which float32 rounds 32 s down into hour 17
    for row, (hour, weekday) in zip(features.tolist(), [(5, 0), (18, 3), (17, 3)]):
        hour_angle, day_angle = hour / 24 * 2 * 3.14, weekday / 7 * 2 * 3.14
        expected = [math.cos(hour_angle), math.sin(hour_angle), math.cos(day_angle), math.sin(day_angle)]
        assert row == pytest.approx(expected, abs=1e-6)


def test_swish_layer_norm_multiplies_x_by_the_sigmoid_of_its_affine_norm():
    normed = 1 / math.sqrt(1 + 1e-5)  # [1, 3]: mean 2, variance 1, eps 1e-5
    out = swish_layer_norm(torch.tensor([1.0, 3.0]), torch.tensor([2.0, 1.0]), torch.tensor([0.0, 0.5]))
    expected = [1 / (1 + math.exp(2 * normed)), 3 / (1 + math.exp(-(normed + 0.5)))]
    assert out.tolist() == pytest.approx(expected, abs=1e-6)


def test_action_features_concatenate_the_rows_of_the_bits_an_event_has():
    table = torch.arange(24, dtype=torch.float32).reshape(3, 8) + 1
    out = action_features(torch.tensor([5, 2, 8]), torch.tensor([1, 2, 4]), table)
    zeros = torch.zeros(8)
    assert torch.equal(
        out, torch.stack([torch.cat([table[0], zeros, table[2]]), torch.cat([zeros, table[1], zeros]), torch.zeros(24)])
    )


def test_the_prefix_is_causal_and_candidates_see_it_and_themselves():
    assert attention_mask(5, 3).int().tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [1, 1, 1, 1, 0],
        [1, 1, 1, 0, 1],
    ]


def test_one_stu_layer_by_hand():
    """Two identical history tokens, H = 2, dv = 1, dqk = 2, W = 0 so that u, v, q, k are the
    bias's blocks in the order u | v | q | k, W_out = I so that the output shows [u, o, u * LN(o)]."""
    beta = torch.tensor([1.0, -1.0, 2.0, 3.0, 1.0, 0.5, 2.0, -1.0, 0.5, 1.0, -1.0, 0.25])
    dense = {
        "_input_norm_weight": torch.ones(6),
        "_input_norm_bias": torch.zeros(6),
        "_uvqk_weight": torch.zeros(6, 12),
        "_uvqk_beta": beta,
        "_output_norm_weight": torch.ones(2),
        "_output_norm_bias": torch.zeros(2),
        "_output_weight": torch.eye(6),
    }
    out = stu_layer(dense, "", torch.zeros(2, 6), num_prefix=2, num_heads=2, normaliser=4)

    def silu(z: float) -> float:
        return z / (1 + math.exp(-z))

    u = [silu(1.0), silu(-1.0)]  # only u is activated; v = [2, 3] stays raw
    # head 0: q.k = 1 * 0.5 + 0.5 * 1 = 1; head 1: 2 * -1 + -1 * 0.25 = -2.25; times 1 / sqrt(2), SiLU, / N
    scores = [silu(1 / math.sqrt(2)) / 4, silu(-2.25 / math.sqrt(2)) / 4]
    for token in range(2):  # token 0 sees itself, token 1 both
        o = [(token + 1) * scores[0] * 2.0, (token + 1) * scores[1] * 3.0]
        spread = (o[0] - o[1]) / 2
        normed = [spread / math.sqrt(spread**2 + 1e-6), -spread / math.sqrt(spread**2 + 1e-6)]
        assert out[token].tolist() == pytest.approx(u + o + [u[0] * normed[0], u[1] * normed[1]], abs=1e-6)


def test_a_users_logits_depend_on_the_batch_unless_the_normaliser_is_fixed(state):
    alone = dlrm_hstu_forward(*state, [SHORT], FEATURES)
    beside_long = dlrm_hstu_forward(*state, [SHORT, LONG], FEATURES)[:2]
    assert (alone - beside_long).abs().max() > 1e-4
    fixed = dlrm_hstu_forward(*state, [SHORT], FEATURES, normaliser=40)
    assert torch.equal(fixed, dlrm_hstu_forward(*state, [SHORT, LONG], FEATURES, normaliser=40)[:2])
    assert torch.equal(alone, dlrm_hstu_forward(*state, [SHORT], FEATURES, normaliser=2 + 5 + 2))


def test_the_normaliser_is_the_padded_batch_maximum_not_the_longest_sequence(state):
    # SHORT: 2 + 5 + 2 = 9 tokens, LONG: 2 + 14 + 1 = 17; padded: C + max U + max T = 2 + 14 + 2 = 18
    batch = dlrm_hstu_forward(*state, [SHORT, LONG], FEATURES)
    assert torch.equal(batch, dlrm_hstu_forward(*state, [SHORT, LONG], FEATURES, normaliser=18))
    assert (batch - dlrm_hstu_forward(*state, [SHORT, LONG], FEATURES, normaliser=17)).abs().max() > 1e-5


def test_candidates_see_neither_each_other_nor_are_seen_by_the_history(state):
    both = dlrm_hstu_forward(*state, [SHORT], FEATURES, normaliser=30)
    for kept in range(2):
        one = dict(SHORT, candidates=[SHORT["candidates"][kept]])
        assert torch.allclose(dlrm_hstu_forward(*state, [one], FEATURES, normaliser=30)[0], both[kept], atol=1e-6)


def test_moving_the_query_time_within_the_hour_moves_the_time_buckets(state):
    moved = dict(SHORT, query_time=T0 + 1280)  # the same events; the same hour and day for the candidates
    assert torch.equal(
        time_features(torch.tensor([T0]), *periods(state)), time_features(torch.tensor([T0 + 1280]), *periods(state))
    )
    stamps = torch.tensor(SHORT["timestamps"])
    assert not torch.equal(time_buckets(stamps, T0, TIME_ROWS), time_buckets(stamps, T0 + 1280, TIME_ROWS))
    logits = dlrm_hstu_forward(*state, [SHORT], FEATURES)
    assert (logits - dlrm_hstu_forward(*state, [moved], FEATURES)).abs().max() > 1e-4


def test_moving_the_query_time_an_hour_moves_the_postprocessors_angles(state):
    # events over 17 hours back: every bucket is at the cap (33 rows: sqrt(minutes) >= 32) before and after.
    # T0 + 3600 would stay in T0's hour: float32 rounds it 16 s down. T0 + 3840 (30 steps of 128 s) does not.
    later = T0 + 3840
    old = user([3, 2], 5, [7, 8], [1, 2, 4, 5, 7], 70_000)
    moved = dict(old, query_time=later)
    assert torch.equal(
        time_features(torch.tensor([T0 + 3600]), *periods(state)), time_features(torch.tensor([T0]), *periods(state))
    )
    stamps = torch.tensor([0] + old["timestamps"])
    capped = [TIME_ROWS - 1] * 6
    assert time_buckets(stamps, T0, TIME_ROWS).tolist() == time_buckets(stamps, later, TIME_ROWS).tolist() == capped
    logits = dlrm_hstu_forward(*state, [old], FEATURES)
    assert (logits - dlrm_hstu_forward(*state, [moved], FEATURES)).abs().max() > 1e-4


def test_a_gated_contextual_feature_is_zeroed_while_history_and_candidates_are_short(state):
    def with_degree(person: dict, degree: int) -> torch.Tensor:
        return dlrm_hstu_forward(
            *state, [dict(person, contextual=[person["contextual"][0], degree])], FEATURES, normaliser=30
        )

    assert torch.equal(with_degree(GATED, 1), with_degree(GATED, 4))  # U + T = 4 < 6
    opened = dict(GATED, candidates=[5, 6, 9, 10])  # U + T = 6: the candidates count
    assert (with_degree(opened, 1) - with_degree(opened, 4)).abs().max() > 1e-5


def test_every_dense_tensor_and_table_the_inputs_read_moves_the_logits(state):
    dense, tables = state
    batch = [SHORT, LONG, GATED]
    logits = dlrm_hstu_forward(dense, tables, batch, FEATURES)
    g = torch.Generator().manual_seed(1)

    def nudged(t: torch.Tensor) -> torch.Tensor:
        if not t.is_floating_point():
            return t * 2  # action bits 2, 4, 8: bit 1 is no longer seen
        return (t.float() + 0.1 * (1 + torch.rand(t.shape, generator=g))).to(t.dtype)

    for name, tensor in dense.items():
        moved = dlrm_hstu_forward(dict(dense, **{name: nudged(tensor)}), tables, batch, FEATURES)
        if name.startswith(UNUSED):
            assert torch.equal(moved, logits), name
        else:
            assert (moved - logits).abs().max() > 1e-4, name
    for name, rows in tables.items():
        moved = dlrm_hstu_forward(dense, dict(tables, **{name: nudged(rows)}), batch, FEATURES)
        assert (moved - logits).abs().max() > 1e-4, name
