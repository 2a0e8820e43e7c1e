"""Reading a torch.distributed checkpoint (Meta's `sparse/`) without running its pickle's code:
real checkpoints written by 1 and 2 gloo processes (tests/sharded_writer.py), and broken or hostile
ones made from them."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvexport.errors import UserError
from kvexport.importers.dcp import read_metadata, read_tensors
from tests.sharded_writer import PREFIX, actions, items
from tests.test_importers import WRITER, free_port

ITEMS, ACTIONS = PREFIX + "items.weight", PREFIX + "actions.weight"


@pytest.fixture(scope="module", params=[1, 2], ids=["world1", "world2"])
def checkpoint(request, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp(f"dcp-world{request.param}")
    subprocess.run([sys.executable, str(WRITER), "dcp", str(out), str(request.param), free_port()], check=True,
                   capture_output=True, timeout=120)
    return out


def copy_of(checkpoint: Path, tmp_path: Path) -> Path:
    target = tmp_path / "sparse"
    target.mkdir(parents=True)
    for path in checkpoint.iterdir():
        (target / path.name).write_bytes(path.read_bytes())
    return target


def test_reads_every_tensor_whole_in_its_dtype(checkpoint):
    tensors = read_tensors(checkpoint, [ITEMS, ACTIONS])
    assert tensors[ITEMS].dtype == torch.float16 and torch.equal(tensors[ITEMS], items())
    assert torch.equal(tensors[ACTIONS], actions())


def test_a_sharded_table_is_joined_from_every_ranks_chunk(checkpoint):
    entry = read_metadata(checkpoint).field("state_dict_metadata")[ITEMS]
    ranks = len(list(checkpoint.glob("*.distcp")))
    assert len(entry.field("chunks")) == ranks
    assert torch.equal(read_tensors(checkpoint, [ITEMS])[ITEMS], items())


def test_refuses_what_is_not_a_tensor_or_not_there(checkpoint):
    with pytest.raises(UserError, match="step is saved as pickled bytes, not a tensor"):
        read_tensors(checkpoint, ["step"])
    with pytest.raises(UserError, match=r"the checkpoint has no sparse_dict\.missing"):
        read_tensors(checkpoint, ["sparse_dict.missing"])
    with pytest.raises(UserError, match="is not a torch.distributed checkpoint: it has no .metadata"):
        read_tensors(checkpoint.parent)


class _Hostile:
    """Pickles as a call of os.system: what a crafted .metadata could ask for."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def test_a_metadata_pickle_that_asks_for_more_is_refused_and_nothing_runs(checkpoint, tmp_path):
    sparse = copy_of(checkpoint, tmp_path)
    marker = tmp_path / "ran"
    (sparse / ".metadata").write_bytes(pickle.dumps({"state_dict_metadata": _Hostile(f"touch {marker}")}))
    with pytest.raises(UserError, match=r"\.metadata is refused: it asks for (posix|os)\.system"):
        read_tensors(sparse)
    assert not marker.exists()


def test_a_missing_or_short_data_file_is_named(checkpoint, tmp_path):
    sparse = copy_of(checkpoint, tmp_path)
    data = sorted(sparse.glob("*.distcp"))[-1]
    data.write_bytes(data.read_bytes()[:100])
    with pytest.raises(UserError, match=f"{data.name} is shorter than the chunk of"):
        read_tensors(sparse, [ITEMS, ACTIONS])
    data.unlink()
    with pytest.raises(UserError, match=f"the data file {data.name} of .* is missing"):
        read_tensors(sparse, [ITEMS, ACTIONS])


def _rewrite_metadata(sparse: Path, edit) -> None:
    """Edits the test's own (trusted) checkpoint metadata with torch's classes, for broken variants."""
    path = sparse / ".metadata"
    metadata = pickle.loads(path.read_bytes())
    edit(metadata)
    path.write_bytes(pickle.dumps(metadata))


def test_chunks_that_leave_gaps_or_are_transformed_are_refused(checkpoint, tmp_path):
    sparse = copy_of(checkpoint, tmp_path)

    def drop_a_chunk(metadata):
        entry = metadata.state_dict_metadata[ITEMS]
        entry.chunks = entry.chunks[:-1] if len(entry.chunks) > 1 else []

    _rewrite_metadata(sparse, drop_a_chunk)
    with pytest.raises(UserError, match=f"{ITEMS}: its chunks leave gaps in its size \\[10, 4\\]"):
        read_tensors(sparse, [ITEMS])

    sparse = copy_of(checkpoint, tmp_path / "second")

    def compress(metadata):
        for index, info in metadata.storage_data.items():
            if index.fqn == ACTIONS:
                info.transform_descriptors = ["zstd"]

    _rewrite_metadata(sparse, compress)
    with pytest.raises(UserError, match=f"{ACTIONS} is stored through \\['zstd'\\]"):
        read_tensors(sparse, [ACTIONS])
    assert torch.equal(read_tensors(sparse, [ITEMS])[ITEMS], items())
