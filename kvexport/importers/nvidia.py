"""What NVIDIA recsys-examples' HSTU trainer writes besides its `.pth` (docs/checkpoint.md).

Hash-keyed tables (dynamicemb) are dumped per rank as raw little-endian files in one directory:

    <table>_emb_keys.rank_<R>.world_size_<W>     int64 [n]
    <table>_emb_values.rank_<R>.world_size_<W>   float32 [n, dim], row-major

With the default round-robin placement rank R holds exactly the keys with key % W == R. The
trainer's hyper-parameters live in a gin file (`Class.field = value` lines).

Values are read in chunks straight into their sorted place: a table of a gigabyte costs its one
copy (rows sorted by key) plus a chunk, never two copies.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from kvexport.errors import UserError

_CHUNK_ROWS = 1 << 16
_DUMP = re.compile(r"^(?P<table>.+)_emb_(?P<kind>keys|values)\.rank_(?P<rank>\d+)\.world_size_(?P<world>\d+)$")


@dataclass(frozen=True)
class DynamicTable:
    """A hash-keyed table as dense rows: keys ascending, values[i] the row of keys[i]."""

    keys: torch.Tensor  # int64 [n], strictly increasing
    values: torch.Tensor  # float32 [n + spare rows, dim]


def _dump_files(directory: Path, table: str) -> dict[tuple[str, int], Path]:
    """(kind, rank) -> file of `table` in `directory`; every rank of one world size, both kinds."""
    found: dict[tuple[str, int], Path] = {}
    worlds: set[int] = set()
    for path in directory.iterdir() if directory.is_dir() else ():
        match = _DUMP.match(path.name)
        if match and match["table"] == table:
            found[(match["kind"], int(match["rank"]))] = path
            worlds.add(int(match["world"]))
    if not found:
        raise UserError(f"dynamic table {table}: no {table}_emb_keys.rank_R.world_size_W files in {directory}")
    if len(worlds) != 1:
        raise UserError(f"dynamic table {table}: dumps of several world sizes in {directory} ({sorted(worlds)})")
    world = worlds.pop()
    for kind in ("keys", "values"):
        for rank in range(world):
            if (kind, rank) not in found:
                raise UserError(
                    f"dynamic table {table}: {table}_emb_{kind}.rank_{rank}.world_size_{world} is missing "
                    f"from {directory}"
                )
    return found


def read_dynamic_table(directory: Path, table: str, dim: int, spare_rows: int = 0) -> DynamicTable:
    """Every rank's dump of `table` joined into dense rows sorted by key; `spare_rows` zero rows
    follow them in the same tensor (an importer's row for unknown keys, without a second copy).

    Refused by file: a size that is not a whole number of keys or rows of `dim` floats, keys and
    values of different lengths, a key on a rank round-robin placement does not give it, a key
    held twice.
    """
    files = _dump_files(directory, table)
    world = len(files) // 2
    keys_parts = []
    for rank in range(world):
        keys_file, values_file = files[("keys", rank)], files[("values", rank)]
        key_bytes, value_bytes = keys_file.stat().st_size, values_file.stat().st_size
        if key_bytes % 8:
            raise UserError(f"{keys_file}: {key_bytes} bytes is not a whole number of int64 keys")
        num_keys = key_bytes // 8
        if value_bytes != num_keys * dim * 4:
            raise UserError(
                f"{values_file}: {value_bytes} bytes, but {num_keys} keys of {dim} float32 values need "
                f"{num_keys * dim * 4}"
            )
        keys = (
            torch.frombuffer(bytearray(keys_file.read_bytes()), dtype=torch.int64)
            if num_keys  # little-endian
            else torch.empty(0, dtype=torch.int64)
        )
        misplaced = keys[keys % world != rank]
        if misplaced.numel():
            raise UserError(
                f"{keys_file}: key {int(misplaced[0])} belongs to rank {int(misplaced[0] % world)} of "
                f"{world} (round-robin placement), not {rank}"
            )
        keys_parts.append(keys)
    keys = torch.cat(keys_parts)
    order = torch.argsort(keys, stable=True)
    sorted_keys = keys[order]
    repeated = sorted_keys[1:][sorted_keys[1:] == sorted_keys[:-1]]
    if repeated.numel():
        raise UserError(f"dynamic table {table}: key {int(repeated[0])} is held twice")
    destination = torch.empty_like(order)  # the sorted row each dumped row goes to
    destination[order] = torch.arange(order.numel())
    values = torch.empty(keys.numel() + spare_rows, dim, dtype=torch.float32)
    values[keys.numel() :] = 0
    start = 0
    for rank, part in enumerate(keys_parts):
        _scatter_rows(files[("values", rank)], len(part), dim, destination[start : start + len(part)], values)
        start += len(part)
    return DynamicTable(sorted_keys, values)


def _scatter_rows(path: Path, num_rows: int, dim: int, destination: torch.Tensor, values: torch.Tensor) -> None:
    """values[destination[i]] = row i of a raw float32 [num_rows, dim] file, read _CHUNK_ROWS at a time."""
    with path.open("rb") as data:
        for first in range(0, num_rows, _CHUNK_ROWS):
            count = min(_CHUNK_ROWS, num_rows - first)
            rows = torch.frombuffer(bytearray(data.read(count * dim * 4)), dtype=torch.float32).reshape(count, dim)
            values[destination[first : first + count]] = rows


def read_gin(path: Path) -> dict[str, object]:
    """`Class.field = value` bindings of a gin file, values as Python literals ("Class.field" keys).

    Comments and blank lines are skipped; a line continues while brackets are open. A binding whose
    value is not a literal (a gin reference such as @fn or %MACRO), or an include/import line, is
    refused naming the line: kvexport takes only values it can check.
    """
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise UserError(f"trainer config {path}: {exc.strerror or exc}") from None
    bindings: dict[str, object] = {}
    pending, first = "", 0
    for number, line in enumerate(lines, 1):
        text = line.split("#", 1)[0].rstrip()
        if not text.strip() and not pending:
            continue
        if not pending:
            first = number
        pending += " " + text.strip()
        if sum(pending.count(o) - pending.count(c) for o, c in ("()", "[]", "{}")) > 0:
            continue
        name, equals, value = pending.partition("=")
        name, value, pending = name.strip(), value.strip(), ""
        if not equals or not re.fullmatch(r"[A-Za-z_][\w.]*\.[A-Za-z_]\w*", name):
            raise UserError(f"trainer config {path}:{first}: not a Class.field = value binding")
        try:
            bindings[name] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            raise UserError(f"trainer config {path}:{first}: {name} = {value} is not a literal value") from None
    if pending:
        raise UserError(f"trainer config {path}:{first}: a bracket is never closed")
    return bindings
