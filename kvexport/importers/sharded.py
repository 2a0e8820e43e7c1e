"""Trainer files that hold torch.distributed ShardedTensors, read with `weights_only=True`.

Distributed trainers (torchrec; NVIDIA recsys-examples' `model.<rank>.pth`) save ShardedTensor
values in their state dicts. Loading one the ordinary way runs ShardedTensor.__setstate__, which
needs the trainer's process group, and torch's restricted unpickler refuses the types outright. Here
the names such a pickle refers to are mapped onto inert stand-ins declared in this module, so
torch's own restricted unpickler reads the file: nothing of the file's choosing runs. Each
ShardedTensor becomes a ShardedValue — its global size and the shards this file holds — and
assemble() joins the shards of every rank's file into one tensor, refusing gaps and overlaps.
"""

from __future__ import annotations

import dataclasses
import pickle
import re
from pathlib import Path
from typing import Any

import torch

from kvexport.errors import UserError
from kvexport.io import first_line


@dataclasses.dataclass(frozen=True)
class LocalShard:
    """One shard of a sharded tensor: where it starts in the global tensor, and its values."""

    offsets: tuple[int, ...]
    tensor: torch.Tensor


@dataclasses.dataclass(frozen=True)
class ShardedValue:
    """A ShardedTensor as one rank saved it: the global size and that rank's shards."""

    size: tuple[int, ...]
    shards: tuple[LocalShard, ...]


class _Record:
    """Stand-in for a plain data type of the pickle (a shard, its metadata, a device, a sharding
    spec): keeps its constructor arguments and state and does nothing else."""

    def __init__(self, *args: Any, **kwargs: Any):
        self.args, self.kwargs = args, kwargs

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def field(self, name: str) -> Any:
        state = getattr(self, "state", None)
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):  # (dict, slots)
            state = {**(state[0] or {}), **state[1]}
        if not isinstance(state, dict) or name not in state:
            raise UserError(f"sharded tensor record lacks its {name}")
        return state[name]


class _Unknown(_Record):
    """Stand-in for a type or function this reader does not know (an optimizer's config class, an
    enum): keeps what the pickle gives it and does nothing. Tolerated only outside the part of the
    file that is read (load_trainer_file's `part`)."""

    qualified_name = ""


def _unknown_stand_ins(path: Path) -> list[tuple[type, str]]:
    """An inert _Unknown subclass for every name the file's pickle refers to that neither torch's
    restricted unpickler nor STAND_INS knows (read from the pickle's opcodes, without loading it)."""
    with torch.serialization.safe_globals(STAND_INS):
        names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    return [
        (type(name.rsplit(".", 1)[-1], (_Unknown,), {"__module__": __name__, "qualified_name": name}), name)
        for name in names
    ]


def _first_unknown(value: Any, where: str) -> tuple[str, str] | None:
    """(where, qualified name) of the first _Unknown in a loaded value, or None."""
    if isinstance(value, _Unknown):
        return where, value.qualified_name
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, (list, tuple)):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        found = _first_unknown(item, f"{where}.{key}" if where else str(key))
        if found:
            return found
    return None


class _ProcessGroupState(tuple):
    """Stand-in for ShardedTensor.ProcessGroupState (a named tuple of ranks and world sizes)."""

    def __new__(cls, *fields: Any):
        return tuple.__new__(cls, fields)


class _ShardedTensor(torch.Tensor):
    """Stand-in for ShardedTensor: an empty wrapper whose state is the pickled shard list and
    metadata. It never computes (any op on it raises)."""

    ProcessGroupState = _ProcessGroupState

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise TypeError(f"a sharded tensor read from a checkpoint cannot run {func}")

    def __setstate__(self, state: Any) -> None:
        self.sharded_state = state


def _restricted_getattr(obj: Any, name: str) -> Any:
    """The pickle reaches ShardedTensor.ProcessGroupState through getattr: that lookup only."""
    if obj is _ShardedTensor and name == "ProcessGroupState":
        return _ProcessGroupState
    raise pickle.UnpicklingError(f"getattr({getattr(obj, '__name__', type(obj).__name__)}, {name!r}) is not allowed")


# Qualified name in the pickle -> stand-in.
_RECORD_TYPES = (
    "torch.distributed._shard.sharded_tensor.shard.Shard",
    "torch.distributed._shard.metadata.ShardMetadata",
    "torch.distributed.remote_device._remote_device",
    "torch.distributed._shard.sharded_tensor.metadata.ShardedTensorMetadata",
    "torch.distributed._shard.sharded_tensor.metadata.TensorProperties",
    "torch.distributed._shard.sharded_tensor.metadata.MEM_FORMAT_ENCODING",
    "torch.distributed._shard.sharding_spec.api.EnumerableShardingSpec",
    "torch.distributed._shard.sharding_spec.chunk_sharding_spec.ChunkShardingSpec",
)
_RECORDS = {name: type(name.rsplit(".", 1)[1], (_Record,), {"__module__": __name__}) for name in _RECORD_TYPES}
STAND_INS = [
    (_ShardedTensor, "torch.distributed._shard.sharded_tensor.api.ShardedTensor"),
    (_ProcessGroupState, f"{__name__}._ProcessGroupState"),
    (_restricted_getattr, "builtins.getattr"),
    (_restricted_getattr, "__builtin__.getattr"),
    *((record, name) for name, record in _RECORDS.items()),
]


def _convert(value: Any) -> Any:
    """Containers kept, stand-ins of sharded tensors turned into ShardedValue."""
    if isinstance(value, _ShardedTensor):
        local_shards, metadata, *_ = value.sharded_state
        shards = tuple(
            LocalShard(tuple(int(o) for o in shard.field("metadata").field("shard_offsets")), shard.field("tensor"))
            for shard in local_shards
        )
        return ShardedValue(tuple(int(s) for s in metadata.field("size")), shards)
    if isinstance(value, dict):
        return {k: _convert(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_convert(v) for v in value)
    return value


def load_trainer_file(path: Path, what: str, part: str | None = None) -> Any:
    """torch.load(weights_only=True) of a trainer's file, sharded tensors as ShardedValue.

    part: the one entry of the file's top-level dict that is read (a model's state dict). Whatever
    else the file holds (an optimizer's state with types of its trainer) may refer to any type or
    function: each becomes an inert stand-in, nothing of the file's choosing runs, and the entry
    must not hold one. Without `part` the whole file must be tensors, containers and sharded
    tensors. UserError naming the file when it is missing, unreadable, or holds more than that
    where it is read (naming the key and what it asks for).
    """
    try:
        unknown = _unknown_stand_ins(path) if part is not None else []
        with torch.serialization.safe_globals([*STAND_INS, *unknown]):
            data = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise UserError(f"{what} {path} does not exist") from None
    except pickle.UnpicklingError as exc:
        asked = re.search(r"GLOBAL ([\w.]+)", str(exc))
        raise UserError(
            f"{what} {path} is refused: it holds more than tensors, containers and sharded tensors"
            f"{f' (it asks for {asked.group(1)})' if asked else ''}"
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError) as exc:
        raise UserError(f"{what} {path} is unreadable: {first_line(exc)}") from None
    if part is not None and isinstance(data, dict) and part in data:
        found = _first_unknown(data[part], part)
        if found:
            raise UserError(
                f"{what} {path} is refused: {found[0]} holds a {found[1]}, not a tensor, container or sharded tensor"
            )
    return _convert(data)


MAX_PIECES = 4096  # shards or chunks of one tensor (a table over thousands of ranks); overlaps are checked pairwise


def tiling_problem(
    size: tuple[int, ...], boxes: list[tuple[tuple[int, ...], tuple[int, ...]]], noun: str
) -> str | None:
    """Why the (offsets, lengths) boxes of a tensor's pieces (`noun`: shard, chunk) do not cover
    `size` exactly once, or None when they do. Checked on the boxes: no mask as large as the table."""
    if any(n < 0 for n in size):
        return f"its size {list(size)} is negative"
    if len(boxes) > MAX_PIECES:
        return f"it has {len(boxes)} {noun}s, more than {MAX_PIECES}"
    for offsets, lengths in boxes:
        if (
            len(offsets) != len(size)
            or len(lengths) != len(size)
            or any(o < 0 or n < 0 or o + n > s for o, n, s in zip(offsets, lengths, size))
        ):
            return f"a {noun} at {list(offsets)} of shape {list(lengths)} lies outside its size {list(size)}"
    for i, (a_offsets, a_lengths) in enumerate(boxes):
        for b_offsets, b_lengths in boxes[i + 1 :]:
            if all(max(a, b) < min(a + m, b + n) for a, m, b, n in zip(a_offsets, a_lengths, b_offsets, b_lengths)):
                return f"its {noun}s overlap in its size {list(size)}"
    if sum(torch.Size(lengths).numel() for _, lengths in boxes) != torch.Size(size).numel():
        return f"its {noun}s leave gaps in its size {list(size)}"
    return None


def assemble(key: str, parts: list[ShardedValue]) -> torch.Tensor:
    """The whole tensor from every rank's ShardedValue of `key`: each element covered exactly once."""
    size = parts[0].size
    if any(part.size != size for part in parts):
        raise UserError(f"{key}: ranks disagree on its size ({sorted({part.size for part in parts})})")
    shards = [shard for part in parts for shard in part.shards]
    if not shards:
        raise UserError(f"{key}: no rank holds a shard of it")
    problem = tiling_problem(size, [(shard.offsets, tuple(shard.tensor.shape)) for shard in shards], "shard")
    if problem:
        raise UserError(f"{key}: {problem}")
    whole = torch.empty(size, dtype=shards[0].tensor.dtype)
    for shard in shards:
        whole[tuple(slice(o, o + n) for o, n in zip(shard.offsets, shard.tensor.shape))] = shard.tensor
    return whole
