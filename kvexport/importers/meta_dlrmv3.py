"""Meta generative-recommenders DLRMv3 (`DlrmHSTU`) dense state -> kvexport's tables and layers.

Most of DlrmHSTU's input side is a function of one id at a time (docs/checkpoint.md, *Meta
generative-recommenders*), so it folds into kvexport's tables instead of running in the package:
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

import logging
import math
import re
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F

from kvexport.config import CONTEXT_FEATURE_SHIFT, MAX_CONTEXT_KEY, MAX_KEYED_CONTEXT_FEATURES
from kvexport.importers import CheckpointImportError, Imported, dcp, deployment_sections
from kvexport.importers.sharded import load_trainer_file
from kvexport.options import MetaOptions

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
log = logging.getLogger(__name__)
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
        _refuse(
            f"{key} is {type(value).__name__ if not isinstance(value, torch.Tensor) else value.dtype}, "
            "not a floating-point tensor"
        )
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


def context_bias(dense: dict[str, Any]) -> torch.Tensor:
    """[C, D]: each contextual feature's bias, which position_rows folds into its position row."""
    weights, bias = tensor(dense, CONTEXT_WEIGHTS), tensor(dense, CONTEXT_BIAS)
    if weights.dim() != 3 or tuple(bias.shape) != (weights.shape[0], weights.shape[2]):
        _refuse(f"{CONTEXT_BIAS} has shape {list(bias.shape)}, not [C, D] of {CONTEXT_WEIGHTS} {list(weights.shape)}")
    return bias


def context_rows(dense: dict[str, Any], feature: int, rows: torch.Tensor) -> torch.Tensor:
    """kvexport context-table rows [n, D] of contextual feature `feature`'s table rows [n, E]: their
    map without its bias (the bias is the feature's, so it lives in the feature's position row, and
    an id the table lacks reads a zero row: the token DlrmHSTU makes of a missing feature)."""
    weights = tensor(dense, CONTEXT_WEIGHTS)
    if weights.dim() != 3 or not 0 <= feature < weights.shape[0] or rows.shape[1] != weights.shape[1]:
        _refuse(
            f"{CONTEXT_WEIGHTS} has shape {list(weights.shape)}: no map of {rows.shape[1]} values for "
            f"contextual feature {feature}"
        )
    return rows.float() @ weights[feature]


def num_layers(dense: dict[str, Any]) -> int:
    """One past the highest STU layer index any key names (a layer missing a tensor is then refused by name)."""
    indices = [int(match[1]) for key in dense if (match := re.match(rf"{re.escape(STU)}(\d+)\.", key))]
    return max(indices) + 1 if indices else 0


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
        _refuse(
            f"{p}_uvqk_weight has shape {list(uvqk.shape)}: q/k heads of another width than u/v's "
            f"({value_width} values), which kvexport's cache cannot hold"
        )
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


def position_rows(
    dense: dict[str, Any],
    num_contextual: int,
    max_history: int,
    history_time_row: int | None = 0,
    history_positions: str = "from_max",
) -> torch.Tensor:
    """kvexport's position table [C + M + 1, D] for event_tokens combined and candidate_position
    shared_row, under the per-user rules of docs/checkpoint.md (*Approximated*):
    - contextual token c: DlrmHSTU's position row c plus its last time row (a contextual token's
      time is 0, so its age at any query time past (time rows)^2 minutes after the epoch is capped),
      plus sqrt(D) times the feature's bias (context_rows leaves it out);
    - event k (from 1, kvexport's row C + k - 1): DlrmHSTU's row C + M - k + 1 ("from_max", as
      upstream counts back from the newest event when a history holds M events) or C + k
      ("from_start"), plus time row `history_time_row` (None: none) in place of the bucket of its
      age at the query time, which no cache can follow;
    - the candidates' shared row: DlrmHSTU's row C and time row 0 (a candidate's age is zero), plus
      sqrt(D) times their shared action vector (kvexport scales the item row alone).
    Positions past DlrmHSTU's last row read its last row, as upstream caps them."""
    positions, times = tensor(dense, POSITIONS), tensor(dense, TIMES)
    if positions.dim() != 2 or times.dim() != 2 or positions.shape[1] != times.shape[1]:
        _refuse(f"{POSITIONS} {list(positions.shape)} and {TIMES} {list(times.shape)} are not tables of one width")
    if num_contextual >= positions.shape[0] or times.shape[0] == 0:
        _refuse(
            f"{POSITIONS} has {positions.shape[0]} rows and {TIMES} {times.shape[0]}: no position past the "
            f"{num_contextual} contextual features, or no time row"
        )
    if history_time_row is not None and not 0 <= history_time_row < times.shape[0]:
        _refuse(f"time row {history_time_row} is not one of {TIMES}'s {times.shape[0]} rows")
    if history_positions not in HISTORY_POSITIONS:
        _refuse(f"history positions {history_positions!r} are not one of {', '.join(HISTORY_POSITIONS)}")
    last = positions.shape[0] - 1
    events = torch.arange(1, max_history + 1)
    rows = num_contextual + (max_history - events + 1 if history_positions == "from_max" else events)
    history = positions[rows.clamp(max=last)]
    if history_time_row is not None:
        history = history + times[history_time_row]
    biases = math.sqrt(positions.shape[1]) * context_bias(dense)[:num_contextual]  # [C, D]; C may be 0
    context = positions[:num_contextual] + times[-1] + biases
    shared_action = math.sqrt(positions.shape[1]) * candidate_action(dense)
    candidates = positions[min(num_contextual, last)] + times[0] + shared_action
    return torch.cat([context, history, candidates[None]])


POST = "_hstu_transducer._output_postprocessor."
PERIOD_UNITS = POST + "_period_units"
UNITS_PER_PERIOD = POST + "_units_per_period"
COMBINER = POST + "_time_feature_combiner."
TOWER_MLP = "_item_embedding_mlp."
PREDICTION = "_multitask_module._prediction_module."
ADDITIONAL_MLP = PRE + "_additional_embedding_mlp."
TABLE = "_embedding_collection.embeddings.{}.weight"
SPARSE_TABLE = "sparse_dict." + TABLE


def query_time_periods(dense: dict[str, Any]) -> list[list[int]]:
    """The postprocessor's [seconds per unit, units per cycle] periods (its float buffers [1, P]),
    refused unless whole numbers kvexport's head reads."""
    units, cycles = dense.get(PERIOD_UNITS), dense.get(UNITS_PER_PERIOD)
    for key, value in ((PERIOD_UNITS, units), (UNITS_PER_PERIOD, cycles)):
        if not isinstance(value, torch.Tensor) or value.dim() != 2 or value.shape[0] != 1:
            _refuse(f"checkpoint lacks {key} as a [1, periods] tensor")
    if units.shape != cycles.shape:
        _refuse(f"{PERIOD_UNITS} {list(units.shape)} and {UNITS_PER_PERIOD} {list(cycles.shape)} disagree")
    periods = [[float(u), float(n)] for u, n in zip(units[0].tolist(), cycles[0].tolist())]
    if not periods or any(not (v.is_integer() and 0 < v < 1 << 24) for pair in periods for v in pair):
        _refuse(
            f"{PERIOD_UNITS} {units[0].tolist()} and {UNITS_PER_PERIOD} {cycles[0].tolist()}: kvexport's head "
            "reads whole positive periods below 2^24"
        )
    return [[int(u), int(n)] for u, n in periods]


def time_rows(dense: dict[str, Any], hidden: int) -> torch.Tensor:
    """kvexport's head.time_embedding [codes, D]: for each calendar code (mixed radix, the first
    period most significant), the combining layer's calendar columns times the cos and sin of each
    period's angle (DlrmHSTU's float32 steps: (index / units) * 2 * 3.14), plus the layer's bias."""
    periods = query_time_periods(dense)
    combiner = tensor(dense, COMBINER + "weight", (hidden, hidden + 2 * len(periods)))
    bias = tensor(dense, COMBINER + "bias", (hidden,))
    cycles = [units for _, units in periods]
    codes = torch.arange(math.prod(cycles))
    features = []
    for p, units in enumerate(cycles):
        index = codes // math.prod(cycles[p + 1 :]) % units
        angle = index.float() / torch.tensor(float(units)) * 2 * 3.14
        features += [angle.cos(), angle.sin()]
    return F.linear(torch.stack(features, dim=1), combiner[:, hidden:], bias)


def head_state(dense: dict[str, Any], hidden: int, tower_rows: torch.Tensor) -> dict[str, torch.Tensor]:
    """kvexport's item_tower head (head.*) from DlrmHSTU's postprocessor, item tower (its MLP of the
    item rows `tower_rows` [n, E], computed here) and prediction module."""
    first = tensor(dense, PREDICTION + "0.weight")
    width = first.shape[0]
    tasks = tensor(dense, PREDICTION + "2.weight").shape[0]
    return {
        "head.combiner.weight": tensor(dense, COMBINER + "weight")[:, :hidden].contiguous(),
        "head.time_embedding.weight": time_rows(dense, hidden),
        "head.user_norm.weight": tensor(dense, POST + "_layer_norm.weight", (hidden,)),
        "head.user_norm.bias": tensor(dense, POST + "_layer_norm.bias", (hidden,)),
        "head.tower_embedding.weight": mlp(dense, TOWER_MLP, tower_rows.float()),
        "head.mlp.0.weight": tensor(dense, PREDICTION + "0.weight", (width, hidden)),
        "head.mlp.0.bias": tensor(dense, PREDICTION + "0.bias", (width,)),
        "head.mlp.1.norm.weight": tensor(dense, PREDICTION + "1.weight", (width,)),
        "head.mlp.1.norm.bias": tensor(dense, PREDICTION + "1.bias", (width,)),
        "head.mlp.2.weight": tensor(dense, PREDICTION + "2.weight", (tasks, width)),
        "head.mlp.2.bias": tensor(dense, PREDICTION + "2.bias", (tasks,)),
    }


class _Reads(dict):
    """dense_dict, recording which keys the import reads, so that one it never reads is refused."""

    def __init__(self, *args):
        super().__init__(*args)
        self.read: set[str] = set()

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)


# --history-time: the time row of every history event (None: none).
HISTORY_TIMES = {"zero": 0, "none": None}
# --history-positions: event k of the history at DlrmHSTU's row C + M - k + 1 or C + k.
HISTORY_POSITIONS = ("from_max", "from_start")


def checkpoint_directory(source: Path, batch: int | None) -> Path:
    """SOURCE itself when it holds non_sparse.ckpt, else its <batch> directory (default the newest)."""
    if (source / "non_sparse.ckpt").is_file() and batch is None:
        return source
    if not source.is_dir():
        _refuse(f"{source} is not a directory")
    batches = sorted(int(p.name) for p in source.iterdir() if p.name.isdigit() and (p / "non_sparse.ckpt").is_file())
    if not batches:
        _refuse(f"{source} holds no <batch>/non_sparse.ckpt (a DLRMv3 checkpoint directory)")
    if batch is not None and batch not in batches:
        _refuse(f"{source} has no batch {batch} (batches: {', '.join(map(str, batches))})")
    return source / str(batch if batch is not None else batches[-1])


# Reads a sparse/ table: (key, None) the whole table, (key, rows) those rows.
SparseReader = Callable[[str, "torch.Tensor | None"], torch.Tensor]


def _table(
    dense: _Reads,
    sizes: dict[str, tuple[int, ...]],
    read_sparse: SparseReader,
    name: str,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Table `name`'s rows (all, or `rows`), from sparse/ (model-parallel) or dense_dict (data-parallel)."""
    sparse, local = SPARSE_TABLE.format(name), TABLE.format(name)
    if sparse in sizes:
        return read_sparse(sparse, rows)
    if local in dense:
        table = dense[local]
        if not isinstance(table, torch.Tensor) or table.dim() != 2:
            _refuse(f"{local} is not a 2-D table")
        if rows is not None and rows.numel() and (int(rows.max()) >= table.shape[0] or int(rows.min()) < 0):
            _refuse(f"table {name} has {table.shape[0]} rows; item id {int(rows.max())} lies outside it")
        return table if rows is None else table[rows]
    raise RuntimeError(f"kvexport bug: table {name} is neither in sparse/ nor in dense_dict after the key check")


def import_meta(source: Path, options: MetaOptions, name: str) -> Imported:
    """Maps a DLRMv3 DlrmHSTU checkpoint onto kvexport's model under the per-user rules of
    docs/checkpoint.md (positions counted from the maximum history, history events at time row 0,
    the attention normaliser fixed at C + max history + max candidates)."""
    directory = checkpoint_directory(source, options.batch)
    saved = load_trainer_file(directory / "non_sparse.ckpt", "DLRMv3 dense state", part="dense_dict")
    dense = saved.get("dense_dict") if isinstance(saved, dict) else None
    if not isinstance(dense, dict):
        _refuse(f"{directory / 'non_sparse.ckpt'} holds no dense_dict (DlrmHSTU's dense state)")
    sparse = directory / "sparse"
    sizes = dcp.tensor_sizes(sparse) if sparse.is_dir() else {}

    def read_sparse(key: str, rows: torch.Tensor | None) -> torch.Tensor:
        started = time.perf_counter()
        table = dcp.read_tensors(sparse, [key])[key] if rows is None else dcp.read_rows(sparse, key, rows)
        log.info(
            "read %s: %d x %d %s in %.1f s",
            key,
            table.shape[0],
            table.shape[1],
            str(table.dtype).removeprefix("torch."),
            time.perf_counter() - started,
        )
        return table

    imported = fold(dense, sizes, read_sparse, options, name)
    return Imported(imported.config, imported.state_dict, [f"read {directory}", *imported.notes])


def fold(
    dense_dict: dict[str, Any],
    sizes: dict[str, tuple[int, ...]],
    read_sparse: SparseReader,
    options: MetaOptions,
    name: str,
) -> Imported:
    """import_meta on a checkpoint's dense_dict and its sparse/ tables (their sizes by key, and a
    reader of their rows)."""
    dense = _Reads(dense_dict)
    notes: list[str] = []
    # Everything refusable from dense_dict alone is refused before the tables, the import's bulk, are read.
    _refuse_unmapped_inputs(dense, sizes, options)
    _refuse_missing_or_unknown_keys(dense, sizes, options)
    if options.history_time not in HISTORY_TIMES:
        _refuse(f"history time {options.history_time!r} is not one of {', '.join(HISTORY_TIMES)}")
    out, hidden, head_dim = _layers(dense, options)
    out["action_embedding.weight"] = action_rows(dense)
    num_context = len(options.contextual_features)
    out["position_embedding.weight"] = position_rows(
        dense, num_context, options.max_history_length, HISTORY_TIMES[options.history_time], options.history_positions
    )
    out.update(_context_tables(dense, sizes, read_sparse, options, hidden, notes))
    items, item_ids = _item_tables(dense, sizes, read_sparse, options, hidden, notes)
    out.update(items)
    unread = sorted(key for key in dense if key not in dense.read)
    if unread:
        raise RuntimeError(
            f"kvexport bug: the Meta import declares {unread[0]} among the keys it reads but never "
            "read it (meta_dlrmv3.read_keys)"
        )
    scaling = num_context + options.max_history_length + options.max_num_candidates
    positions = (
        f"positions counted back from {options.max_history_length} events"
        if options.history_positions == "from_max"
        else "positions counted from the oldest event"
    )
    times = "every history event at time row 0" if options.history_time == "zero" else "no history time row"
    notes.append(
        f"per-user rules (DlrmHSTU's batch-dependent ones cannot be cached): attention normaliser "
        f"{scaling} (C + max history + max candidates), {positions}, {times} (docs/checkpoint.md)"
    )
    model = {
        "num_layers": num_layers(dense),
        "hidden_size": hidden,
        "num_heads": options.num_heads,
        "head_dim": head_dim,
        "num_contextual_features": num_context,
        "max_history_length": options.max_history_length,
        "max_num_candidates": options.max_num_candidates,
        "scaling_seqlen": scaling,
        "num_tasks": out["head.mlp.2.weight"].shape[0],
        "dtype": "float32",
        "context_vocab_size": out["context_embedding.weight"].shape[0],
        "item_vocab_size": out["item_embedding.weight"].shape[0],
        "action_vocab_size": out["action_embedding.weight"].shape[0],
        "mlp_hidden_size": out["head.mlp.0.weight"].shape[0],
        "layer_norm_eps": LAYER_EPS,
        "silu_on": "u",
        "layer_output": "concat",
        "item_ids": item_ids,
        "context_ids": "keys" if num_context else "rows",
        "event_tokens": "combined",
        "candidate_position": "shared_row",
        "head": "item_tower",
        "query_time_periods": query_time_periods(dense),
    }
    config = {
        "name": name,
        "model": model,
        **deployment_sections(
            num_context + options.max_history_length, options.max_history_length, options.max_num_candidates
        ),
    }
    return Imported(config, out, notes)


def _layers(dense: _Reads, options: MetaOptions) -> tuple[dict[str, torch.Tensor], int, int]:
    """kvexport's layers.* of every STU layer, the model width and the head width."""
    positions = tensor(dense, POSITIONS)
    if positions.dim() != 2:
        _refuse(f"{POSITIONS} has shape {list(positions.shape)}, not [rows, D]")
    hidden = positions.shape[1]
    if num_layers(dense) == 0:
        _refuse(f"checkpoint has no STU layer ({STU}0._uvqk_weight)")
    out = {
        f"layers.{i}.{key}": value
        for i in range(num_layers(dense))
        for key, value in layer_state(dense, i, options.num_heads).items()
    }
    head_dim = out["layers.0.attention_norm.weight"].shape[0] // options.num_heads
    if hidden != options.num_heads * head_dim:
        _refuse(
            f"model width {hidden} is not {options.num_heads} heads x {head_dim} values: kvexport's layers "
            "need them equal"
        )
    return out, hidden, head_dim


# The tensors of each STU layer.
LAYER_TENSORS = (
    "_uvqk_weight",
    "_uvqk_beta",
    "_input_norm_weight",
    "_input_norm_bias",
    "_output_weight",
    "_output_norm_weight",
    "_output_norm_bias",
)


def _module_keys(prefix: str, num_modules: int) -> list[str]:
    """The weight and bias of each of a Sequential's first `num_modules` modules."""
    return [f"{prefix}{index}.{part}" for index in range(num_modules) for part in ("weight", "bias")]


def read_keys(dense: dict[str, Any], sizes: dict[str, tuple[int, ...]], options: MetaOptions) -> list[str]:
    """Every dense_dict key the import reads (besides the extra-feature MLP's, which it only checks
    is unused): the STU layers, positions and times, the input side, the postprocessor and head, and
    each named table that sparse/ does not hold."""
    layers = [f"{STU}{index}.{name}" for index in range(num_layers(dense)) for name in LAYER_TENSORS]
    local_tables = [
        TABLE.format(name)
        for name in (options.item_table, *options.contextual_features)
        if SPARSE_TABLE.format(name) not in sizes
    ]
    return [
        *layers,
        POSITIONS,
        TIMES,
        ACTION_WEIGHTS,
        ACTION_ROWS,
        TARGET_ROW,
        CONTEXT_WEIGHTS,
        CONTEXT_BIAS,
        *_module_keys(CONTENT_MLP, 4),
        *_module_keys(ACTION_MLP, 4),
        *_module_keys(TOWER_MLP, 4),
        PERIOD_UNITS,
        UNITS_PER_PERIOD,
        COMBINER + "weight",
        COMBINER + "bias",
        POST + "_layer_norm.weight",
        POST + "_layer_norm.bias",
        *_module_keys(PREDICTION, 3),
        *local_tables,
    ]


def _refuse_missing_or_unknown_keys(
    dense: dict[str, Any], sizes: dict[str, tuple[int, ...]], options: MetaOptions
) -> None:
    """dense_dict's key set against read_keys: the first key missing, else the first one the import
    would never read, refused by name."""
    expected = read_keys(dense, sizes, options)
    local_tables = {TABLE.format(name): name for name in (options.item_table, *options.contextual_features)}
    for key in expected:
        if key in dense:
            continue
        if key in local_tables:
            _refuse(
                f"table {local_tables[key]}: neither {SPARSE_TABLE.format(local_tables[key])} in sparse/ nor "
                f"{key} in dense_dict"
            )
        if key == ACTION_WEIGHTS:
            _refuse(f"checkpoint lacks {key} (a DlrmHSTU without actions, which kvexport does not import)")
        _refuse(f"checkpoint lacks {key}")
    known = set(expected)
    unknown = sorted(key for key in dense if key not in known and not key.startswith(ADDITIONAL_MLP))
    if unknown:
        _refuse(f"checkpoint tensor {unknown[0]} has no counterpart in kvexport's model (unknown key)")


def _refuse_unmapped_inputs(dense: _Reads, sizes: dict[str, tuple[int, ...]], options: MetaOptions) -> None:
    """Extra per-event features, a contextual map of another count than the features named, a
    sparse/ table that is neither the item table nor a contextual feature: refused by name."""
    extra = dense.get(ADDITIONAL_MLP + "0.weight")
    if isinstance(extra, torch.Tensor) and extra.dim() == 2 and extra.shape[1]:
        _refuse(
            f"{ADDITIONAL_MLP}0.weight reads {extra.shape[1]} values of extra per-event features, "
            "which kvexport's requests do not carry"
        )
    dense.read.update(key for key in dense if key.startswith(ADDITIONAL_MLP))  # built even without features
    context_weights = tensor(dense, CONTEXT_WEIGHTS)
    num_context = len(options.contextual_features)
    if context_weights.dim() != 3 or context_weights.shape[0] != num_context:
        _refuse(
            f"{CONTEXT_WEIGHTS} maps {context_weights.shape[0] if context_weights.dim() == 3 else '?'} "
            f"contextual features; {num_context} named (--contextual-features, in the trainer's order)"
        )
    if num_context > MAX_KEYED_CONTEXT_FEATURES:
        _refuse(f"{num_context} contextual features: kvexport keys at most {MAX_KEYED_CONTEXT_FEATURES}")
    named = {SPARSE_TABLE.format(t) for t in (options.item_table, *options.contextual_features)}
    others = sorted(key for key in sizes if key not in named)
    if others:
        _refuse(
            f"sparse/ holds {others[0]}, neither the item table ({options.item_table}) nor a contextual "
            "feature named (--contextual-features, in the trainer's order)"
        )
    check_context_ids(options.context_ids, options.contextual_features)


def check_context_ids(names: Iterable[str], contextual_features: tuple[str, ...]) -> None:
    """Every feature given served ids (--context-ids) is a contextual feature named, once."""
    seen: set[str] = set()
    for name in names:
        if name in seen:
            _refuse(f"--context-ids names {name} twice")
        if name not in contextual_features:
            _refuse(
                f"--context-ids names {name}, not one of the contextual features "
                f"({', '.join(contextual_features) or 'none'})"
            )
        seen.add(name)


def _served(ids: tuple[int, ...]) -> torch.Tensor:
    """Served ids as the ascending keys of a table's rows."""
    return torch.tensor(sorted(set(ids)), dtype=torch.int64)


def _context_tables(
    dense: _Reads,
    sizes: dict[str, tuple[int, ...]],
    read_sparse: SparseReader,
    options: MetaOptions,
    hidden: int,
    notes: list[str],
) -> dict[str, torch.Tensor]:
    """context_embedding (each feature's rows through its map, all rows or its --context-ids', then a
    zero row) and context_keys."""
    rows, keys = [], []
    for feature, table_name in enumerate(options.contextual_features):
        if table_name in options.context_ids:
            ids = _served(options.context_ids[table_name])
            if int(ids[-1]) >= MAX_CONTEXT_KEY:
                _refuse(
                    f"contextual feature {table_name}: id {int(ids[-1])} is past kvexport's context keys (below 2^56)"
                )
            table = _table(dense, sizes, read_sparse, table_name, ids)
            notes.append(
                f"contextual feature {table_name}: {ids.numel()} served ids read; any other id is a missing feature"
            )
        else:
            table = _table(dense, sizes, read_sparse, table_name)
            ids = torch.arange(table.shape[0])
        rows.append(context_rows(dense, feature, table))
        keys.append((feature << CONTEXT_FEATURE_SHIFT) | ids)
    # A pair no table has reads zeros: DlrmHSTU's token of a missing feature (the bias is the position row's).
    out = {"context_embedding.weight": torch.cat([*rows, torch.zeros(1, hidden)])}
    if keys:
        out["context_keys"] = torch.cat(keys)
    return out


def _item_tables(
    dense: _Reads,
    sizes: dict[str, tuple[int, ...]],
    read_sparse: SparseReader,
    options: MetaOptions,
    hidden: int,
    notes: list[str],
) -> tuple[dict[str, torch.Tensor], str]:
    """item_embedding, the head (its tower table over the same rows) and, with --items, item_keys;
    and model.item_ids."""
    if options.items is None:
        source = _table(dense, sizes, read_sparse, options.item_table)
        notes.append(f"item table {options.item_table}: all {source.shape[0]} rows, ids as rows")
    else:
        served = _served(options.items)
        source = _table(dense, sizes, read_sparse, options.item_table, served)
        notes.append(
            f"item table {options.item_table}: {served.numel()} served ids read; any other id reads a "
            "zero item row and a zero tower row"
        )
    started = time.perf_counter()
    out = {"item_embedding.weight": item_rows(dense, source), **head_state(dense, hidden, source)}
    log.info("folded %d items' content and tower MLPs in %.1f s", source.shape[0], time.perf_counter() - started)
    if options.items is None:
        return out, "rows"
    for key in ("item_embedding.weight", "head.tower_embedding.weight"):  # the row of every other id
        out[key] = torch.cat([out[key], torch.zeros(1, hidden)])
    out["item_keys"] = served
    return out, "keys"


def read_ids(path: Path) -> tuple[int, ...]:
    """The ids of a text file, one per line (blank lines skipped), each an integer >= 0."""
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        _refuse(f"cannot read ids from {path}: {getattr(exc, 'strerror', None) or exc}")
    ids = []
    for number, line in enumerate(lines, 1):
        text = line.strip()
        if not text:
            continue
        if not re.fullmatch(r"[0-9]{1,19}", text) or int(text) >= 1 << 63:
            _refuse(f"{path} line {number}: {text[:40]!r} is not an id (an integer in [0, 2^63))")
        ids.append(int(text))
    if not ids:
        _refuse(f"{path} holds no ids")
    return tuple(ids)
