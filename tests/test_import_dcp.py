"""Reading a torch.distributed checkpoint (Meta's `sparse/`) without running its pickle's code:
real checkpoints written by 1 and 2 gloo processes (tests/helpers/sharded_writer.py), and broken or hostile
ones made from them."""

from __future__ import annotations

import io
import os
import pickle
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from kvexport.errors import UserError
from kvexport.importers.dcp import read_metadata, read_rows, read_tensors
from tests.helpers.network import free_port
from tests.helpers.sharded_writer import PREFIX, WRITER, actions, items

ITEMS, ACTIONS = PREFIX + "items.weight", PREFIX + "actions.weight"


@pytest.fixture(scope="module", params=[1, 2], ids=["world1", "world2"])
def checkpoint(request, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp(f"dcp-world{request.param}")
    subprocess.run(
        [sys.executable, str(WRITER), "dcp", str(out), str(request.param), str(free_port())],
        check=True,
        capture_output=True,
        timeout=120,
    )
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


def test_without_keys_every_tensor_entry_is_read(checkpoint):
    assert set(read_tensors(checkpoint)) == {ITEMS, ACTIONS}  # the step counter is bytes, left out


def test_metadata_that_claims_more_than_its_files_hold_is_refused_before_allocating(checkpoint, tmp_path):
    """A few bytes of metadata cannot make the reader allocate: a chunk's recorded length must hold
    its values, and its data file the recorded length."""
    sparse = copy_of(checkpoint, tmp_path)

    def enlarge(metadata):
        entry = metadata.state_dict_metadata[ACTIONS]
        entry.size = torch.Size([1 << 20, 1 << 12])
        entry.chunks[0].sizes = entry.size

    _rewrite_metadata(sparse, enlarge)
    with pytest.raises(UserError, match=rf"shorter than the chunk of {ACTIONS} it should hold \(8589934592 bytes"):
        read_tensors(sparse, [ACTIONS])


def test_a_data_file_outside_the_checkpoint_is_refused(checkpoint, tmp_path):
    sparse = copy_of(checkpoint, tmp_path)

    def escape(metadata):
        for info in metadata.storage_data.values():
            info.relative_path = "../" + info.relative_path

    _rewrite_metadata(sparse, escape)
    with pytest.raises(UserError, match=r"its data file '\.\./__[01]_0\.distcp' lies outside the checkpoint"):
        read_tensors(sparse, [ACTIONS])


def test_a_chunk_whose_data_disagrees_with_the_metadata_is_refused(checkpoint, tmp_path):
    """A chunk archive holding another shape, or an expanded tensor (few bytes for many values)."""
    sparse = copy_of(checkpoint, tmp_path)
    metadata = pickle.loads((sparse / ".metadata").read_bytes())
    ((index, info),) = [(i, s) for i, s in metadata.storage_data.items() if i.fqn == ACTIONS]
    data = sparse / info.relative_path
    for replacement in (torch.zeros(4, 3, dtype=torch.float16), torch.zeros(1, 1, dtype=torch.float16).expand(3, 4)):
        buffer = io.BytesIO()
        torch.save(replacement, buffer)
        info.offset, info.length = data.stat().st_size, max(len(buffer.getvalue()), 24)
        with data.open("ab") as out:
            out.write(buffer.getvalue().ljust(info.length, b"\0"))
        (sparse / ".metadata").write_bytes(pickle.dumps(metadata))
        with pytest.raises(UserError, match=rf"{ACTIONS}: its chunk at \[0, 0\] holds torch.float16 \[(4, 3|3, 4)\]"):
            read_tensors(sparse, [ACTIONS])
        with pytest.raises(
            UserError,
            match=rf"the chunk of {ACTIONS} at \[0, 0\] holds torch.float16 \[(4, 3\]|3, 4\] "
            r"with strides \[0, 0\])",
        ):
            read_rows(sparse, ACTIONS, torch.tensor([1]))


def test_a_truncated_or_garbled_metadata_file_is_unreadable(checkpoint, tmp_path):
    sparse = copy_of(checkpoint, tmp_path)
    metadata = sparse / ".metadata"
    metadata.write_bytes(metadata.read_bytes()[:40])
    with pytest.raises(UserError, match=r"\.metadata is unreadable"):
        read_tensors(sparse)
    metadata.write_bytes(b"\x80\x04\x8e" + (1 << 33).to_bytes(8, "little") + b"x")  # claims 8 GiB of bytes
    with pytest.raises(UserError, match=r"\.metadata is unreadable: pickle data was truncated"):
        read_tensors(sparse)


def test_rows_are_read_in_any_order_with_repeats_from_every_ranks_chunk(checkpoint):
    rows = torch.tensor([9, 0, 4, 4, 5, 1, 9])  # both halves of a two-rank table, out of order, repeated
    got = read_rows(checkpoint, ITEMS, rows)
    assert got.dtype == torch.float16 and torch.equal(got, items()[rows])
    assert torch.equal(read_rows(checkpoint, ITEMS, torch.arange(10)), items())
    assert torch.equal(read_rows(checkpoint, ACTIONS, torch.tensor([2])), actions()[2:])
    assert read_rows(checkpoint, ITEMS, torch.empty(0, dtype=torch.int64)).shape == (0, 4)


def test_rows_outside_the_table_or_of_no_table_are_refused(checkpoint):
    with pytest.raises(UserError, match=rf"{ITEMS} has 10 rows; row 10 is not one of them"):
        read_rows(checkpoint, ITEMS, torch.tensor([3, 10]))
    with pytest.raises(UserError, match=rf"{ITEMS} has 10 rows; row -1 is not one of them"):
        read_rows(checkpoint, ITEMS, torch.tensor([-1]))
    with pytest.raises(UserError, match="step is saved as pickled bytes, not a tensor"):
        read_rows(checkpoint, "step", torch.tensor([0]))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_rows_are_read_where_a_saved_view_keeps_them(tmp_path):
    """DCP saves a view with its whole storage: the rows of a column slice lie a wider row apart from
    an offset, and a transposed tensor's rows are not runs of values at all (refused, by name)."""
    import torch.distributed.checkpoint as dcp

    wide = torch.arange(80, dtype=torch.float32).reshape(10, 8)
    dcp.save(
        {"slice": wide[:, 2:6], "transposed": wide.t(), "flat": wide.reshape(-1)}, checkpoint_id=tmp_path, no_dist=True
    )
    rows = torch.tensor([9, 0, 3, 3])
    assert torch.equal(read_rows(tmp_path, "slice", rows), wide[:, 2:6][rows])
    with pytest.raises(
        UserError,
        match=r"the chunk of transposed at \[0, 0\] holds torch.float32 \[8, 10\] with "
        r"strides \[1, 8\]",
    ):
        read_rows(tmp_path, "transposed", torch.tensor([1]))
    with pytest.raises(UserError, match=r"flat is \[80\], not a table of rows"):
        read_rows(tmp_path, "flat", torch.tensor([1]))


def _rezip(blob: bytes, edit) -> bytes:
    """A torch.save archive rewritten entry by entry; edit(name, data) -> (name, data, compression)."""
    source, out = zipfile.ZipFile(io.BytesIO(blob)), io.BytesIO()
    with zipfile.ZipFile(out, "w") as target:
        for info in source.infolist():
            name, data, compression = edit(info.filename, source.read(info))
            target.writestr(name, data, compress_type=compression)
    return out.getvalue()


def test_rows_are_read_only_from_one_stored_storage_that_the_tensor_names(checkpoint, tmp_path):
    """A chunk archive whose byteorder entry is compressed (a zip bomb would inflate it), or whose
    one storage entry is not the one its pickle names, is refused before any row is read; the same
    tensor archived plainly is read."""
    sparse = copy_of(checkpoint, tmp_path)
    metadata = pickle.loads((sparse / ".metadata").read_bytes())
    ((_, info),) = [(i, s) for i, s in metadata.storage_data.items() if i.fqn == ACTIONS]
    data = sparse / info.relative_path
    blob = io.BytesIO()
    torch.save(actions().clone(), blob)
    variants = {  # edit, what the refusal says
        "is unreadable: its byteorder entry is compressed": lambda name, body: (
            name,
            body,
            zipfile.ZIP_DEFLATED if name.endswith("/byteorder") else zipfile.ZIP_STORED,
        ),
        "is unreadable: .*data/0": lambda name, body: (name.replace("/data/0", "/data/1"), body, zipfile.ZIP_STORED),
    }
    for refusal, edit in variants.items():
        archive = _rezip(blob.getvalue(), edit)
        info.offset, info.length = data.stat().st_size, len(archive)
        with data.open("ab") as out:
            out.write(archive)
        (sparse / ".metadata").write_bytes(pickle.dumps(metadata))
        with pytest.raises(UserError, match=f"the chunk of {ACTIONS} {refusal}"):
            read_rows(sparse, ACTIONS, torch.tensor([1]))
    info.offset, info.length = data.stat().st_size, len(blob.getvalue())
    with data.open("ab") as out:
        out.write(blob.getvalue())
    (sparse / ".metadata").write_bytes(pickle.dumps(metadata))
    assert torch.equal(read_rows(sparse, ACTIONS, torch.tensor([1])), actions()[1:2])
