"""`kvexport replay`: builds (if needed) and runs the bundled C++ harness on an artifact.

The harness needs no Python at run time; this launcher only finds what it must be told:
the op libraries the package requires (by name in the manifest) and the harness binary.
"""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path

from kvexport.artifact import open_artifact
from kvexport.errors import UserError
from kvexport.host.package_file import LIBRARIES
from kvexport.native.build import build_native
from kvexport.native.paths import REPLAY_BINARY
from kvexport.ops import jagged
from kvexport.options import ReplayOptions
from kvexport.remote import DEFAULT_WRITE_POLICY, check_write_policy


@functools.cache
def harness() -> Path:
    """The harness binary, (re)built incrementally in the cached build directory (once a process)."""
    build_native(("kvexport_replay",))
    return REPLAY_BINARY


def library_flags(required: list[str]) -> list[str]:
    """--library flags for the required libraries the artifact does not carry itself (lib/)."""
    flags = []
    for name in required:
        if name == LIBRARIES["kvexport"]:
            continue  # shipped in the artifact's lib/
        if name == jagged.FBGEMM_LIBRARY:
            path = jagged.fbgemm_library_path()
            if path is None:
                raise UserError(f"the package needs {name}, but fbgemm_gpu is not installed here")
            flags += ["--library", str(path)]
        else:
            raise UserError(f"the package needs op library {name}, which this kvexport does not know")
    return flags


def replay_command(
    out: Path,
    json_path: Path | None = None,
    repeat: int = ReplayOptions.repeat,
    threads: int = ReplayOptions.threads,
    atol: float | None = ReplayOptions.atol,
    rtol: float | None = ReplayOptions.rtol,
    *,
    remote: str | None = None,
    remote_write: str = DEFAULT_WRITE_POLICY,
    remote_password_file: Path | None = None,
    route: str = ReplayOptions.route,
) -> list[str]:
    artifact = open_artifact(out)
    command = [
        str(harness()),
        "--artifact",
        str(artifact.root),
        *library_flags(artifact.required_libraries),
        "--repeat",
        str(repeat),
        "--threads",
        str(threads),
        "--route",
        route,
    ]
    if json_path is not None:
        command += ["--json", str(json_path)]
    if atol is not None:
        command += ["--atol", repr(atol)]
    if rtol is not None:
        command += ["--rtol", repr(rtol)]
    if remote is not None:
        command += ["--remote", remote, "--remote-write", check_write_policy(remote_write)]
        if remote_password_file is not None:  # the harness reads it: a password never goes on its command line
            command += ["--remote-password-file", str(remote_password_file)]
    return command


def run_replay(
    out: Path,
    json_path: Path | None,
    options: ReplayOptions,
    *,
    remote: str | None = None,
    remote_write: str = DEFAULT_WRITE_POLICY,
    remote_password_file: Path | None = None,
) -> int:
    """Runs the harness with inherited stdout/stderr; returns its exit code (0 pass, 1 mismatch, 2 unusable).

    remote, remote_write: the harness shares user caches through that remote tier (--remote URL);
    remote_password_file: a file holding its password, which the harness reads itself. options.route:
    "model" (model.pt2, as plain hosts run it), "step" (step.pt2 after planning on the host) or
    "graphs" (step.pt2 as CUDA graphs; docs/design.md 3.9).
    """
    if options.repeat < 1 or options.threads < 1:
        raise UserError("--repeat and --threads must be >= 1")
    command = replay_command(
        out,
        json_path,
        options.repeat,
        options.threads,
        options.atol,
        options.rtol,
        remote=remote,
        remote_write=remote_write,
        remote_password_file=remote_password_file,
        route=options.route,
    )
    return subprocess.run(command).returncode
