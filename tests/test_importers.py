"""Reading trainers' checkpoint files safely (kvexport.importers): torch.distributed ShardedTensors
through inert stand-ins under torch's restricted unpickler, every rank's shards joined into one
tensor, types a trainer keeps beside the model state as inert stand-ins, and anything else
refused by name."""

from __future__ import annotations

import os
import pickle
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvexport.errors import UserError
from kvexport.importers.sharded import LocalShard, ShardedValue, _restricted_getattr, assemble, load_trainer_file
from tests.helpers.network import free_port
from tests.helpers.sharded_writer import WRITER

TABLE = torch.arange(40, dtype=torch.float32).reshape(10, 4)  # what sharded_writer.py shards


@pytest.fixture(scope="module", params=[1, 2], ids=["world1", "world2"])
def trainer_dir(request, tmp_path_factory) -> tuple[Path, int]:
    out = tmp_path_factory.mktemp(f"world{request.param}")
    subprocess.run(
        [sys.executable, str(WRITER), "torch_save", str(out), str(request.param), str(free_port())],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return out, request.param


def test_the_files_need_more_than_torchs_restricted_unpickler(trainer_dir):
    out, _ = trainer_dir
    with pytest.raises(pickle.UnpicklingError, match="ShardedTensor"):
        torch.load(out / "model.0.pth", weights_only=True)


def test_every_ranks_shards_make_the_whole_table(trainer_dir):
    out, world = trainer_dir
    states = [load_trainer_file(out / f"model.{rank}.pth", "checkpoint")["model_state_dict"] for rank in range(world)]
    parts = [state["table.weight"] for state in states]
    assert all(isinstance(part, ShardedValue) and part.size == (10, 4) for part in parts)
    assert [shard.offsets for part in parts for shard in part.shards] == [(10 * r // world, 0) for r in range(world)]
    assert torch.equal(assemble("table.weight", parts), TABLE)
    assert all(torch.equal(state["dense.weight"], torch.full((2, 3), 0.5)) for state in states)


def test_missing_and_overlapping_shards_are_refused_by_key():
    first = ShardedValue((10, 4), (LocalShard((0, 0), TABLE[:5]),))
    second = ShardedValue((10, 4), (LocalShard((5, 0), TABLE[5:]),))
    with pytest.raises(UserError, match=r"^table.weight: its shards leave gaps in its size \[10, 4\]$"):
        assemble("table.weight", [first])
    with pytest.raises(UserError, match=r"^table.weight: its shards overlap in its size \[10, 4\]$"):
        assemble("table.weight", [first, first, second])
    with pytest.raises(UserError, match=r"lies outside its size \[10, 4\]$"):
        assemble("table.weight", [ShardedValue((10, 4), (LocalShard((8, 0), TABLE[:5]),))])
    with pytest.raises(UserError, match="ranks disagree on its size"):
        assemble("table.weight", [first, ShardedValue((12, 4), second.shards)])


class _Runs:
    def __reduce__(self):
        return (os.mkdir, (self.path,))


def test_a_file_that_would_run_code_is_refused_and_nothing_runs(tmp_path):
    runs = _Runs()
    runs.path = str(tmp_path / "ran")
    torch.save({"model_state_dict": {"w": torch.ones(1)}, "hook": runs}, tmp_path / "evil.pth")
    with pytest.raises(
        UserError,
        match=r"^checkpoint .*evil.pth is refused: it holds more than tensors, containers "
        r"and sharded tensors \(it asks for posix.mkdir\)$",
    ):
        load_trainer_file(tmp_path / "evil.pth", "checkpoint")
    assert not (tmp_path / "ran").exists()


class _OptimizerConfig:
    """A trainer's own type in its optimizer state (as Megatron's optimizer saves its config):
    unpickling it the ordinary way would import this module and call its hook."""

    def __init__(self, path: str):
        self.path, self.lr, self.betas = path, 1e-3, (0.9, 0.999)

    def __setstate__(self, state):
        os.mkdir(state["path"])  # what unpickling it the ordinary way would do


def _touch(path: str) -> None:
    Path(path).touch()


class _Touches:
    """Unpickled the ordinary way, calls a function of the trainer's own module (one torch does not
    block by module, as it blocks os): _touch(path)."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (_touch, (self.path,))


def _trainer_file(tmp_path: Path, model_state: dict) -> Path:
    hooks = [_OptimizerConfig(str(tmp_path / "config_ran")), _Touches(str(tmp_path / "reduce_ran"))]
    torch.save(
        {
            "model_state_dict": model_state,
            "optimizer_state_dict": {
                "state": {0: {"exp_avg": torch.zeros(2)}},
                "config": hooks[0],
                "param_groups": [{"lr": 1e-3, "hook": hooks[1]}],
            },
        },
        tmp_path / "model.0.pth",
    )
    return tmp_path / "model.0.pth"


def test_types_the_reader_does_not_know_are_inert_outside_the_part_it_reads(tmp_path):
    path = _trainer_file(tmp_path, {"w": torch.arange(3.0)})
    saved = load_trainer_file(path, "checkpoint", part="model_state_dict")
    torch.testing.assert_close(saved["model_state_dict"]["w"], torch.arange(3.0), rtol=0, atol=0)
    assert not (tmp_path / "config_ran").exists() and not (tmp_path / "reduce_ran").exists()
    with pytest.raises(UserError, match=r"it asks for (tests\.)?test_importers\._OptimizerConfig\)$"):
        load_trainer_file(path, "checkpoint")  # the whole file read: the unknown type is refused
    assert not (tmp_path / "config_ran").exists()


def test_an_unknown_type_in_the_part_that_is_read_is_refused_by_key(tmp_path):
    path = _trainer_file(tmp_path, {"w": torch.ones(1), "extra": {"hook": _Touches(str(tmp_path / "ran"))}})
    with pytest.raises(
        UserError,
        match=r"^checkpoint .*model.0.pth is refused: model_state_dict.extra.hook holds "
        r"a (tests\.)?test_importers\._touch, not a tensor, container or sharded "
        r"tensor$",
    ):
        load_trainer_file(path, "checkpoint", part="model_state_dict")
    assert not (tmp_path / "ran").exists() and not (tmp_path / "reduce_ran").exists()


def test_a_module_torch_blocks_is_refused_wherever_it_is(tmp_path):
    """os, sys, subprocess...: torch's restricted unpickler refuses them outright, even as stand-ins."""
    runs = _Runs()
    runs.path = str(tmp_path / "ran")
    torch.save(
        {"model_state_dict": {"w": torch.ones(1)}, "optimizer_state_dict": {"hook": runs}}, tmp_path / "model.0.pth"
    )
    with pytest.raises(
        UserError,
        match=r"is refused: it holds more than tensors, containers and sharded tensors "
        r"\(it asks for posix.mkdir\)$",
    ):
        load_trainer_file(tmp_path / "model.0.pth", "checkpoint", part="model_state_dict")
    assert not (tmp_path / "ran").exists()


def test_the_only_attribute_a_pickle_may_look_up_is_the_process_group_state():
    from kvexport.importers.sharded import _ProcessGroupState, _ShardedTensor

    assert _restricted_getattr(_ShardedTensor, "ProcessGroupState") is _ProcessGroupState
    with pytest.raises(pickle.UnpicklingError, match=r"getattr\(_ShardedTensor, '__class__'\) is not allowed"):
        _restricted_getattr(_ShardedTensor, "__class__")
    with pytest.raises(pickle.UnpicklingError, match="is not allowed"):
        _restricted_getattr(os, "system")


def test_missing_and_unreadable_files_are_named(tmp_path):
    with pytest.raises(UserError, match=r"^checkpoint .*absent.pth does not exist$"):
        load_trainer_file(tmp_path / "absent.pth", "checkpoint")
    (tmp_path / "junk.pth").write_bytes(b"not a zip")
    with pytest.raises(UserError, match=r"^checkpoint .*junk.pth (is unreadable|is refused)"):
        load_trainer_file(tmp_path / "junk.pth", "checkpoint")


def write_dynamic_table(directory: Path, table: str, keys: torch.Tensor, values: torch.Tensor, world: int) -> None:
    """NVIDIA dynamicemb's dump layout: per rank the keys with key % world == rank, raw little-endian,
    in an order of the rank's own (hash order: here reversed)."""
    directory.mkdir(parents=True, exist_ok=True)
    for rank in range(world):
        mine = (keys % world == rank).nonzero().flatten().flip(0)
        suffix = f"rank_{rank}.world_size_{world}"
        (directory / f"{table}_emb_keys.{suffix}").write_bytes(int64_bytes(keys[mine].tolist()))
        (directory / f"{table}_emb_values.{suffix}").write_bytes(
            struct.pack(f"<{values[mine].numel()}f", *values[mine].flatten().tolist())
        )


def int64_bytes(values: list[int]) -> bytes:
    return struct.pack(f"<{len(values)}q", *values)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_a_dynamic_table_is_read_from_every_rank_into_rows_sorted_by_key(tmp_path, world):
    from kvexport.importers.nvidia import read_dynamic_table

    keys = torch.tensor([907, 3, 55, 1_000_000_007, 12, 40, 8])
    values = torch.randn(len(keys), 6, generator=torch.Generator().manual_seed(world))
    write_dynamic_table(tmp_path, "video_id", keys, values, world)
    table = read_dynamic_table(tmp_path, "video_id", 6)
    order = torch.argsort(keys)
    assert table.keys.tolist() == sorted(keys.tolist())
    assert torch.equal(table.values, values[order])


def test_dynamic_table_dumps_that_do_not_fit_are_refused_by_file(tmp_path):
    from kvexport.importers.nvidia import read_dynamic_table

    keys, values = torch.tensor([1, 2, 3, 4]), torch.ones(4, 2)
    write_dynamic_table(tmp_path / "ok", "t", keys, values, 2)
    with pytest.raises(UserError, match=r"^dynamic table u: no u_emb_keys.rank_R.world_size_W files in "):
        read_dynamic_table(tmp_path / "ok", "u", 2)
    with pytest.raises(
        UserError,
        match=r"t_emb_values.rank_0.world_size_2: 16 bytes, but 2 keys of 3 float32 "
        r"values need 24$",
    ):
        read_dynamic_table(tmp_path / "ok", "t", 3)

    missing = tmp_path / "missing"
    write_dynamic_table(missing, "t", keys, values, 2)
    (missing / "t_emb_values.rank_1.world_size_2").unlink()
    with pytest.raises(UserError, match=r"^dynamic table t: t_emb_values.rank_1.world_size_2 is missing from "):
        read_dynamic_table(missing, "t", 2)

    misplaced = tmp_path / "misplaced"
    write_dynamic_table(misplaced, "t", keys, values, 2)
    (misplaced / "t_emb_keys.rank_0.world_size_2").write_bytes(int64_bytes([2, 5]))
    with pytest.raises(
        UserError,
        match=r"t_emb_keys.rank_0.world_size_2: key 5 belongs to rank 1 of 2 \(round-robin "
        r"placement\), not 0$",
    ):
        read_dynamic_table(misplaced, "t", 2)

    twice = tmp_path / "twice"
    write_dynamic_table(twice, "t", torch.tensor([1, 1]), torch.ones(2, 2), 1)
    with pytest.raises(UserError, match=r"^dynamic table t: key 1 is held twice$"):
        read_dynamic_table(twice, "t", 2)

    odd = tmp_path / "odd"
    write_dynamic_table(odd, "t", keys, values, 1)
    (odd / "t_emb_keys.rank_0.world_size_1").write_bytes(b"\0" * 12)
    with pytest.raises(
        UserError, match=r"t_emb_keys.rank_0.world_size_1: 12 bytes is not a whole number of int64 keys$"
    ):
        read_dynamic_table(odd, "t", 2)


def test_a_gin_file_gives_its_literal_bindings_and_refuses_the_rest(tmp_path):
    from kvexport.importers.nvidia import read_gin

    gin = tmp_path / "ranking.gin"
    gin.write_text(
        "# kuairand ranking\nNetworkArgs.num_layers = 3\nNetworkArgs.num_attention_heads = 4  # heads\n"
        "NetworkArgs.norm_epsilon = 1e-5\nRankingArgs.prediction_head_arch = [\n    512,\n    8,\n]\n"
        "RankingArgs.prediction_head_act_type = 'relu'\nNetworkArgs.disable_contextual_mask = True\n"
    )
    assert read_gin(gin) == {
        "NetworkArgs.num_layers": 3,
        "NetworkArgs.num_attention_heads": 4,
        "NetworkArgs.norm_epsilon": 1e-5,
        "RankingArgs.prediction_head_arch": [512, 8],
        "RankingArgs.prediction_head_act_type": "relu",
        "NetworkArgs.disable_contextual_mask": True,
    }
    gin.write_text("NetworkArgs.num_layers = 3\nTrainerArgs.optimizer = @Adam\n")
    with pytest.raises(UserError, match=r"ranking.gin:2: TrainerArgs.optimizer = @Adam is not a literal value$"):
        read_gin(gin)
    gin.write_text("include 'base.gin'\n")
    with pytest.raises(UserError, match=r"ranking.gin:1: not a Class.field = value binding$"):
        read_gin(gin)
    gin.write_text("A.b = [1,\n")
    with pytest.raises(UserError, match=r"ranking.gin:1: a bracket is never closed$"):
        read_gin(gin)
