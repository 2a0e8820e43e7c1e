"""Loads the kvexport op library and declares what torch.export must know about its ops.

Loading does three things, always together and before any export or compile: the .so (schemas +
kernels), the fakes, and an ORDERED effect on every op that touches runtime state — without it,
export/AOTI drop ops whose outputs are unused (docs/design.md §3.1). The fakes are declared beside
each op's wrapper (kvexport/ops/wrappers.py, `fake`) and registered as the library loads or, when it
is loaded already, as they are declared: whatever exports or compiles imports the wrappers (the model
does; export.compile does for a saved program). The effect flag is not saved with an
ExportedProgram, so whatever exports or compiles (or re-exports a saved program) loads it through
this module. The stateful
ops are also chained by data, because Inductor has been seen to reorder effectful ops that were
ordered by their effect alone. A host that only runs a compiled package needs the .so, nothing here.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import torch
from torch._library.effects import EffectType

from kvexport.errors import UserError
from kvexport.native import elf
from kvexport.native.paths import OPS_LIBRARY

NAMESPACE = "kvexport"
# Every op the library defines (csrc/ops/register.cpp's TORCH_LIBRARY block, in its order).
OPS = (
    "check_request",
    "upload",
    "begin_batch",
    "paged_attention",
    "end_batch",
    "begin_step",
    "paged_attention_step",
    "create_runtime",
    "abort_batch",
    "last_error",
    "stat_names",
    "runtime_stats",
    "reset_runtime",
    "evict_user",
    "cached_length",
    "device_users_lru",
    "read_user_kv",
    "drop_runtime",
    "gpu_info",
    "attach_remote",
    "flush_remote",
    "redact_url",
    "hstu_paged_attention",
    "fp8_round",
)
# Ops that read or write runtime state and may appear in an exported graph: the cached model's,
# and the step program's (begin_step runs on the host, outside it).
STATEFUL_OPS = ("begin_batch", "paged_attention", "end_batch")
STEP_OPS = ("paged_attention_step",)
_lock = threading.Lock()
_loaded: Path | None = None
_fakes: dict[str, Callable] = {}


def fake(name: str) -> Callable[[Callable], Callable]:
    """Declares the fake (meta) implementation of op `name` for torch.export and AOTInductor, beside
    its wrapper; torch learns it when the library loads (at once if it is loaded already)."""
    if name not in OPS:
        raise RuntimeError(f"kvexport bug: a fake for {NAMESPACE}::{name}, which is not in library.OPS")

    def declare(implementation: Callable) -> Callable:
        with _lock:
            _fakes[name] = implementation
            if _loaded is not None:
                torch.library.register_fake(f"{NAMESPACE}::{name}")(implementation)
        return implementation

    return declare


def faked_ops() -> list[str]:
    """The ops whose fake is declared (in OPS order)."""
    return [name for name in OPS if name in _fakes]


def load(path: Path = OPS_LIBRARY) -> Path:
    """Loads the op library once per process (idempotent); returns its path."""
    global _loaded
    with _lock:
        if _loaded is not None:
            return _loaded
        if not path.exists():
            raise UserError(f"kvexport op library not built: {path} is missing (run `make setup`)")
        elf.check_shared_object_file(path)  # one with its own C++ runtime would crash us at its first error
        torch.ops.load_library(str(path))
        lacking = [name for name in OPS if not hasattr(getattr(torch.ops, NAMESPACE), name)]
        if lacking:  # before any fake is registered for it
            raise UserError(
                f"{path} is an op library of another kvexport version (it lacks "
                f"{NAMESPACE}::{lacking[0]}): rebuild the artifact (or the op library: "
                "python -m kvexport.native) with this kvexport"
            )
        for name, implementation in _fakes.items():
            torch.library.register_fake(f"{NAMESPACE}::{name}")(implementation)
        for name in STATEFUL_OPS + STEP_OPS:
            torch.library._register_effectful_op(f"{NAMESPACE}::{name}", EffectType.ORDERED)
        _loaded = path
        return path


def has_kernels_for(device_type: str) -> bool:
    """Whether the loaded op library has kernels for this device type ("cpu", "cuda")."""
    load()
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"{NAMESPACE}::paged_attention", device_type.upper())


def stateful_op_names() -> list[str]:
    """Qualified names of the ops a cached-model graph must contain."""
    return [f"{NAMESPACE}::{name}" for name in STATEFUL_OPS]
