"""AOTInductor packaging of an exported cached model, and what the package turned out to call."""

from __future__ import annotations

import json
import zipfile
from collections import Counter
from pathlib import Path

import torch
from torch.export import ExportedProgram

from kvexport import elf, toolchain
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
    """aoti_compile_and_package with string metadata (read back by get_metadata in Python and C++),
    further inductor settings (kvexport.isa.inductor_configs) and the C++ compiler kvexport.toolchain
    chose (the one that built the op library)."""
    library.load()  # effects must be declared before compile too
    configs = {**(inductor_configs or {}), **toolchain.inductor_configs(toolchain.select_compiler()),
               "aot_inductor.metadata": metadata}
    return Path(torch._inductor.aoti_compile_and_package(ep, package_path=str(path), inductor_configs=configs))


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
