"""A Meta generative-recommenders DLRMv3 checkpoint (`DlrmHSTU`, kuairand-shaped), written in the
trainer's own on-disk layout (`save_dmp_checkpoint`) with synthetic weights and small dimensions.

    <out>/<batch>/non_sparse.ckpt   rank 0's torch.save of {"dense_dict", "optimizer_dict",
                                    "class_metrics", "reg_metrics", "global_step", "sparse_tensor_keys"}
    <out>/<batch>/sparse/           torch.distributed.checkpoint of {"sparse_dict": {FQN: ShardedTensor}},
                                    keys sparse_dict._embedding_collection.embeddings.<table>.weight

dense_dict holds every parameter and persistent buffer of a bare DlrmHSTU (float32; the action
bits buffer int64) under its own names; sparse_tensor_keys is a Python set of the table FQNs;
the tables are float16, row-sharded over WORLD gloo processes that a subprocess spawns
(`python -m tests.helpers.meta_fixture SPARSE_DIR WORLD PORT SEED`), so no process group touches the caller.
The optimizer and metric entries are stand-ins of the same kind (Adam state by parameter name,
metric state dicts of tensors); their exact inner names upstream are unverified.

Upstream fixes some sizes in DlrmHSTU.__init__ that its config cannot change: 8192 position rows,
2049 time rows (2048 buckets), 512-wide item tower and prediction head, 8-wide action rows. Here
they are Sizes' POSITION_ROWS, TIME_ROWS, MLP_WIDTH and ACTION_DIM (kept at 8), in DEFAULT_SIZES
small enough that the tests reach the position and time caps. dense_state, tables and
synthetic_state take other sizes as `sizes` (benchmarks/meta_rules.py); write_checkpoint always
writes DEFAULT_SIZES. The user_active_degree feature is gated at a merged length of 6, as
movielens and streaming gate theirs at 20 (kuairand gates none).
"""

from __future__ import annotations

import collections
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import torch

from tests.helpers import ROOT
from tests.helpers.meta_reference import HEAD, POS, POST, PRE, STU, Features


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The sizes of a synthetic DlrmHSTU: D model width, E table width, HIDDEN the input MLPs'
    hidden width, HEADS x (DQK, DV) attention, LAYERS STU layers, POSITION_ROWS and TIME_ROWS the
    position and time tables, MLP_WIDTH the item tower's and prediction head's width, ACTION_DIM
    an action row's width, ACTION_WEIGHTS the action bits, TASKS the logits a candidate, and
    TABLE_ROWS the rows of each embedding table (item_table and contextual_tables of FEATURES)."""

    D: int
    E: int
    HIDDEN: int
    HEADS: int
    DQK: int
    DV: int
    LAYERS: int
    POSITION_ROWS: int
    TIME_ROWS: int
    MLP_WIDTH: int
    ACTION_DIM: int
    ACTION_WEIGHTS: tuple[int, ...]
    TASKS: int
    TABLE_ROWS: dict[str, int]


DEFAULT_SIZES = Sizes(
    D=8,
    E=6,
    HIDDEN=10,
    HEADS=2,
    DQK=3,
    DV=4,
    LAYERS=2,  # dqk != dv, so a swapped split shows
    POSITION_ROWS=16,
    TIME_ROWS=33,
    MLP_WIDTH=12,
    ACTION_DIM=8,
    ACTION_WEIGHTS=(1, 2, 4),
    TASKS=2,
    TABLE_ROWS={"video_id": 40, "user_id": 10, "user_active_degree": 5},
)


# What kvexport imports: q/k heads as wide as u/v's (its cache holds k and v of one width), the
# tables as DEFAULT_SIZES' (so write_checkpoint's sparse/ writer, which always writes those, fits).
IMPORTABLE_SIZES = dataclasses.replace(DEFAULT_SIZES, DQK=DEFAULT_SIZES.DV)


def features_for(sizes: Sizes = DEFAULT_SIZES) -> Features:
    """The Features that weights at `sizes` are read with (only num_heads follows the sizes)."""
    return Features(
        num_heads=sizes.HEADS,
        item_table="video_id",
        contextual_tables=("user_id", "user_active_degree"),
        contextual_min_uih_lengths=(0, 6),
    )


FEATURES = features_for()
# DEFAULT_SIZES' entries that tests/test_meta_reference.py imports by name
POSITION_ROWS, TIME_ROWS, TABLE_ROWS = DEFAULT_SIZES.POSITION_ROWS, DEFAULT_SIZES.TIME_ROWS, DEFAULT_SIZES.TABLE_ROWS
BATCH = 4000  # the trainer's batch index: the checkpoint's directory name
TABLE_FQN = "_embedding_collection.embeddings.{}.weight"
SPARSE_KEY = "sparse_dict." + TABLE_FQN
BUFFERS = (PRE + "_action_encoder._combined_action_weights", POST + "_period_units", POST + "_units_per_period")


def dense_state(seed: int = 0, *, sizes: Sizes = DEFAULT_SIZES) -> dict[str, torch.Tensor]:
    """dense_dict: a bare DlrmHSTU's parameters and persistent buffers, in its registration order."""
    g = torch.Generator().manual_seed(seed)
    D, E, HIDDEN, HEADS, DQK, DV = sizes.D, sizes.E, sizes.HIDDEN, sizes.HEADS, sizes.DQK, sizes.DV
    MLP_WIDTH, ACTION_DIM, ACTION_WEIGHTS = sizes.MLP_WIDTH, sizes.ACTION_DIM, sizes.ACTION_WEIGHTS

    def r(*shape):
        return torch.randn(*shape, generator=g) * 0.3

    def mlp(prefix, inputs, hidden, outputs):  # Linear, SwishLayerNorm, Linear, LayerNorm
        return {
            prefix + "0.weight": r(hidden, inputs),
            prefix + "0.bias": r(hidden),
            prefix + "1.weight": 1 + r(hidden),
            prefix + "1.bias": r(hidden),
            prefix + "2.weight": r(outputs, hidden),
            prefix + "2.bias": r(outputs),
            prefix + "3.weight": 1 + r(outputs),
            prefix + "3.bias": r(outputs),
        }

    contextual = len(FEATURES.contextual_tables)
    state = {
        HEAD + "0.weight": r(MLP_WIDTH, D),
        HEAD + "0.bias": r(MLP_WIDTH),
        HEAD + "1.weight": 1 + r(MLP_WIDTH),
        HEAD + "1.bias": r(MLP_WIDTH),
        HEAD + "2.weight": r(sizes.TASKS, MLP_WIDTH),
        HEAD + "2.bias": r(sizes.TASKS),
    }
    uvqk = (2 * DV + 2 * DQK) * HEADS
    for i in range(sizes.LAYERS):
        p = f"{STU}{i}."
        state.update(
            {
                p + "_uvqk_weight": r(D, uvqk),
                p + "_uvqk_beta": r(uvqk),
                p + "_input_norm_weight": 1 + r(D),
                p + "_input_norm_bias": r(D),
                p + "_output_weight": r(3 * DV * HEADS, D),
                p + "_output_norm_weight": 1 + r(DV * HEADS),
                p + "_output_norm_bias": r(DV * HEADS),
            }
        )
    state[PRE + "_batched_contextual_linear_weights"] = r(contextual, E, D)
    state[PRE + "_batched_contextual_linear_bias"] = r(contextual, D)
    state.update(mlp(PRE + "_content_embedding_mlp.", E, HIDDEN, D))
    state.update(mlp(PRE + "_additional_embedding_mlp.", 0, HIDDEN, D))  # built even with no extra features
    state[PRE + "_action_encoder._action_embedding_table"] = r(len(ACTION_WEIGHTS), ACTION_DIM)
    state[PRE + "_action_encoder._target_action_embedding_table"] = r(1, len(ACTION_WEIGHTS) * ACTION_DIM)
    state[PRE + "_action_encoder._combined_action_weights"] = torch.tensor(ACTION_WEIGHTS, dtype=torch.int64)
    state.update(mlp(PRE + "_action_embedding_mlp.", len(ACTION_WEIGHTS) * ACTION_DIM, HIDDEN, D))
    state[POST + "_period_units"] = torch.tensor([[3600.0, 86400.0]])
    state[POST + "_units_per_period"] = torch.tensor([[24.0, 7.0]])
    state.update(
        {
            POST + "_layer_norm.weight": 1 + r(D),
            POST + "_layer_norm.bias": r(D),
            POST + "_time_feature_combiner.weight": r(D, D + 4),
            POST + "_time_feature_combiner.bias": r(D),
        }
    )
    state[POS + "_position_embeddings_weight"] = r(sizes.POSITION_ROWS, D)
    state[POS + "_timestamp_embeddings_weight"] = r(sizes.TIME_ROWS, D)
    state.update(mlp("_item_embedding_mlp.", E, MLP_WIDTH, D))
    return state


def tables(seed: int = 0, *, sizes: Sizes = DEFAULT_SIZES) -> dict[str, torch.Tensor]:
    """Table name -> rows [rows, E], float16 as every DLRMv3 table is."""
    g = torch.Generator().manual_seed(seed + 100)
    return {name: (torch.randn(rows, sizes.E, generator=g) * 0.5).half() for name, rows in sizes.TABLE_ROWS.items()}


def synthetic_state(
    seed: int = 0, *, sizes: Sizes = DEFAULT_SIZES
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(dense_dict, tables) at `sizes`; at DEFAULT_SIZES, what write_checkpoint writes for this seed."""
    return dense_state(seed, sizes=sizes), tables(seed, sizes=sizes)


def _trainer_extras(dense: dict[str, torch.Tensor], batch: int) -> dict:
    """The entries of non_sparse.ckpt besides dense_dict, of the kinds the trainer saves there."""
    params = [name for name in dense if name not in BUFFERS]
    adam = {
        name: {
            "step": torch.tensor(float(batch)),
            "exp_avg": torch.zeros_like(dense[name]),
            "exp_avg_sq": torch.zeros_like(dense[name]),
        }
        for name in params
    }
    metric = collections.OrderedDict(cross_entropy_sum=torch.tensor([0.7]), weighted_num_samples=torch.tensor([16.0]))
    return {
        "optimizer_dict": {
            "state": adam,
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.98), "eps": 1e-8, "weight_decay": 0.0, "params": params}],
        },
        "class_metrics": {"train": [metric], "eval": [metric]},
        "reg_metrics": {"train": [], "eval": []},
        "global_step": {"train": batch, "eval": 0},
        "sparse_tensor_keys": {TABLE_FQN.format(name) for name in TABLE_ROWS},
    }


def write_checkpoint(
    out: Path, world: int, port: int, batch: int = BATCH, seed: int = 0, sizes: Sizes = DEFAULT_SIZES
) -> Path:
    """Writes <out>/<batch>/ (non_sparse.ckpt here, sparse/ from `world` gloo processes in a
    subprocess, listening on `port`); returns that directory. sizes: the dense state's (the tables
    are always DEFAULT_SIZES')."""
    if (sizes.E, sizes.TABLE_ROWS) != (DEFAULT_SIZES.E, DEFAULT_SIZES.TABLE_ROWS):
        raise ValueError("write_checkpoint writes DEFAULT_SIZES' tables")
    root = out / str(batch)
    (root / "sparse").mkdir(parents=True)
    dense = dense_state(seed, sizes=sizes)
    torch.save({"dense_dict": dense, **_trainer_extras(dense, batch)}, root / "non_sparse.ckpt")
    command = [
        sys.executable,
        "-m",
        "tests.helpers.meta_fixture",
        str(root / "sparse"),
        str(world),
        str(port),
        str(seed),
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"the sparse/ writer failed ({done.returncode}): {done.stderr[-2000:]}")
    return root


class _SparseState:
    """A DCP Stateful as the trainer's SparseState is: state_dict() hands DCP the tables by FQN."""

    def __init__(self, tensors: dict):
        self._tensors = tensors

    def state_dict(self) -> dict:
        return self._tensors

    def load_state_dict(self, state_dict: dict) -> None:
        self._tensors.update(state_dict)


def _write_sparse_rank(rank: int, world: int, sparse: str, port: str, seed: int) -> None:
    """One rank's part of sparse/: its block of rows of every table, as a ShardedTensor."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed._shard.sharded_tensor import Shard, ShardMetadata, init_from_local_shards

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    state = {}
    for name, whole in tables(seed).items():
        rows = whole.shape[0]
        first, last = rows * rank // world, rows * (rank + 1) // world
        width = whole.shape[1]
        shard = Shard(whole[first:last].clone(), ShardMetadata([first, 0], [last - first, width], f"rank:{rank}/cpu"))
        state[TABLE_FQN.format(name)] = init_from_local_shards([shard], [rows, width])
    dist.barrier()
    dcp.save({"sparse_dict": _SparseState(state)}, storage_writer=dcp.FileSystemWriter(sparse))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    import torch.multiprocessing as mp

    if len(sys.argv) != 5:
        sys.exit("usage: python -m tests.helpers.meta_fixture SPARSE_DIR WORLD PORT SEED")
    sparse_dir, num_ranks, master_port, table_seed = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    mp.spawn(_write_sparse_rank, args=(num_ranks, sparse_dir, master_port, table_seed), nprocs=num_ranks)
