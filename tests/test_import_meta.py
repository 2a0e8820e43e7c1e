"""Meta DLRMv3's dense state folded into kvexport's tables and mapped onto its layers
(kvexport.importers.meta_dlrmv3), against the independent reference of DlrmHSTU
(tests/helpers/meta_reference.py) on the synthetic checkpoint's weights (tests/helpers/meta_fixture.py)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from kvexport.importers import CheckpointImportError
from kvexport.importers import meta_dlrmv3 as meta
from kvexport.model.hstu import HSTULayer, jagged_attention
from tests.helpers.configs import tiny_config
from tests.helpers.meta_fixture import DEFAULT_SIZES, FEATURES, dense_state, synthetic_state
from tests.helpers.meta_reference import PRE, STU, Rules, contextual_tokens, event_tokens, layer_inputs, stu_layer

USER = {
    "contextual": [3, 4],
    "history": [5, 17, 2, 39],
    "actions": [0, 7, 2, 5],
    "timestamps": [1, 2, 3, 4],
    "candidates": [8, 17, 30],
    "query_time": 10,
}
EQUAL_WIDTHS = dataclasses.replace(DEFAULT_SIZES, DQK=4, DV=4)  # what kvexport's cache can hold


@pytest.fixture(scope="module")
def state():
    return synthetic_state(seed=5)


def test_folded_item_and_action_rows_are_the_events_tokens(state):
    """An event's token is its item's folded row plus its action value's (event_tokens: combined)."""
    dense, tables = state
    items = meta.item_rows(dense, tables["video_id"].float())
    actions = meta.action_rows(dense)
    assert actions.shape == (meta.action_vocab_size(dense), DEFAULT_SIZES.D) == (8, 8)
    history = torch.tensor(USER["history"])
    folded = items[history] + actions[torch.tensor(USER["actions"])]
    expected = event_tokens(dense, tables, FEATURES, USER)
    torch.testing.assert_close(folded, expected[: len(USER["history"])], rtol=1e-5, atol=1e-5)
    candidates = items[torch.tensor(USER["candidates"])] + meta.candidate_action(dense)
    torch.testing.assert_close(candidates, expected[len(USER["history"]) :], rtol=1e-5, atol=1e-5)


def test_folded_context_rows_are_the_contextual_tokens(state):
    dense, tables = state
    folded = torch.stack(
        [
            meta.context_rows(dense, c, tables[table][USER["contextual"][c]][None])[0]
            for c, table in enumerate(FEATURES.contextual_tables)
        ]
    ) + meta.context_bias(dense)
    # A merged length past every gate: the gate is the reference's, not a folded row's.
    torch.testing.assert_close(
        folded, contextual_tokens(dense, tables, FEATURES, USER["contextual"], 99), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("times", ["zero", "none"])
def test_folded_tables_give_the_references_layer_inputs_under_the_per_user_rules(state, times):
    """kvexport's first-layer inputs from the folded tables (event_tokens combined, candidate_position
    shared_row: token row x sqrt(D) + its position row) equal the reference's under the rules the
    position table folds: positions from the config's max history, a constant history time row.
    The query time is a day past the epoch's first (time rows)^2 minutes, so contextual tokens' age
    is capped as the fold assumes."""
    dense, tables = state
    max_history, contextual = 6, len(FEATURES.contextual_tables)
    user = {**USER, "query_time": 86_400 + 60 * DEFAULT_SIZES.TIME_ROWS**2}
    rows = meta.position_rows(dense, contextual, max_history, 0 if times == "zero" else None)
    assert rows.shape == (contextual + max_history + 1, DEFAULT_SIZES.D)
    items, actions = meta.item_rows(dense, tables["video_id"].float()), meta.action_rows(dense)
    context = torch.stack(
        [
            meta.context_rows(dense, c, tables[table][user["contextual"][c]][None])[0]
            for c, table in enumerate(FEATURES.contextual_tables)
        ]
    )
    tokens = torch.cat(
        [
            context,
            items[torch.tensor(user["history"])] + actions[torch.tensor(user["actions"])],
            items[torch.tensor(user["candidates"])],
        ]
    )
    slots = [*range(contextual + len(user["history"]))] + [rows.shape[0] - 1] * len(user["candidates"])
    got = tokens * math.sqrt(DEFAULT_SIZES.D) + rows[slots]
    expected = layer_inputs(
        dense, tables, FEATURES, user, Rules(positions="from_max", times=times, max_history=max_history)
    )
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)


def test_action_values_fold_for_any_weights():
    """Weights that are not one bit each (upstream tests every action weight with a bitwise and)."""
    dense = dense_state(seed=2)
    dense[meta.ACTION_WEIGHTS] = torch.tensor([1, 6, 8])
    assert meta.action_vocab_size(dense) == 16
    rows = meta.action_rows(dense)
    # 6 shares a bit with 2 and with 4, so values 2, 4 and 6 read the same rows; 8 alone adds its row.
    torch.testing.assert_close(rows[2], rows[4])
    torch.testing.assert_close(rows[2], rows[6])
    assert (rows[9] - rows[1]).abs().max() > 1e-4


def kvexport_layer(dense: dict, index: int) -> HSTULayer:
    config = tiny_config(
        model={
            "hidden_size": EQUAL_WIDTHS.D,
            "num_heads": EQUAL_WIDTHS.HEADS,
            "head_dim": EQUAL_WIDTHS.DV,
            "silu_on": "u",
            "layer_output": "concat",
            "layer_norm_eps": meta.LAYER_EPS,
        }
    )
    layer = HSTULayer(config.model)
    layer.load_state_dict(meta.layer_state(dense, index, EQUAL_WIDTHS.HEADS))
    return layer


@pytest.mark.parametrize("index", [0, 1])
def test_a_mapped_layer_computes_the_stu_layer(index):
    """kvexport's layer with the mapped state, its attention at a fixed N, against the reference's STU
    layer on one user's tokens: 2 contextual + 5 events, then 3 candidates."""
    dense = dense_state(seed=3, sizes=EQUAL_WIDTHS)
    x = torch.randn(10, EQUAL_WIDTHS.D, generator=torch.Generator().manual_seed(index))
    num_prefix, normaliser = 7, 13
    layer = kvexport_layer(dense, index)
    with torch.no_grad():
        u, v, q, k = layer.project(x)
        o = jagged_attention(
            q, k, v, torch.tensor([0, 10]), torch.tensor([num_prefix]), 1.0 / math.sqrt(EQUAL_WIDTHS.DV), normaliser
        )
        got = layer.finish(x, u, o)
    expected = stu_layer(
        {k_: t.float() for k_, t in dense.items()}, f"{STU}{index}.", x, num_prefix, EQUAL_WIDTHS.HEADS, normaliser
    )
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_layers_of_other_qk_width_and_missing_or_misshapen_tensors_are_refused_by_name():
    with pytest.raises(
        CheckpointImportError,
        match=rf"{STU}0\._uvqk_weight has shape \[8, 28\]: q/k heads of "
        r"another width than u/v's \(8 values\)",
    ):
        meta.layer_state(dense_state(), 0, DEFAULT_SIZES.HEADS)
    dense = dense_state(sizes=EQUAL_WIDTHS)
    del dense[f"{STU}1._output_weight"]
    with pytest.raises(CheckpointImportError, match=rf"^checkpoint lacks {STU}1\._output_weight$"):
        meta.layer_state(dense, 1, EQUAL_WIDTHS.HEADS)
    dense = dense_state()
    dense[PRE + "_content_embedding_mlp.1.weight"] = torch.ones(3)
    with pytest.raises(
        CheckpointImportError, match=r"_content_embedding_mlp\.1\.weight has shape \[3\], expected \[10\]"
    ):
        meta.item_rows(dense, torch.zeros(2, DEFAULT_SIZES.E))
    dense = dense_state()
    dense[meta.ACTION_WEIGHTS] = torch.tensor([True, False])
    with pytest.raises(CheckpointImportError, match="must be a 1-D integer tensor"):
        meta.action_rows(dense)
    with pytest.raises(CheckpointImportError, match="time row 99 is not one of"):
        meta.position_rows(dense_state(), 2, 6, history_time_row=99)
    del dense[meta.ACTION_WEIGHTS]
    with pytest.raises(CheckpointImportError, match="a DlrmHSTU without actions"):
        meta.action_rows(dense)
    assert meta.num_layers(dense_state()) == DEFAULT_SIZES.LAYERS
