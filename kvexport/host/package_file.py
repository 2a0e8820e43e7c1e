"""Reading a built AOTInductor package without loading it: its metadata, the custom ops it calls,
the libraries they need, and whether its shared objects are whole."""

from __future__ import annotations

import json
import zipfile
from collections import Counter
from pathlib import Path

from kvexport.errors import UserError
from kvexport.native import elf
from kvexport.ops import jagged, library

# Op namespace -> the library that must be loaded before the package (by name, see manifest).
LIBRARIES = {library.NAMESPACE: "kvexport_ops", "fbgemm": jagged.FBGEMM_LIBRARY}


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


def check_shared_objects(path: Path) -> None:
    """Every shared object inside the package is whole (its loadable segments and its section table
    lie within its bytes) and loads the shared C++ runtime. torch's loader maps a truncated one, and
    the process then dies of SIGBUS with no message; one with its own copy of the C++ runtime crashes
    the host at its first C++ exception (a refused request). UserError naming the member instead."""
    try:
        with zipfile.ZipFile(path) as archive:
            for member in archive.infolist():
                if member.filename.endswith(".so"):
                    with archive.open(member) as data:
                        elf.check_shared_object(data, member.file_size, f"{path}: {member.filename}")
    except (zipfile.BadZipFile, OSError) as exc:
        raise UserError(f"{path} is not a readable AOTInductor package ({type(exc).__name__})") from exc
