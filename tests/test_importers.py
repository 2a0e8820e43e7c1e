"""Reading trainers' checkpoint files safely (kvexport.importers): torch.distributed ShardedTensors
through inert stand-ins under torch's restricted unpickler, every rank's shards joined into one
tensor, and anything else a pickle may ask for refused by name."""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvexport.errors import UserError
from kvexport.importers.sharded import LocalShard, ShardedValue, _restricted_getattr, assemble, load_trainer_file

WRITER = Path(__file__).with_name("sharded_writer.py")
TABLE = torch.arange(40, dtype=torch.float32).reshape(10, 4)  # what sharded_writer.py shards


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


@pytest.fixture(scope="module", params=[1, 2], ids=["world1", "world2"])
def trainer_dir(request, tmp_path_factory) -> tuple[Path, int]:
    out = tmp_path_factory.mktemp(f"world{request.param}")
    subprocess.run([sys.executable, str(WRITER), str(out), str(request.param), free_port()], check=True,
                   capture_output=True, timeout=300)
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
    with pytest.raises(UserError, match=r"^checkpoint .*evil.pth is refused: it holds more than tensors, containers "
                                        r"and sharded tensors \(it asks for posix.mkdir\)$"):
        load_trainer_file(tmp_path / "evil.pth", "checkpoint")
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
