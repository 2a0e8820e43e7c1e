"""A torch.distributed checkpoint (DCP) directory, read without running its pickle's code.

Meta's generative-recommenders saves its embedding tables with `torch.distributed.checkpoint.save`:
a directory of `__<rank>_<n>.distcp` data files and one `.metadata` file. torch's own reader
unpickles `.metadata` with plain `pickle.load`, which runs whatever the file names. Here it is
unpickled with only DCP's metadata records (as inert stand-ins that keep their fields), torch.Size,
dtypes and layouts allowed; any other name refuses the file, naming it. Each tensor chunk is a
`torch.save` archive at a recorded offset of a data file, read with `weights_only=True` and copied
into the whole tensor at once, so a table is held once plus one chunk (once when it is one chunk).
`read_rows` reads chosen rows of a table from where each chunk's archive stores them, without the
table: a deployment serves some of a trainer's items, whose tables run to 10^9 rows.
"""

from __future__ import annotations

import io
import os
import pickle
import pickletools
import zipfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any, BinaryIO

import torch

from kvexport.errors import UserError
from kvexport.importers.sharded import _Record, tiling_problem
from kvexport.io import first_line

METADATA_FILE = ".metadata"
_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
# The records of a .metadata pickle, each a stand-in that keeps its state (_Record.field).
_RECORD_NAMES = {
    (_METADATA_MODULE, name): type(name, (_Record,), {"__module__": __name__})
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
}
_RECORD_NAMES[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = type(
    "_StorageInfo", (_Record,), {"__module__": __name__}
)
_LAYOUTS = {"torch.strided": torch.strided, "torch.sparse_coo": torch.sparse_coo}


def _layout(name: str) -> torch.layout:
    """Stand-in for torch.serialization._get_layout: the layouts by name, nothing else."""
    if name not in _LAYOUTS:
        raise pickle.UnpicklingError(f"unknown layout {name!r}")
    return _LAYOUTS[name]


def _path(*parts: str) -> str:
    """Stand-in for pathlib's path classes (a checkpoint id): the path as text."""
    return "/".join(parts)


class _MetadataUnpickler(pickle.Unpickler):
    """Finds only DCP's metadata records, torch.Size, dtypes and layouts."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _RECORD_NAMES:
            return _RECORD_NAMES[module, name]
        if module == "torch" and name == "Size":
            return torch.Size
        if module == "torch" and isinstance(vars(torch).get(name), torch.dtype):  # no torch.__getattr__
            return vars(torch)[name]
        if module == "torch.serialization" and name == "_get_layout":
            return _layout
        if module == "pathlib" and name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"):
            return _path
        raise pickle.UnpicklingError(f"GLOBAL {module}.{name}")


def _field(record: Any, name: str, where: str, optional: bool = False) -> Any:
    """A record's field; an optional one (left out of the pickle when None) may be absent."""
    try:
        return record.field(name)
    except (AttributeError, UserError):
        if optional:
            return None
        raise UserError(f"{where}: its metadata lacks {name}") from None


def _properties(record: Any, where: str) -> torch.dtype:
    """The dtype of a TensorProperties record (pickled as a tuple: dtype first)."""
    state = getattr(record, "state", None)
    dtype = state[0] if isinstance(state, tuple) and state else _field(record, "dtype", where)
    if not isinstance(dtype, torch.dtype):
        raise UserError(f"{where}: its metadata gives no dtype")
    return dtype


def read_metadata(directory: Path) -> Any:
    """The checkpoint's Metadata record. UserError when missing, unreadable, or naming anything
    besides DCP's records (nothing of the file's choosing runs)."""
    path = directory / METADATA_FILE
    try:
        # From its bytes: a length the pickle declares for a string is then bounded by the file.
        data = path.read_bytes()
    except FileNotFoundError:
        raise UserError(f"{directory} is not a torch.distributed checkpoint: it has no {METADATA_FILE}") from None
    except OSError as exc:
        raise UserError(f"{path} is unreadable: {first_line(exc)}") from None
    try:
        return _MetadataUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError as exc:
        if not str(exc).startswith("GLOBAL "):
            raise UserError(f"{path} is unreadable: {first_line(exc)}") from None
        asked = str(exc).removeprefix("GLOBAL ")
        raise UserError(f"{path} is refused: it asks for {asked}, not a torch.distributed checkpoint record") from None
    except (EOFError, MemoryError, ValueError, TypeError, AttributeError, IndexError, KeyError) as exc:
        raise UserError(f"{path} is unreadable: {first_line(exc) or type(exc).__name__}") from None


class _FileView(io.RawIOBase):
    """length bytes of a file from offset, as a seekable file of their own (what torch.load reads)."""

    def __init__(self, file: BinaryIO, offset: int, length: int):
        super().__init__()
        self._file, self._offset, self._length, self._at = file, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._at

    def seek(self, position: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._at, io.SEEK_END: self._length}[whence]
        self._at = min(max(base + position, 0), self._length)
        return self._at

    def readinto(self, buffer) -> int:
        count = min(len(buffer), self._length - self._at)
        if count <= 0:
            return 0
        self._file.seek(self._offset + self._at)
        view = memoryview(buffer)[:count]
        got = self._file.readinto(view)
        self._at += got
        return got


def _entries(directory: Path) -> tuple[dict, dict]:
    """The checkpoint's entries by name, and each chunk's storage record by (name, offsets)."""
    metadata = read_metadata(directory)
    entries = _field(metadata, "state_dict_metadata", str(directory))
    storage = _field(metadata, "storage_data", str(directory))
    if not isinstance(entries, dict) or not isinstance(storage, dict):
        raise UserError(f"{directory / METADATA_FILE} is unreadable: its entries are not tables")
    where = {
        (
            _field(index, "fqn", str(directory)),
            tuple(_field(index, "offset", str(directory), optional=True) or ()),
        ): info
        for index, info in storage.items()
    }
    return entries, where


def tensor_sizes(directory: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor entry's size, from the metadata alone (no data file is read)."""
    entries, _ = _entries(directory)
    sizes = {}
    for key, entry in entries.items():
        if type(entry).__name__ == "TensorStorageMetadata":
            try:
                sizes[key] = tuple(int(n) for n in _field(entry, "size", key))
            except (TypeError, ValueError) as exc:
                raise UserError(f"{directory}: {key}: its metadata is malformed ({first_line(exc)})") from None
    return sizes


def _tensor_entry(directory: Path, entries: dict, key: str) -> Any:
    if key not in entries:
        raise UserError(f"{directory}: the checkpoint has no {key}")
    entry = entries[key]
    if type(entry).__name__ != "TensorStorageMetadata":
        raise UserError(f"{directory}: {key} is saved as pickled bytes, not a tensor")
    return entry


def read_tensors(directory: Path, keys: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors by name (every tensor entry, or `keys`), each assembled from its chunks.

    UserError naming the key: a key the checkpoint lacks, an entry that is pickled bytes rather
    than a tensor, a chunk written through a storage transform (compression), a data file missing
    or short, a chunk that is not a tensor of its recorded shape and dtype, chunks that leave gaps
    or overlap.
    """
    entries, where = _entries(directory)
    wanted = (
        [key for key, entry in entries.items() if type(entry).__name__ == "TensorStorageMetadata"]
        if keys is None
        else list(keys)
    )
    return {key: _read_tensor(directory, key, _tensor_entry(directory, entries, key), where) for key in wanted}


def _layout_of(directory: Path, key: str, entry: Any, where: dict):
    """(size, dtype, [(offsets, lengths, place)]) of a tensor entry: its chunks tile it, and each
    chunk's place in its data file is checked before anything is allocated, so that a few bytes of
    metadata cannot make the reader allocate more than the data files hold."""
    try:
        size = tuple(int(n) for n in _field(entry, "size", key))
        dtype = _properties(_field(entry, "properties", key), key)
        chunks = [
            (tuple(int(o) for o in _field(c, "offsets", key)), tuple(int(n) for n in _field(c, "sizes", key)))
            for c in _field(entry, "chunks", key)
        ]
    except UserError:
        raise
    except (TypeError, ValueError) as exc:
        raise UserError(f"{directory}: {key}: its metadata is malformed ({first_line(exc)})") from None
    problem = tiling_problem(size, chunks, "chunk")
    if problem:
        raise UserError(f"{directory}: {key}: {problem}")
    return (
        size,
        dtype,
        [
            (
                offsets,
                lengths,
                _chunk_place(
                    directory, key, where.get((key, offsets)), offsets, torch.Size(lengths).numel() * dtype.itemsize
                ),
            )
            for offsets, lengths in chunks
        ],
    )


def _read_tensor(directory: Path, key: str, entry: Any, where: dict) -> torch.Tensor:
    size, dtype, chunks = _layout_of(directory, key, entry, where)
    whole = None
    for offsets, lengths, place in chunks:
        chunk = _read_chunk(key, *place)
        if (
            tuple(chunk.shape) != lengths
            or chunk.dtype != dtype
            or chunk.layout != torch.strided
            or chunk.untyped_storage().nbytes() < chunk.numel() * chunk.element_size()
        ):
            raise UserError(
                f"{directory}: {key}: its chunk at {list(offsets)} holds {chunk.dtype} "
                f"{list(chunk.shape)} in {chunk.untyped_storage().nbytes()} bytes, the metadata says "
                f"{dtype} {list(lengths)}"
            )
        if len(chunks) == 1:  # the chunk is the tensor: no second copy
            return chunk.detach().contiguous()
        if whole is None:
            whole = torch.empty(size, dtype=dtype)
        whole[tuple(slice(o, o + n) for o, n in zip(offsets, lengths))] = chunk
    return torch.empty(size, dtype=dtype) if whole is None else whole  # None: an empty tensor, no chunk


def read_rows(directory: Path, key: str, rows: torch.Tensor) -> torch.Tensor:
    """Rows `rows` (int64 [n], any order, repeats allowed) of the checkpoint's 2-D tensor `key`, as
    [n, columns] in its dtype. Each row is read from its chunk's values in the data file, where the
    chunk's archive stores them, so memory holds the rows asked for and never the table (an item
    table of 10^9 rows is a terabyte). A chunk's archive is opened only as far as its tensor's
    description (torch.load onto the meta device, weights_only=True) and its zip directory.

    UserError naming the key: what read_tensors refuses, a tensor that is not 2-D, a row outside
    it, a chunk whose archive is compressed, holds other than one storage, or stores its rows other
    than as runs of values within that storage.
    """
    entries, where = _entries(directory)
    size, dtype, chunks = _layout_of(directory, key, _tensor_entry(directory, entries, key), where)
    if len(size) != 2:
        raise UserError(f"{directory}: {key} is {list(size)}, not a table of rows")
    if rows.dtype != torch.int64 or rows.dim() != 1:
        raise TypeError(f"rows must be a 1-D int64 tensor, got {rows.dtype} {list(rows.shape)}")
    outside = (rows < 0) | (rows >= size[0])
    if bool(outside.any()):
        raise UserError(f"{directory}: {key} has {size[0]} rows; row {int(rows[outside][0])} is not one of them")
    wanted, inverse = torch.unique(rows, sorted=True, return_inverse=True)
    got = torch.empty(wanted.shape[0], size[1], dtype=dtype)
    for offsets, lengths, place in chunks:
        first, last = (int(torch.searchsorted(wanted, offsets[0] + n)) for n in (0, lengths[0]))
        if first < last and lengths[1] > 0:
            _read_chunk_rows(key, *place, offsets, lengths, dtype, wanted[first:last], got[first:last])
    # Rows asked for ascending without repeats are the unique rows themselves: no second copy.
    return got if bool((inverse[1:] > inverse[:-1]).all()) else got[inverse]


def _read_chunk_rows(
    key: str,
    path: Path,
    offset: int,
    length: int,
    offsets: tuple[int, int],
    lengths: tuple[int, int],
    dtype: torch.dtype,
    rows: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """Reads rows (ascending, inside the chunk) of a chunk at `offsets` into out's columns of the chunk."""
    with open(path, "rb") as file:
        view = _FileView(file, offset, length)
        start, described = _storage_of(key, path, view)
        if (
            tuple(described.shape) != lengths
            or described.dtype != dtype
            or described.layout != torch.strided
            or described.stride(1) != 1
        ):
            raise UserError(
                f"{path}: the chunk of {key} at {list(offsets)} holds {described.dtype} "
                f"{list(described.shape)} with strides {list(described.stride())}; the metadata says "
                f"{dtype} {list(lengths)} stored row by row"
            )
        itemsize, (row_stride, _) = dtype.itemsize, described.stride()
        end = described.storage_offset() + (lengths[0] - 1) * row_stride + lengths[1]
        storage_bytes = described.untyped_storage().nbytes()
        if described.storage_offset() < 0 or row_stride < lengths[1] or end * itemsize > storage_bytes:
            raise UserError(f"{path}: the chunk of {key} at {list(offsets)} places its rows outside its storage")
        # out's bytes as a numpy array: slicing it costs far less than slicing a tensor, once a row.
        out_bytes = out.view(torch.uint8).numpy()
        columns = slice(offsets[1] * itemsize, (offsets[1] + lengths[1]) * itemsize)
        local = (rows - offsets[0]).tolist()
        contiguous = row_stride == lengths[1] and out.shape[1] == lengths[1]
        base = offset + start + described.storage_offset() * itemsize
        i = 0
        while i < len(local):
            run = 1
            if contiguous:  # consecutive rows: one read
                while i + run < len(local) and local[i + run] == local[i] + run:
                    run += 1
            target = out_bytes[i : i + run] if contiguous else out_bytes[i, columns]
            _read_exactly(file, base + local[i] * row_stride * itemsize, memoryview(target).cast("B"), key, path)
            i += run


def _storage_of(key: str, path: Path, view: _FileView) -> tuple[int, torch.Tensor]:
    """A chunk archive's one storage: where its values start within the archive, and the tensor's
    description (shape, dtype, strides, storage offset, storage size) on the meta device."""
    try:
        archive = zipfile.ZipFile(view)
        storages = [info for info in archive.infolist() if info.filename.split("/")[-2:-1] == ["data"]]
        small = {name: _small_entry(archive, name) for name in ("byteorder", "data.pkl")}
        named = _storage_key(small["data.pkl"])
        view.seek(0)
        described = torch.load(io.BufferedReader(view), map_location="meta", weights_only=True)
    except (
        zipfile.BadZipFile,
        zipfile.LargeZipFile,
        pickle.UnpicklingError,
        RuntimeError,
        EOFError,
        OSError,
        NotImplementedError,
        ValueError,
    ) as exc:
        raise UserError(f"{path}: the chunk of {key} is unreadable: {first_line(exc) or type(exc).__name__}") from None
    if not isinstance(described, torch.Tensor):
        raise UserError(f"{path}: the chunk of {key} is a {type(described).__name__}, not a tensor")
    order = small["byteorder"]
    if (
        len(storages) != 1
        or storages[0].compress_type != zipfile.ZIP_STORED
        or order not in (None, b"little")
        or storages[0].filename.rsplit("/", 1)[1] != named
    ):
        raise UserError(
            f"{path}: the chunk of {key} is not one uncompressed little-endian storage that its tensor "
            "names; kvexport reads rows only from those"
        )
    info = storages[0]
    view.seek(info.header_offset)
    header = view.read(30)
    if len(header) != 30 or header[:4] != b"PK\x03\x04":
        raise UserError(f"{path}: the chunk of {key} is unreadable: a broken zip entry")
    start = info.header_offset + 30 + int.from_bytes(header[26:28], "little") + int.from_bytes(header[28:30], "little")
    if info.file_size < described.untyped_storage().nbytes() or start + info.file_size > view.seek(0, io.SEEK_END):
        raise UserError(f"{path}: the chunk of {key} is shorter than its tensor")
    return start, described


def _small_entry(archive: zipfile.ZipFile, suffix: str, limit: int = 1 << 16) -> bytes | None:
    """An archive's entry ending in /suffix, stored and at most `limit` bytes (a compressed or
    oversized one raises ValueError before anything is inflated or allocated); None if absent."""
    entries = [info for info in archive.infolist() if info.filename.endswith("/" + suffix)]
    if not entries:
        return None
    info = entries[0]
    if len(entries) > 1 or info.compress_type != zipfile.ZIP_STORED or info.file_size > limit:
        raise ValueError(f"its {suffix} entry is compressed, repeated or over {limit} bytes")
    return archive.read(info)


def _storage_key(data_pkl: bytes | None) -> str | None:
    """The storage key the archive's tensor names: the one persistent id of its pickle, read from the
    opcodes (nothing is unpickled): ('storage', <type>, key, location, numel). None unless exactly one."""
    if data_pkl is None:
        return None
    ops = list(pickletools.genops(data_pkl))
    ids = [i for i, (op, _, _) in enumerate(ops) if op.name == "BINPERSID"]
    if len(ids) != 1:
        return None
    marks = [i for i, (op, _, _) in enumerate(ops[: ids[0]]) if op.name == "MARK"]
    strings = [
        arg
        for op, arg, _ in ops[marks[-1] + 1 if marks else 0 : ids[0]]
        if op.name in ("BINUNICODE", "SHORT_BINUNICODE", "UNICODE", "BINUNICODE8")
    ]
    return strings[1] if len(strings) >= 2 and strings[0] == "storage" else None


def _read_exactly(file: BinaryIO, at: int, buffer: memoryview, key: str, path: Path) -> None:
    """Fills buffer from the file at `at` (one pread, no seek, unless the read comes short)."""
    while buffer:
        got = os.preadv(file.fileno(), [buffer], at)
        if not got:
            raise UserError(f"{path}: the chunk of {key} ends inside a row")
        buffer, at = buffer[got:], at + got


def _chunk_place(directory: Path, key: str, info: Any, offsets: tuple[int, ...], nbytes: int) -> tuple[Path, int, int]:
    """(data file, offset, length) of one chunk, checked: recorded, untransformed, inside the
    checkpoint's directory, within its file, and long enough for its values."""
    if info is None:
        raise UserError(f"{directory}: {key}: no data file holds its chunk at {list(offsets)}")
    transforms = _field(info, "transform_descriptors", key, optional=True)
    if transforms:
        raise UserError(
            f"{directory}: {key} is stored through {list(transforms)} (compressed or transformed), "
            "which kvexport does not read"
        )
    relative = str(_field(info, "relative_path", key))
    try:
        offset, length = int(_field(info, "offset", key)), int(_field(info, "length", key))
    except (TypeError, ValueError):
        raise UserError(
            f"{directory}: {key}: its chunk at {list(offsets)} has no offset and length in a file"
        ) from None
    path = directory / relative
    if not path.resolve().is_relative_to(directory.resolve()):
        raise UserError(f"{directory}: {key}: its data file {relative!r} lies outside the checkpoint")
    if not path.is_file():
        raise UserError(f"{directory}: the data file {relative} of {key} is missing")
    if offset < 0 or length < nbytes or path.stat().st_size < offset + length:
        raise UserError(
            f"{path} is shorter than the chunk of {key} it should hold ({nbytes} bytes of values in "
            f"{length} bytes at {offset})"
        )
    return path, offset, length


def _read_chunk(key: str, path: Path, offset: int, length: int) -> torch.Tensor:
    try:
        with open(path, "rb") as file:
            chunk = torch.load(
                io.BufferedReader(_FileView(file, offset, length)), map_location="cpu", weights_only=True
            )
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, MemoryError) as exc:
        raise UserError(f"{path}: the chunk of {key} is unreadable: {first_line(exc) or type(exc).__name__}") from None
    if not isinstance(chunk, torch.Tensor):
        raise UserError(f"{path}: the chunk of {key} is a {type(chunk).__name__}, not a tensor")
    return chunk
