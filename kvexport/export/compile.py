"""AOTInductor compilation of an exported cached model, and the check that the package still calls
every custom op the exported graph did."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch
from torch.export import ExportedProgram

from kvexport.host.package_file import LIBRARIES, read_package
from kvexport.native import toolchain
from kvexport.ops import library, wrappers  # noqa: F401  (wrappers: the fakes a compile needs)


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


def compile_package(
    ep: ExportedProgram, path: Path, metadata: dict[str, str], inductor_configs: dict[str, object] | None = None
) -> Path:
    """aoti_compile_and_package with string metadata (read back by get_metadata in Python and C++),
    further inductor settings (kvexport.native.isa.inductor_configs) and the C++ compiler kvexport.native.toolchain
    chose (the one that built the op library)."""
    library.load()  # effects must be declared before compile too
    configs = {
        **(inductor_configs or {}),
        **toolchain.inductor_configs(toolchain.select_compiler()),
        "aot_inductor.metadata": metadata,
    }
    return Path(torch._inductor.aoti_compile_and_package(ep, package_path=str(path), inductor_configs=configs))


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
