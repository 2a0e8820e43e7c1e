"""Meta generative-recommenders DLRMv3 (`DlrmHSTU`) dense state -> kvexport's tables and layers.

Most of DlrmHSTU's input side is a function of one id at a time (docs/importers.md, *How the
import can be built*), so it folds into kvexport's tables instead of running in the package:
- an item's token part is `content MLP(item row)`: a row of kvexport's item table;
- an event's action part is `action MLP(the 8-wide rows of the action bits it has, concatenated)`,
  a function of its action value alone: a row of kvexport's action table for every value the
  action weights can make (model.event_tokens: combined adds it to the item's row);
- contextual feature c's token is `row @ W_c + b_c`: a row of kvexport's keyed context table;
- every candidate's action part is the action MLP of the one target row: a constant vector.
The layers map onto kvexport's HSTU layer with silu_on u, layer_output concat (its output bias
zero) and layer_norm_eps 1e-6; DlrmHSTU stores `x @ W` as [in, out], kvexport's Linear [out, in].

Each MLP is Linear, SwishLayerNorm (x * sigmoid(LN(x)), LN with its own affine), Linear,
LayerNorm, its norms at eps 1e-5, computed here in float32 once per row at import. A tensor that
is missing, of another shape or not floating point is refused in one line naming it.
"""

from __future__ import annotations

from typing import Any

import math

import torch
from torch.nn import functional as F

from kvexport.importers import CheckpointImportError

STU = "_hstu_transducer._stu_module._stu_layers."
PRE = "_hstu_transducer._input_preprocessor."
ACTION_WEIGHTS = PRE + "_action_encoder._combined_action_weights"
ACTION_ROWS = PRE + "_action_encoder._action_embedding_table"
TARGET_ROW = PRE + "_action_encoder._target_action_embedding_table"
CONTEXT_WEIGHTS = PRE + "_batched_contextual_linear_weights"
CONTEXT_BIAS = PRE + "_batched_contextual_linear_bias"
CONTENT_MLP = PRE + "_content_embedding_mlp."
POSITIONS = "_hstu_transducer._positional_encoder._position_embeddings_weight"
TIMES = "_hstu_transducer._positional_encoder._timestamp_embeddings_weight"
ACTION_MLP = PRE + "_action_embedding_mlp."
MLP_EPS = 1e-5  # DlrmHSTU's embedding MLPs, postprocessor and head norms
LAYER_EPS = 1e-6  # its STU layers' norms
# Action values past this many bits are refused: kvexport's action table holds a row for each.
MAX_ACTION_BITS = 16


def _refuse(message: str) -> None:
    raise CheckpointImportError(message)


def tensor(dense: dict[str, Any], key: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """dense_dict[key] as float32, refused by name when missing, misshapen or not floating point."""
    if key not in dense:
        _refuse(f"checkpoint lacks {key}")
    value = dense[key]
    if not isinstance(value, torch.Tensor) or not value.dtype.is_floating_point:
        _refuse(f"{key} is {type(value).__name__ if not isinstance(value, torch.Tensor) else value.dtype}, "
                "not a floating-point tensor")
    if shape is not None and tuple(value.shape) != shape:
        _refuse(f"{key} has shape {list(value.shape)}, expected {list(shape)}")
    return value.float()


def _layer_norm(dense: dict[str, Any], prefix: str, x: torch.Tensor, eps: float) -> torch.Tensor:
    width = x.shape[-1]
    weight, bias = tensor(dense, prefix + "weight", (width,)), tensor(dense, prefix + "bias", (width,))
    return F.layer_norm(x, (width,), weight, bias, eps)


def mlp(dense: dict[str, Any], prefix: str, x: torch.Tensor) -> torch.Tensor:
    """DlrmHSTU's embedding MLP (Linear, SwishLayerNorm, Linear, LayerNorm) on rows x [n, in]."""
    first = tensor(dense, prefix + "0.weight")
    if first.dim() != 2 or first.shape[1] != x.shape[1]:
        _refuse(f"{prefix}0.weight has shape {list(first.shape)}; its inputs have {x.shape[1]} values")
    hidden = F.linear(x, first, tensor(dense, prefix + "0.bias", (first.shape[0],)))
    hidden = hidden * torch.sigmoid(_layer_norm(dense, prefix + "1.", hidden, MLP_EPS))
    second = tensor(dense, prefix + "2.weight")
    if second.dim() != 2 or second.shape[1] != hidden.shape[1]:
        _refuse(f"{prefix}2.weight has shape {list(second.shape)}; its inputs have {hidden.shape[1]} values")
    out = F.linear(hidden, second, tensor(dense, prefix + "2.bias", (second.shape[0],)))
    return _layer_norm(dense, prefix + "3.", out, MLP_EPS)


def item_rows(dense: dict[str, Any], rows: torch.Tensor) -> torch.Tensor:
    """kvexport item-table rows [n, D] of trainer item-table rows [n, E]: their content MLP."""
    return mlp(dense, CONTENT_MLP, rows.float())


def action_weights(dense: dict[str, Any]) -> list[int]:
    """The action encoder's weights: the value each action adds to an event's action value."""
    if ACTION_WEIGHTS not in dense:
        _refuse(f"checkpoint lacks {ACTION_WEIGHTS} (a DlrmHSTU without actions, which kvexport does not import)")
    weights = dense[ACTION_WEIGHTS]
    if not isinstance(weights, torch.Tensor) or weights.dim() != 1 or weights.dtype not in (torch.int32, torch.int64):
        _refuse(f"{ACTION_WEIGHTS} must be a 1-D integer tensor")
    values = weights.tolist()
    if not values or min(values) <= 0 or max(values).bit_length() > MAX_ACTION_BITS:
        _refuse(f"{ACTION_WEIGHTS} holds {values}; kvexport imports positive weights below 2^{MAX_ACTION_BITS}")
    return values


def action_vocab_size(dense: dict[str, Any]) -> int:
    """Action values a request may carry: every value the weights' bits can make."""
    combined = 0
    for weight in action_weights(dense):
        combined |= weight
    return 1 << combined.bit_length()


def _action_features(dense: dict[str, Any], values: torch.Tensor) -> torch.Tensor:
    """[n, 8 nA]: for each action k, its 8-wide row where the value has any of weight k's bits."""
    weights = torch.tensor(action_weights(dense), dtype=torch.int64)
    table = tensor(dense, ACTION_ROWS)
    if table.dim() != 2 or table.shape[0] != weights.shape[0]:
        _refuse(f"{ACTION_ROWS} has shape {list(table.shape)}; {ACTION_WEIGHTS} names {weights.shape[0]} actions")
    hits = (values[:, None] & weights[None, :]) != 0
    return (hits[..., None] * table[None]).flatten(1)


def action_rows(dense: dict[str, Any]) -> torch.Tensor:
    """kvexport action-table rows [action_vocab_size, D]: the action MLP of each action value's bits."""
    values = torch.arange(action_vocab_size(dense), dtype=torch.int64)
    return mlp(dense, ACTION_MLP, _action_features(dense, values))


def candidate_action(dense: dict[str, Any]) -> torch.Tensor:
    """[D]: the action part every candidate's token shares (the action MLP of the target row)."""
    table = tensor(dense, ACTION_ROWS)
    target = tensor(dense, TARGET_ROW, (1, table.numel()))
    return mlp(dense, ACTION_MLP, target)[0]


def context_rows(dense: dict[str, Any], feature: int, rows: torch.Tensor) -> torch.Tensor:
    """kvexport context-table rows [n, D] of contextual feature `feature`'s table rows [n, E]."""
    weights, bias = tensor(dense, CONTEXT_WEIGHTS), tensor(dense, CONTEXT_BIAS)
    if weights.dim() != 3 or not 0 <= feature < weights.shape[0] or rows.shape[1] != weights.shape[1]:
        _refuse(f"{CONTEXT_WEIGHTS} has shape {list(weights.shape)}: no map of {rows.shape[1]} values for "
                f"contextual feature {feature}")
    if tuple(bias.shape) != (weights.shape[0], weights.shape[2]):
        _refuse(f"{CONTEXT_BIAS} has shape {list(bias.shape)}, expected {[weights.shape[0], weights.shape[2]]}")
    return rows.float() @ weights[feature] + bias[feature]


def num_layers(dense: dict[str, Any]) -> int:
    return sum(1 for key in dense if key.startswith(STU) and key.endswith("._uvqk_weight"))


def layer_state(dense: dict[str, Any], index: int, num_heads: int) -> dict[str, torch.Tensor]:
    """kvexport's HSTULayer state (uvqk, input_norm, attention_norm, output) of STU layer `index`.

    DlrmHSTU projects [u | v | q | k] (widths dv H, dv H, dqk H, dqk H), heads contiguous in each,
    as kvexport does when dqk == dv; a layer with dqk != dv is refused (kvexport's cache holds k and
    v of one width; every DLRMv3 config has 128 and 128)."""
    p = f"{STU}{index}."
    uvqk = tensor(dense, p + "_uvqk_weight")
    if uvqk.dim() != 2:
        _refuse(f"{p}_uvqk_weight has shape {list(uvqk.shape)}, not [D, (2 dv + 2 dqk) H]")
    hidden = uvqk.shape[0]
    value_width = tensor(dense, p + "_output_norm_weight").shape[0]  # dv H
    if uvqk.shape[1] != 4 * value_width:
        _refuse(f"{p}_uvqk_weight has shape {list(uvqk.shape)}: q/k heads of another width than u/v's "
                f"({value_width} values), which kvexport's cache cannot hold")
    if value_width % num_heads:
        _refuse(f"{p}_output_norm_weight has {value_width} values, not a multiple of {num_heads} heads")
    return {
        "uvqk.weight": uvqk.t().contiguous(),
        "uvqk.bias": tensor(dense, p + "_uvqk_beta", (4 * value_width,)),
        "input_norm.weight": tensor(dense, p + "_input_norm_weight", (hidden,)),
        "input_norm.bias": tensor(dense, p + "_input_norm_bias", (hidden,)),
        "attention_norm.weight": tensor(dense, p + "_output_norm_weight", (value_width,)),
        "attention_norm.bias": tensor(dense, p + "_output_norm_bias", (value_width,)),
        "output.weight": tensor(dense, p + "_output_weight", (3 * value_width, hidden)).t().contiguous(),
        "output.bias": torch.zeros(hidden),  # DlrmHSTU's output projection has none
    }


def position_rows(dense: dict[str, Any], num_contextual: int, max_history: int,
                  history_time_row: int | None = 0) -> torch.Tensor:
    """kvexport's position table [C + M + 1, D] for event_tokens combined and candidate_position
    shared_row, under the per-user rules of docs/importers.md:
    - contextual token c: DlrmHSTU's position row c plus its last time row (a contextual token's
      time is 0, so its age at any query time past (time rows)^2 minutes after the epoch is capped);
    - event k (from 1, kvexport's row C + k - 1): DlrmHSTU's row C + M - k + 1, as upstream counts
      back from the newest event when a history holds M events, plus time row `history_time_row`
      (None: none) in place of the bucket of its age at the query time, which no cache can follow;
    - the candidates' shared row: DlrmHSTU's row C and time row 0 (a candidate's age is zero), plus
      sqrt(D) times their shared action vector (kvexport scales the item row alone).
    Positions past DlrmHSTU's last row read its last row, as upstream caps them."""
    positions, times = tensor(dense, POSITIONS), tensor(dense, TIMES)
    if positions.dim() != 2 or times.dim() != 2 or positions.shape[1] != times.shape[1]:
        _refuse(f"{POSITIONS} {list(positions.shape)} and {TIMES} {list(times.shape)} are not tables of one width")
    if num_contextual >= positions.shape[0] or times.shape[0] == 0:
        _refuse(f"{POSITIONS} has {positions.shape[0]} rows and {TIMES} {times.shape[0]}: no position past the "
                f"{num_contextual} contextual features, or no time row")
    if history_time_row is not None and not 0 <= history_time_row < times.shape[0]:
        _refuse(f"time row {history_time_row} is not one of {TIMES}'s {times.shape[0]} rows")
    last = positions.shape[0] - 1
    events = torch.arange(1, max_history + 1)
    history = positions[(num_contextual + max_history - events + 1).clamp(max=last)]
    if history_time_row is not None:
        history = history + times[history_time_row]
    context = positions[:num_contextual] + times[-1]
    shared_action = math.sqrt(positions.shape[1]) * candidate_action(dense)
    candidates = positions[min(num_contextual, last)] + times[0] + shared_action
    return torch.cat([context, history, candidates[None]])
