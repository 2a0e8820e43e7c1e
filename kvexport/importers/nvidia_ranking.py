"""NVIDIA recsys-examples HSTU ranking checkpoints -> a kvexport checkpoint and config.

The trainer's directory as it writes it (docs/checkpoint.md, *Importing*): `iter<N>/torch_module/
model.<rank>.pth` (the dense weights, replicated: rank 0's are read; a ShardedTensor is joined from
every rank's file), the data-parallel tables as one flat parameter, and each dynamic (hash-keyed)
table as its ranks' dumps under `iter<N>/dynamicemb_module/`. What the checkpoint does not hold
comes from the trainer's gin file (`NetworkArgs`, `DatasetArgs`, `RankingArgs`) or from explicit
options, never from a guess: the rows of each data-parallel table, and which tables are the
contextual features, in token order. Anything that cannot be mapped exactly is refused in one line
naming it.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import torch

from kvexport.config import CONTEXT_FEATURE_SHIFT, MAX_CONTEXT_KEY, MAX_KEYED_CONTEXT_FEATURES
from kvexport.importers import CheckpointImportError, Imported, deployment_sections
from kvexport.importers.nvidia import read_dynamic_table, read_gin
from kvexport.importers.sharded import ShardedValue, assemble, load_trainer_file
from kvexport.options import NvidiaOptions

LAYER_PREFIX = "_hstu_block._attention_layers."
POSITIONS = "_hstu_block._preprocessor._positional_encoder._position_embeddings_weight"
FLAT_TABLES = re.compile(r"_embedding_collection\._data_parallel_embedding_collection\.embeddings\.(.+)_weights")
MODEL_PARALLEL = "_model_parallel_embedding_collection"
HEAD = "_mlp._mlp."
# A layer's tensors: NVIDIA's name -> (kvexport's name, transposed: NVIDIA stores x @ W as [in, out]).
LAYER_TENSORS = {
    "_linear_uvqk_weight": ("uvqk.weight", True),
    "_linear_uvqk_bias": ("uvqk.bias", False),
    "_input_layernorm_weight": ("input_norm.weight", False),
    "_input_layernorm_bias": ("input_norm.bias", False),
    "_output_layernorm_weight": ("attention_norm.weight", False),
    "_output_layernorm_bias": ("attention_norm.bias", False),
    "_linear_proj_weight": ("output.weight", True),
}
# The gin defaults of the bindings the import reads (NVIDIA's gin_config_args), used when the file
# does not bind them.
GIN_DEFAULTS = {
    "NetworkArgs.norm_epsilon": 1e-5,
    "NetworkArgs.dtype_str": "bfloat16",
    "NetworkArgs.num_position_buckets": 8192,
    "NetworkArgs.scaling_seqlen": -1,
    "RankingArgs.prediction_head_act_type": "relu",
    "RankingArgs.prediction_head_bias": True,
}
GIN_REQUIRED = (
    "NetworkArgs.num_layers",
    "NetworkArgs.num_attention_heads",
    "NetworkArgs.hidden_size",
    "NetworkArgs.kv_channels",
    "DatasetArgs.max_history_seqlen",
    "DatasetArgs.max_num_candidates",
    "RankingArgs.prediction_head_arch",
    "RankingArgs.num_tasks",
)
DTYPES = ("bfloat16", "float16", "float32")  # NetworkArgs.dtype_str values kvexport's config takes


def _refuse(message: str) -> None:
    raise CheckpointImportError(message)


def iteration_directory(source: Path, iteration: int | None) -> Path:
    """source itself when it holds torch_module/, else its iter<N> (the newest, or the one given)."""
    if (source / "torch_module").is_dir():
        return source
    if not source.is_dir():
        _refuse(f"{source}: no such directory (expected the trainer's save directory or one of its iter<N>)")
    found = {int(p.name[4:]): p for p in source.iterdir() if re.fullmatch(r"iter\d+", p.name) and p.is_dir()}
    if iteration is not None:
        if iteration not in found:
            names = ", ".join(f"iter{i}" for i in sorted(found)) or "none"
            _refuse(f"{source}: no iter{iteration} directory (found: {names})")
        return found[iteration]
    if not found:
        _refuse(f"{source}: neither torch_module/ nor any iter<N> directory inside")
    return found[max(found)]


def _rank_files(directory: Path) -> list[Path]:
    files = {
        int(m.group(1)): p for p in directory.glob("model.*.pth") if (m := re.fullmatch(r"model\.(\d+)\.pth", p.name))
    }
    if 0 not in files:
        _refuse(f"{directory}: no model.0.pth (the trainer writes model.<rank>.pth for each rank)")
    missing = [r for r in range(max(files) + 1) if r not in files]
    if missing:
        _refuse(f"{directory}: model.{missing[0]}.pth is missing ({max(files) + 1} ranks wrote files)")
    return [files[r] for r in range(len(files))]


def read_model_state(directory: Path) -> dict[str, Any]:
    """Rank 0's model_state_dict, every ShardedTensor joined from all ranks' files."""
    paths = _rank_files(directory)
    states = []
    for path in paths:
        saved = load_trainer_file(path, "trainer checkpoint", part="model_state_dict")
        if not isinstance(saved, dict) or not isinstance(saved.get("model_state_dict"), dict):
            _refuse(f"{path}: not a recsys-examples checkpoint (no model_state_dict)")
        states.append(saved["model_state_dict"])
        if not any(isinstance(v, ShardedValue) for v in states[0].values()):
            break  # replicated dense weights: rank 0 alone is enough
    state = dict(states[0])
    for key, value in state.items():
        if isinstance(value, ShardedValue):
            parts = [s.get(key) for s in states]
            if any(not isinstance(p, ShardedValue) for p in parts):
                _refuse(f"{key}: sharded in model.0.pth but not in every rank's file")
            state[key] = assemble(key, parts)
    return state


def _gin(path: Path) -> dict[str, Any]:
    bindings = {**GIN_DEFAULTS, **read_gin(path)}
    missing = [name for name in GIN_REQUIRED if name not in bindings]
    if missing:
        _refuse(f"trainer config {path} does not bind {missing[0]}, which the checkpoint does not hold")
    for name in (*GIN_REQUIRED, "NetworkArgs.num_position_buckets"):
        value = bindings[name]
        if name == "RankingArgs.prediction_head_arch":
            ok = isinstance(value, (list, tuple)) and all(isinstance(v, int) and v > 0 for v in value)
        else:
            ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
        if not ok:
            kind = "a list of positive integers" if name == "RankingArgs.prediction_head_arch" else "a positive integer"
            _refuse(f"trainer config {path}: {name} = {value!r} is not {kind}")
    return bindings


def _tensor(state: dict[str, Any], key: str, shape: tuple[int, ...]) -> torch.Tensor:
    if key not in state:
        _refuse(f"checkpoint lacks {key}")
    value = state[key]
    if not isinstance(value, torch.Tensor) or value.is_meta:
        _refuse(
            f"{key} holds no values ({type(value).__name__}{' on meta' if isinstance(value, torch.Tensor) else ''})"
        )
    if tuple(value.shape) != shape:
        _refuse(f"{key} has shape {list(value.shape)}, the trainer config implies {list(shape)}")
    if not value.dtype.is_floating_point:
        _refuse(f"{key} has dtype {str(value.dtype).replace('torch.', '')}, not a floating type")
    return value.float()


def _flat_tables(state: dict[str, Any], dim: int, table_rows: dict[str, int]) -> dict[str, torch.Tensor]:
    """The data-parallel tables, cut from their flat parameter in name order by their rows."""
    tables: dict[str, torch.Tensor] = {}
    for key in [k for k in state if FLAT_TABLES.fullmatch(k)]:
        names = FLAT_TABLES.fullmatch(key).group(1).split("/")
        flat = state[key]
        if not isinstance(flat, torch.Tensor) or flat.is_meta:
            _refuse(f"{key} holds no values")
        unknown = [n for n in names if n not in table_rows]
        if unknown:
            _refuse(
                f"{key}: the rows of data-parallel table {unknown[0]} are not in the checkpoint; "
                f"give them (--table-rows {unknown[0]}=N, as the trainer's embedding config says)"
            )
        if flat.numel() % dim:
            _refuse(f"{key}: {flat.numel()} values are not rows of {dim}")
        rows = flat.reshape(-1, dim)
        total = sum(table_rows[n] for n in names)
        if rows.shape[0] != total:
            _refuse(
                f"{key}: {rows.shape[0]} rows, but the tables' rows given sum to {total} "
                f"({', '.join(f'{n}={table_rows[n]}' for n in names)})"
            )
        first = 0
        for name in names:
            # A copy: a view would make torch.save write the whole flat parameter once per table.
            tables[name] = rows[first : first + table_rows[name]].to(torch.float32, copy=True)
            first += table_rows[name]
    return tables


def _dynamic_tables(dumps: Path) -> dict[str, Path]:
    """Each dynamic table dumped under `dumps` (one folder per embedding collection) -> its folder."""
    tables: dict[str, Path] = {}
    for collection in sorted(p for p in dumps.iterdir() if p.is_dir()) if dumps.is_dir() else []:
        for keys in collection.glob("*_emb_keys.rank_*"):
            tables.setdefault(keys.name.split("_emb_keys.rank_")[0], collection)
    return tables


@dataclasses.dataclass(frozen=True)
class Network:
    """What the trainer's gin file fixes about the model, checked against what kvexport can serve."""

    num_layers: int
    num_heads: int
    hidden: int
    head_dim: int
    head_arch: list[int]  # RankingArgs.prediction_head_arch: [hidden units, num_tasks]
    activation: str
    head_bias: bool
    dtype: str
    layer_norm_eps: float
    max_history: int
    max_candidates: int
    num_context: int
    num_position_buckets: int
    scaling: int
    scaling_from: str  # how scaling was found, for the notes

    @property
    def num_tasks(self) -> int:
        return self.head_arch[-1]

    @property
    def longest_prefix(self) -> int:
        return self.num_context + 2 * self.max_history


def read_network(trainer_config: Path, options: NvidiaOptions) -> Network:
    """The gin file's bindings, refused in one line where kvexport's model cannot take them."""
    gin = _gin(trainer_config)
    layers, heads = gin["NetworkArgs.num_layers"], gin["NetworkArgs.num_attention_heads"]
    hidden, head_dim = gin["NetworkArgs.hidden_size"], gin["NetworkArgs.kv_channels"]
    if hidden != heads * head_dim:
        _refuse(
            f"NetworkArgs.hidden_size ({hidden}) is not num_attention_heads ({heads}) * kv_channels "
            f"({head_dim}): kvexport's layers need them equal"
        )
    arch = list(gin["RankingArgs.prediction_head_arch"])
    tasks = gin["RankingArgs.num_tasks"]
    if len(arch) != 2 or arch[-1] != tasks:
        _refuse(
            f"RankingArgs.prediction_head_arch {arch}: kvexport's head is one hidden layer, then "
            f"num_tasks ({tasks}) logits"
        )
    activation = gin["RankingArgs.prediction_head_act_type"]
    if activation not in ("relu", "silu"):
        _refuse(f"RankingArgs.prediction_head_act_type {activation!r}: kvexport's head has relu or silu")
    dtype = gin["NetworkArgs.dtype_str"]
    if dtype not in DTYPES:
        _refuse(f"NetworkArgs.dtype_str {dtype!r} is not one of {', '.join(DTYPES)}")
    max_history, max_candidates = gin["DatasetArgs.max_history_seqlen"], gin["DatasetArgs.max_num_candidates"]
    if options.contextual_features and options.skip_contextual:
        _refuse(
            "contextual features given and left out at once: choose --contextual-features or --no-contextual-features"
        )
    num_context = len(options.contextual_features)
    if num_context > MAX_KEYED_CONTEXT_FEATURES:
        _refuse(f"{num_context} contextual features: kvexport keys at most {MAX_KEYED_CONTEXT_FEATURES}")
    # recsys-examples' inference divides by the longest sequence it serves: 2 (history + candidates) + C.
    scaling = gin["NetworkArgs.scaling_seqlen"]
    if scaling == -1:
        scaling = 2 * (max_history + max_candidates) + num_context
        derived = (
            f"2 * (max_history_seqlen {max_history} + max_num_candidates {max_candidates}) + "
            f"{num_context} contextual features"
        )
    elif isinstance(scaling, int) and not isinstance(scaling, bool) and scaling > 0:
        derived = "NetworkArgs.scaling_seqlen"
    else:
        _refuse(
            f"trainer config {trainer_config}: NetworkArgs.scaling_seqlen = {scaling!r} is neither -1 nor a "
            "positive integer"
        )
    return Network(
        layers,
        heads,
        hidden,
        head_dim,
        arch,
        activation,
        bool(gin["RankingArgs.prediction_head_bias"]),
        dtype,
        float(gin["NetworkArgs.norm_epsilon"]),
        max_history,
        max_candidates,
        num_context,
        gin["NetworkArgs.num_position_buckets"],
        scaling,
        derived,
    )


def read_keys(state: dict[str, Any], net: Network) -> list[str]:
    """Every model_state_dict key the import reads: each layer's tensors, the positions, the head's
    (its biases where the trainer has them) and the data-parallel tables' flat parameters."""
    layers = [f"{LAYER_PREFIX}{index}.{name}" for index in range(net.num_layers) for name in LAYER_TENSORS]
    parts = ("weight", "bias") if net.head_bias else ("weight",)
    head = [f"{HEAD}{index}.{part}" for index in (0, 2) for part in parts]
    return [*layers, POSITIONS, *head, *(key for key in state if FLAT_TABLES.fullmatch(key))]


def _refuse_missing_or_unknown_keys(state: dict[str, Any], net: Network) -> None:
    """The state's key set against read_keys, before any table is read: a layer past
    NetworkArgs.num_layers, the first key missing, else the first one the import would never read
    (the model-parallel tables' keys aside: their rows are in the dynamic tables' dumps)."""
    if any(key.startswith(f"{LAYER_PREFIX}{net.num_layers}.") for key in state):
        _refuse(f"checkpoint has a layer {net.num_layers} but NetworkArgs.num_layers is {net.num_layers}")
    expected = read_keys(state, net)
    missing = [key for key in expected if key not in state]
    if missing:
        _refuse(f"checkpoint lacks {missing[0]}")
    known = set(expected)
    unknown = sorted(key for key in state if key not in known and MODEL_PARALLEL not in key)
    if unknown:
        _refuse(f"checkpoint tensor {unknown[0]} has no counterpart in kvexport's model (unknown key)")


class _Fold:
    """The kvexport state dict being built from the trainer's, and which of the trainer's keys it read."""

    def __init__(self, state: dict[str, Any]):
        self.state = state
        self.out: dict[str, torch.Tensor] = {}
        self.used: set[str] = set()
        self.notes: list[str] = []

    def take(self, key: str, shape: tuple[int, ...]) -> torch.Tensor:
        self.used.add(key)
        return _tensor(self.state, key, shape)


def fold_layers(fold: _Fold, net: Network) -> None:
    """The STU layers (NVIDIA's output projection has no bias: a zero one)."""
    hidden = net.hidden
    shapes = {
        "_linear_uvqk_weight": (hidden, 4 * hidden),
        "_linear_uvqk_bias": (4 * hidden,),
        "_input_layernorm_weight": (hidden,),
        "_input_layernorm_bias": (hidden,),
        "_output_layernorm_weight": (hidden,),
        "_output_layernorm_bias": (hidden,),
        "_linear_proj_weight": (hidden, hidden),
    }
    for i in range(net.num_layers):
        for theirs, (ours, transposed) in LAYER_TENSORS.items():
            value = fold.take(f"{LAYER_PREFIX}{i}.{theirs}", shapes[theirs])
            fold.out[f"layers.{i}.{ours}"] = value.t().contiguous() if transposed else value
        fold.out[f"layers.{i}.output.bias"] = torch.zeros(hidden)


def fold_positions(fold: _Fold, net: Network) -> None:
    """NVIDIA reads row min(position, buckets - 1); kvexport's table has a row per position."""
    positions = fold.take(POSITIONS, (net.num_position_buckets, net.hidden))
    longest, buckets = net.longest_prefix, net.num_position_buckets
    fold.out["position_embedding.weight"] = positions[torch.arange(longest + 1).clamp(max=buckets - 1)]
    if longest >= buckets:
        fold.notes.append(f"positions {buckets - 1}..{longest} share row {buckets - 1}, as the trainer clamps them")


def fold_head(fold: _Fold, net: Network) -> None:
    """The prediction MLP (zero biases when the trainer has none)."""
    for index, shape in ((0, (net.head_arch[0], net.hidden)), (2, (net.num_tasks, net.head_arch[0]))):
        fold.out[f"head.{index}.weight"] = fold.take(f"{HEAD}{index}.weight", shape)
        fold.out[f"head.{index}.bias"] = (
            fold.take(f"{HEAD}{index}.bias", (shape[0],)) if net.head_bias else torch.zeros(shape[0])
        )


def fold_tables(fold: _Fold, net: Network, options: NvidiaOptions, directory: Path) -> str:
    """The action, contextual and item tables, data-parallel or dumped dynamic ones; returns the
    config's model.item_ids (rows, or keys for a dynamic item table)."""
    flat = _flat_tables(fold.state, net.hidden, options.table_rows)
    fold.used.update(k for k in fold.state if FLAT_TABLES.fullmatch(k))
    if options.action_table not in flat:
        _refuse(
            f"action table {options.action_table} is not among the data-parallel tables ({', '.join(flat) or 'none'})"
        )
    fold.out["action_embedding.weight"] = flat.pop(options.action_table)
    dumps = directory / "dynamicemb_module"
    dynamic = _dynamic_tables(dumps)
    if options.item_table not in flat and options.item_table not in dynamic:
        _refuse(f"item table {options.item_table}: neither a data-parallel table nor dumped under {dumps}")
    others = [n for n in [*flat, *dynamic] if n != options.item_table]
    absent = [n for n in options.contextual_features if n not in others]
    if absent:
        _refuse(
            f"contextual feature {absent[0]}: no data-parallel or dynamic table of that name "
            f"(tables: {', '.join(others) or 'none'})"
        )
    unused = [n for n in others if n not in options.contextual_features]
    if unused and not options.skip_contextual:
        _refuse(
            f"table {unused[0]} is neither the item nor the action table nor a contextual feature given: "
            "name the contextual features in token order (--contextual-features a,b,...), or import "
            "without them as recsys-examples' inference runs with disable_contextual_features "
            "(--no-contextual-features)"
        )
    if unused:
        fold.notes.append(f"left out (no contextual features): tables {', '.join(unused)}")
    _fold_context(fold, net, options, flat, dynamic)
    return _fold_items(fold, net, options, flat, dynamic)


def _fold_context(
    fold: _Fold, net: Network, options: NvidiaOptions, flat: dict[str, torch.Tensor], dynamic: dict[str, Path]
) -> None:
    context_rows, context_keys = [], []
    for feature, table_name in enumerate(options.contextual_features):
        if table_name in flat:
            rows = flat[table_name]
            keys = torch.arange(rows.shape[0])
        else:
            table = read_dynamic_table(dynamic[table_name], table_name, net.hidden)
            rows, keys = table.values, table.keys
        if keys.numel() and (int(keys[0]) < 0 or int(keys[-1]) >= MAX_CONTEXT_KEY):
            bad = int(keys[0]) if int(keys[0]) < 0 else int(keys[-1])
            _refuse(f"contextual feature {table_name} has key {bad}; kvexport takes context keys in [0, 2^56)")
        context_rows.append(rows)
        context_keys.append((feature << CONTEXT_FEATURE_SHIFT) | keys)
    if net.num_context:
        # Every pair a feature's table lacks reads zeros, as the trainer's evaluation answers a
        # missing key of a dynamic table (an id past a data-parallel table's rows too: documented).
        fold.out["context_embedding.weight"] = torch.cat([*context_rows, torch.zeros(1, net.hidden)])
        fold.out["context_keys"] = torch.cat(context_keys)
        fold.notes.append(f"contextual features, in token order: {', '.join(options.contextual_features)}")
    else:
        fold.out["context_embedding.weight"] = torch.zeros(1, net.hidden)


def _fold_items(
    fold: _Fold, net: Network, options: NvidiaOptions, flat: dict[str, torch.Tensor], dynamic: dict[str, Path]
) -> str:
    if options.item_table in flat:
        fold.out["item_embedding.weight"] = flat.pop(options.item_table)
        return "rows"
    holder = dynamic[options.item_table]
    # Every id the table lacks reads a zero last row, as recsys-examples' evaluation answers a
    # missing key: read in place as the table's spare row (the table is the import's bulk).
    table = read_dynamic_table(holder, options.item_table, net.hidden, spare_rows=1)
    if table.keys.numel() and int(table.keys[0]) < 0:
        _refuse(
            f"item table {options.item_table} holds a negative key ({int(table.keys[0])}); kvexport takes keys >= 0"
        )
    fold.out["item_embedding.weight"] = table.values
    fold.out["item_keys"] = table.keys
    fold.notes.append(
        f"item table {options.item_table}: {table.keys.numel()} keys from {holder}; unknown ids read a zero row"
    )
    return "keys"


def _config(name: str, net: Network, out: dict[str, torch.Tensor], item_ids: str) -> dict[str, Any]:
    return {
        "name": name,
        "model": {
            "num_layers": net.num_layers,
            "hidden_size": net.hidden,
            "num_heads": net.num_heads,
            "head_dim": net.head_dim,
            "num_contextual_features": net.num_context,
            "max_history_length": net.max_history,
            "max_num_candidates": net.max_candidates,
            "scaling_seqlen": net.scaling,
            "num_tasks": net.num_tasks,
            "dtype": net.dtype,
            "context_vocab_size": out["context_embedding.weight"].shape[0],
            "item_vocab_size": out["item_embedding.weight"].shape[0],
            "action_vocab_size": out["action_embedding.weight"].shape[0],
            "mlp_hidden_size": net.head_arch[0],
            "head_activation": net.activation,
            "layer_norm_eps": net.layer_norm_eps,
            "silu_on": "uvqk",
            "layer_output": "gated",
            "item_ids": item_ids,
            "context_ids": "keys" if net.num_context else "rows",
        },
        **deployment_sections(net.longest_prefix, net.max_history, net.max_candidates),
    }


def import_nvidia(source: Path, trainer_config: Path, options: NvidiaOptions, name: str) -> Imported:
    """Maps a recsys-examples ranking checkpoint onto kvexport's model (docs/checkpoint.md), in
    stages: the network the gin file fixes, then the layers, positions, head and tables folded in,
    every key of the trainer's state checked before any table is read, and read."""
    directory = iteration_directory(source, options.iteration)
    net = read_network(trainer_config, options)
    fold = _Fold(read_model_state(directory / "torch_module"))
    _refuse_missing_or_unknown_keys(fold.state, net)
    fold.notes += [f"read {directory / 'torch_module'}", f"attention normaliser S = {net.scaling} ({net.scaling_from})"]
    fold_layers(fold, net)
    fold_positions(fold, net)
    fold_head(fold, net)
    item_ids = fold_tables(fold, net, options, directory)
    unread = [key for key in read_keys(fold.state, net) if key not in fold.used]
    if unread:
        raise RuntimeError(
            f"kvexport bug: the NVIDIA import declares {unread[0]} among the keys it reads but never "
            "read it (nvidia_ranking.read_keys)"
        )
    return Imported(_config(name, net, fold.out, item_ids), fold.out, fold.notes)
