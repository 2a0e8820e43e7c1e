"""Loading a built package into this process: every check that must pass before its machine code
runs, the op library it ships, its programs, and the cache runtime they run through. Scoring what is
loaded is kvexport.host.package's."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import torch

from kvexport.artifact import LIB_DIR, Artifact, check_manifest_against_package, sha256_of
from kvexport.artifact import check_files as check_artifact_files
from kvexport.errors import UserError
from kvexport.host.package_file import check_shared_objects
from kvexport.host.program import Program, load_program
from kvexport.host.step_runner import StepRunner
from kvexport.io import first_line
from kvexport.native.isa import check_device, check_host
from kvexport.native.paths import OPS_LIBRARY_NAME
from kvexport.ops import jagged, library
from kvexport.ops import wrappers as kv
from kvexport.remote import check_write_policy


@dataclasses.dataclass
class Loaded:
    """A package loaded and its runtime created: what scoring needs."""

    artifact: Artifact
    device: torch.device
    program: Program  # model.pt2: the whole request
    step: StepRunner | None  # step.pt2 behind the host's planning, when used
    remote: str | None  # the remote tier's URL (credentials as ***) while attached


def load_package(
    artifact: Artifact,
    device: torch.device | str | None,
    *,
    check_files: bool,
    remote: str | None,
    remote_write: str,
    step_program: bool,
    cuda_graphs: bool,
) -> Loaded:
    """Checks, then loads: the host's and the device's instruction sets before any machine code
    (and, with check_files, every file against the manifest), the shipped op library, model.pt2,
    the cache runtime from the package's own runtime config, the step program, the remote tier.
    Any refusal is a UserError naming what is wrong; loading empties the runtime of any other copy
    of the same package in this process."""
    resolved = resolve_device(artifact, device)
    check_write_policy(remote_write)
    if check_files:
        check_artifact_files(artifact)
    check_host(artifact.manifest.isa)  # before any of its machine code is loaded
    check_device(artifact.manifest.isa, resolved)
    load_shipped_library(artifact)
    if jagged.FBGEMM_LIBRARY in artifact.required_libraries and not jagged.HAVE_FBGEMM:
        raise UserError(f"{artifact.package} needs {jagged.FBGEMM_LIBRARY} but fbgemm_gpu is not importable")
    kv.drop_runtime(artifact.runtime_name)
    check_shared_objects(artifact.package)  # a truncated one would kill this process in the loader
    # torch's loader directly, as a C++ host loads the package: aoti_load_package would first find
    # this host's instruction set by compiling and running probe programs (seconds with an empty
    # inductor cache) only to warn on a mismatch, which check_host above refuses.
    program = _load(artifact.package, lambda: load_program(artifact.package, device_index(resolved)))
    metadata = program.get_metadata()
    if check_files:
        check_manifest_against_package(artifact, metadata)
    # The runtime config travels inside the package, as every host reads it.
    kv.create_runtime(artifact.runtime_name, metadata["kvexport.runtime_config"], resolved)
    step = None
    if step_program and artifact.step_package is not None:
        step = _load(
            artifact.step_package, lambda: StepRunner(artifact.step_package, resolved, cuda_graphs=cuda_graphs)
        )
        if step.runtime_name != artifact.runtime_name:
            raise UserError(
                f"{artifact.step_package} is not this artifact's step program (its runtime is "
                f"{step.runtime_name}, the package's {artifact.runtime_name})"
            )
    attached = attach_remote(artifact.runtime_name, remote, remote_write) if remote is not None else None
    return Loaded(artifact, resolved, program, step, attached)


def package_device(artifact: Artifact) -> torch.device:
    """The device the package was built for: the manifest's, else the config's serving.device."""
    return torch.device(artifact.device)


def resolve_device(artifact: Artifact, device: torch.device | str | None) -> torch.device:
    """Where the package runs: its own device, or a GPU of that type the caller names."""
    own = package_device(artifact)
    if device is None:
        return own
    try:
        wanted = torch.device(device)
    except (RuntimeError, TypeError):
        raise UserError(f"device {device!r} is not a torch device") from None
    if wanted.type != own.type:
        raise UserError(f"{artifact.root} is a {own} package; it cannot run on device {wanted}")
    return own if wanted.index is None or own.type == "cpu" else wanted


def device_index(device: torch.device) -> int:
    """The loader's device index: the GPU's, or -1 (the current one; the CPU)."""
    return device.index if device.index is not None else -1


def load_shipped_library(artifact: Artifact) -> None:
    """Python runs the package with the op library loaded in this process: the artifact's own
    (lib/) when the process has none yet, else one identical to it, or what runs would not be what
    is deployed (an artifact built for a portable baseline ships a library of its own)."""
    shipped = artifact.root / LIB_DIR / OPS_LIBRARY_NAME
    if not shipped.is_file():
        raise UserError(f"artifact {artifact.root} is incomplete: {LIB_DIR}/{OPS_LIBRARY_NAME} is missing")
    loaded = library.load(shipped)
    if sha256_of(shipped) != _loaded_library_digest(loaded):
        raise UserError(
            f"{shipped} differs from the op library loaded here ({loaded}); rebuild the artifact "
            "with this kvexport, or check it with `kvexport replay`, which uses the shipped one"
        )


@functools.lru_cache(maxsize=1)
def _loaded_library_digest(loaded: Path) -> str:
    return sha256_of(loaded)  # the loaded .so cannot change within a process


def attach_remote(runtime: str, url: str, write_policy: str) -> str | None:
    """Attaches the remote tier to the runtime; its URL (credentials as ***), or None when the
    server did not answer (the runtime runs without it; kv.attach_remote logs that once). A bad URL,
    a server that refuses the connection (a wrong or missing password), or an op library built
    without the remote tier: UserError, and the runtime is dropped."""
    try:
        attached = kv.attach_remote(runtime, url, write_policy)
    except ValueError as exc:
        kv.drop_runtime(runtime)
        raise UserError(first_line(exc)) from None
    return kv.redact_url(url) if attached else None


def _load(path: Path, load):
    """What `load` returns; any failure of torch's loader means an unusable package: UserError."""
    try:
        return load()
    except Exception as exc:  # noqa: BLE001 — any load failure means an unusable package
        raise UserError(f"cannot load {path}: {first_line(exc)}") from exc
