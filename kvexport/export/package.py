"""AOTInductor packaging of an exported cached model, and what the package turned out to call."""

from __future__ import annotations

import json
import struct
import zipfile
from collections import Counter
from pathlib import Path

import torch
from torch.export import ExportedProgram

from kvexport.errors import UserError
from kvexport.ops import jagged, library

# Op namespace -> the library that must be loaded before the package (by name, see manifest).
LIBRARIES = {library.NAMESPACE: "kvexport_ops", "fbgemm": jagged.FBGEMM_LIBRARY}


def graph_custom_ops(ep: ExportedProgram) -> Counter[str]:
    """Custom ops ("ns::name") called by an exported graph, effectful ones included."""
    ops: Counter[str] = Counter()
    for node in ep.graph.nodes:
        if node.op != "call_function":
            continue
        target = node.args[1] if "with_effects" in str(node.target) else node.target
        if isinstance(target, torch._ops.OpOverload) and target.namespace in LIBRARIES:
            ops[f"{target.namespace}::{target._opname}"] += 1
    return ops


def required_libraries(ops: Counter[str]) -> list[str]:
    return sorted({LIBRARIES[name.split("::")[0]] for name in ops})


def compile_package(ep: ExportedProgram, path: Path, metadata: dict[str, str],
                    inductor_configs: dict[str, object] | None = None) -> Path:
    """aoti_compile_and_package with string metadata (read back by get_metadata in Python and C++)
    and further inductor settings (kvexport.isa.inductor_configs)."""
    library.load()  # effects must be declared before compile too
    return Path(torch._inductor.aoti_compile_and_package(
        ep, package_path=str(path), inductor_configs={**(inductor_configs or {}), "aot_inductor.metadata": metadata}
    ))


def _package_member(archive: zipfile.ZipFile, suffix: str) -> bytes:
    names = [n for n in archive.namelist() if n.endswith(suffix)]
    if len(names) != 1:
        raise UserError(f"{archive.filename} is not an AOTInductor package: no single *{suffix}")
    return archive.read(names[0])


def read_package(path: Path) -> tuple[dict[str, str], Counter[str]]:
    """Metadata and the extern (custom) ops the compiled package calls, without loading it."""
    try:
        with zipfile.ZipFile(path) as archive:
            metadata = json.loads(_package_member(archive, "wrapper_metadata.json"))
            extern = json.loads(_package_member(archive, "wrapper.json"))
    except (zipfile.BadZipFile, json.JSONDecodeError, OSError) as exc:
        raise UserError(f"{path} is not a readable AOTInductor package ({type(exc).__name__})") from exc
    ops = Counter(node["node"]["target"] for node in extern.get("nodes", []))
    return metadata, ops


def check_package_ops(path: Path, expected: Counter[str]) -> Counter[str]:
    """Every custom op of the exported graph must still be called by the compiled package.

    AOTI drops a custom op silently when it believes its result unused; a missing stateful op
    would make the package compute with a stale or empty cache.
    """
    _, found = read_package(path)
    missing = {op: n - found.get(op, 0) for op, n in expected.items() if found.get(op, 0) < n}
    if missing:
        detail = ", ".join(f"{op} (missing {n})" for op, n in sorted(missing.items()))
        raise RuntimeError(f"kvexport bug: the compiled package lost custom ops: {detail}")
    return found


ELF_HEADER = 64
PT_LOAD = 1


def check_shared_objects(path: Path) -> None:
    """Every shared object inside the package is whole: its loadable segments and its section table
    lie within its bytes. torch's loader maps a truncated one, and the process then dies of SIGBUS
    with no message; UserError naming the member instead."""
    try:
        with zipfile.ZipFile(path) as archive:
            for member in archive.infolist():
                if member.filename.endswith(".so"):
                    with archive.open(member) as data:
                        _check_elf(data, member.file_size, f"{path}: {member.filename}")
    except (zipfile.BadZipFile, OSError) as exc:
        raise UserError(f"{path} is not a readable AOTInductor package ({type(exc).__name__})") from exc


def _check_elf(data, size: int, name: str) -> None:
    """A 64-bit little-endian ELF file's header, program headers and section table against its size."""
    header = data.read(ELF_HEADER)
    if len(header) < ELF_HEADER or header[:4] != b"\x7fELF" or header[4] != 2 or header[5] != 1:
        raise UserError(f"{name} is not a 64-bit little-endian ELF shared object")
    phoff, shoff = struct.unpack_from("<QQ", header, 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", header, 0x36)
    if phoff < ELF_HEADER or phoff + phentsize * phnum > size or shoff + shentsize * shnum > size:
        raise UserError(f"{name} is truncated or corrupt: its ELF tables lie past its {size} bytes")
    if phnum and phentsize < 40:  # too short for p_type .. p_filesz
        raise UserError(f"{name} is truncated or corrupt: its program headers are {phentsize} bytes each")
    data.read(phoff - ELF_HEADER)
    table = data.read(phentsize * phnum)
    for i in range(phnum):
        kind, _, offset, _, _, file_size = struct.unpack_from("<IIQQQQ", table, i * phentsize)
        if kind == PT_LOAD and offset + file_size > size:
            raise UserError(f"{name} is truncated or corrupt: a loadable segment ends at byte "
                            f"{offset + file_size}, past its {size} bytes")
