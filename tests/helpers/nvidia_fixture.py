"""A recsys-examples HSTU ranking checkpoint, written in the trainer's own on-disk layout with
synthetic weights and small dimensions, and the trainer's gin file.

    SAVE/iter<N>/torch_module/model.<rank>.pth   {"model_state_dict", "optimizer_state_dict"}
    SAVE/iter<N>/dynamicemb_module/model._embedding_collection._model_parallel_embedding_collection/
        <table>_emb_{keys,values,scores,opt_values}.rank_<r>.world_size_<W>

Dense weights are replicated in every rank's file (data parallel); the data-parallel tables share
one flat parameter, in name order; the dynamic tables (the item table, and user_id when contextual
features are on) are dumped by rank, key % W == rank, rows in an order of the rank's own (here
reversed), and the state dicts hold meta-device placeholders for them, as torchrec leaves them.
"""

from __future__ import annotations

import dataclasses
import enum
from pathlib import Path

import torch

HIDDEN, HEADS, KV_CHANNELS, LAYERS = 8, 2, 4, 2
MAX_HISTORY, MAX_CANDIDATES, POSITION_BUCKETS = 6, 3, 10  # positions past 9 clamp to row 9
HEAD_ARCH, TASKS = [5, 3], 3
ACTION_ROWS = 4
CONTEXT_TABLES = {"user_active_degree": 3, "register_days_range": 2}
ITEM_KEYS = [3, 10, 42, 57, 99, 1000, 123456789012]
USER_KEYS = [5, 6, 700]
COLLECTION = "model._embedding_collection._model_parallel_embedding_collection"


class Precision(enum.Enum):
    BF16 = "bf16"


@dataclasses.dataclass
class OptimizerConfig:
    """A type of the trainer's own in its optimizer state, as Megatron's optimizer keeps its config
    there: the importer reads the model state and must not need (or run) it."""

    lr: float = 1e-3
    precision: Precision = Precision.BF16


FLAT = "_embedding_collection._data_parallel_embedding_collection.embeddings.{}_weights"


def gin_text(**overrides) -> str:
    bindings = {
        "DatasetArgs.dataset_name": "'kuairand-1k'",
        "DatasetArgs.max_history_seqlen": MAX_HISTORY,
        "DatasetArgs.max_num_candidates": MAX_CANDIDATES,
        "NetworkArgs.num_layers": LAYERS,
        "NetworkArgs.num_attention_heads": HEADS,
        "NetworkArgs.hidden_size": HIDDEN,
        "NetworkArgs.kv_channels": KV_CHANNELS,
        "NetworkArgs.num_position_buckets": POSITION_BUCKETS,
        "NetworkArgs.dtype_str": "'float32'",
        "RankingArgs.prediction_head_arch": HEAD_ARCH,
        "RankingArgs.prediction_head_bias": True,
        "RankingArgs.num_tasks": TASKS,
    }
    bindings.update(overrides)
    lines = ["# recsys-examples ranking, small dims for kvexport's tests"]
    lines += [f"{name} = {value}" for name, value in bindings.items() if value is not None]
    return "\n".join(lines) + "\n"


def dense_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """The trainer's dense tensors by their names (x @ W layers stored [in, out])."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g) * 0.3

    state = {}
    for i in range(LAYERS):
        p = f"_hstu_block._attention_layers.{i}."
        state[p + "_linear_uvqk_weight"] = r(HIDDEN, 4 * HIDDEN)
        state[p + "_linear_uvqk_bias"] = r(4 * HIDDEN)
        state[p + "_input_layernorm_weight"] = 1 + r(HIDDEN)
        state[p + "_input_layernorm_bias"] = r(HIDDEN)
        state[p + "_output_layernorm_weight"] = 1 + r(HIDDEN)
        state[p + "_output_layernorm_bias"] = r(HIDDEN)
        state[p + "_linear_proj_weight"] = r(HIDDEN, HIDDEN)
    state["_hstu_block._preprocessor._positional_encoder._position_embeddings_weight"] = r(POSITION_BUCKETS, HIDDEN)
    state["_mlp._mlp.0.weight"] = r(HEAD_ARCH[0], HIDDEN)
    state["_mlp._mlp.0.bias"] = r(HEAD_ARCH[0])
    state["_mlp._mlp.2.weight"] = r(TASKS, HEAD_ARCH[0])
    state["_mlp._mlp.2.bias"] = r(TASKS)
    return state


def tables(seed: int = 0, contextual: bool = False) -> dict[str, dict]:
    """name -> {"kind": "flat" | "dynamic", "rows": [n, d] tensor, "keys": [...] (dynamic)}; flat ones in name order."""
    g = torch.Generator().manual_seed(seed + 100)
    out = {}
    if contextual:
        for name, rows in CONTEXT_TABLES.items():
            out[name] = {"kind": "flat", "rows": torch.randn(rows, HIDDEN, generator=g)}
        out["user_id"] = {
            "kind": "dynamic",
            "keys": USER_KEYS,
            "rows": torch.randn(len(USER_KEYS), HIDDEN, generator=g),
        }
    out["action_weights"] = {"kind": "flat", "rows": torch.randn(ACTION_ROWS, HIDDEN, generator=g)}
    out["video_id"] = {"kind": "dynamic", "keys": ITEM_KEYS, "rows": torch.randn(len(ITEM_KEYS), HIDDEN, generator=g)}
    return out


def write_checkpoint(
    save_dir: Path, world: int, state: dict[str, torch.Tensor], all_tables: dict[str, dict], iteration: int = 550
) -> Path:
    """Writes SAVE/iter<iteration>/ for `world` ranks; returns that directory."""
    root = save_dir / f"iter{iteration}"
    (root / "torch_module").mkdir(parents=True)
    flat_names = [n for n, t in all_tables.items() if t["kind"] == "flat"]
    model_state = dict(state)
    model_state[FLAT.format("/".join(flat_names))] = torch.cat([all_tables[n]["rows"] for n in flat_names]).flatten()
    for name, table in all_tables.items():
        if table["kind"] == "dynamic":
            model_state[f"_embedding_collection._model_parallel_embedding_collection.embeddings.{name}.weight"] = (
                torch.empty(len(table["keys"]), HIDDEN, device="meta")
            )
    for rank in range(world):
        torch.save(
            {
                "model_state_dict": model_state,
                "optimizer_state_dict": {"step": torch.tensor(550), "config": OptimizerConfig()},
            },
            root / "torch_module" / f"model.{rank}.pth",
        )
    dumps = root / "dynamicemb_module" / COLLECTION
    dumps.mkdir(parents=True)
    for name, table in all_tables.items():
        if table["kind"] != "dynamic":
            continue
        keys = torch.tensor(table["keys"], dtype=torch.int64)
        for rank in range(world):
            mine = (keys % world == rank).nonzero().flatten().flip(0)  # the rank's own order
            suffix = f"rank_{rank}.world_size_{world}"
            (dumps / f"{name}_emb_keys.{suffix}").write_bytes(keys[mine].numpy().tobytes())
            (dumps / f"{name}_emb_values.{suffix}").write_bytes(table["rows"][mine].float().numpy().tobytes())
            (dumps / f"{name}_emb_scores.{suffix}").write_bytes(torch.arange(len(mine)).numpy().tobytes())
            (dumps / f"{name}_emb_opt_values.{suffix}").write_bytes(torch.zeros(len(mine), HIDDEN).numpy().tobytes())
    return root


def write_sample(out: Path, world: int = 2) -> None:
    """OUT/save (the trainer's save directory, `world` ranks, contextual features user_id,
    user_active_degree, register_days_range) and OUT/ranking.gin."""
    out.mkdir(parents=True, exist_ok=True)
    write_checkpoint(out / "save", world, dense_state(), tables(contextual=True))
    (out / "ranking.gin").write_text(gin_text())


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 2:
        sys.exit("usage: python -m tests.helpers.nvidia_fixture OUT")
    write_sample(Path(sys.argv[1]))
    print(f"wrote {sys.argv[1]}/save (a recsys-examples ranking checkpoint, 2 ranks) and {sys.argv[1]}/ranking.gin")
