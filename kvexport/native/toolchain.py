"""The C++ compiler kvexport builds with: its op library, its replay harness and, through Inductor,
every package's own shared object.

Whatever it builds is loaded into a process where torch has already loaded the shared C++ runtime
(libstdc++.so.6). A compiler that links its own copy of that runtime into shared objects produces
libraries whose first C++ exception — every refused request is one — meets a second runtime: the
message comes back garbled, or the host dies of SIGSEGV (docs/design.md, *The C++ runtime*). So the
compiler is chosen by a test, never assumed: a small shared library is compiled, must name
libstdc++.so.6 as NEEDED, and must throw, catch and format an exception correctly when loaded
beside torch. CXX (the variable CMake and Inductor read) is tried first, then every g++ and c++ on
PATH; the first that passes is used for all three builds, and a CXX that failed is named in a
warning. None passing is a ToolchainError naming each compiler tried and why.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch  # noqa: F401  (loads the C++ runtime the probe library must share)

from kvexport.errors import UserError
from kvexport.native import elf

log = logging.getLogger(__name__)

# Formats integers through an ostream (what a truncated message lost first) and throws and catches
# inside the library: 0 when the message survives whole.
_PROBE_SOURCE = r"""
#include <sstream>
#include <stdexcept>
#include <string>
extern "C" int kvexport_toolchain_probe() {
  try {
    std::ostringstream message;
    message << "refused: " << 12345 << " of " << 678;
    throw std::runtime_error(message.str());
  } catch (const std::exception& error) {
    return std::string(error.what()) == "refused: 12345 of 678" ? 0 : 1;
  }
}
"""
_COMPILE_TIMEOUT_S = 120


class ToolchainError(UserError):
    """No C++ compiler here builds libraries that are safe to load beside torch."""


@dataclass(frozen=True)
class Compiler:
    """A C++ compiler that passed the probe: its absolute path and where it was found."""

    path: str
    source: str  # "CXX" or "PATH"


def candidates(environ: Mapping[str, str]) -> list[tuple[str, str]]:
    """(absolute path, source) of every compiler to try, in order: CXX, then g++ and c++ on PATH.

    The same file reached by two names is tried once.
    """
    found: list[tuple[str, str]] = []
    seen: set[str] = set()

    def add(path: str | None, source: str) -> None:
        if path and os.path.realpath(path) not in seen:
            seen.add(os.path.realpath(path))
            found.append((os.path.abspath(path) if os.path.exists(path) else path, source))

    path_list = environ.get("PATH", "")
    if environ.get("CXX"):  # one that is not found is tried as given, and fails by name
        add(shutil.which(environ["CXX"], path=path_list) or environ["CXX"], "CXX")
    for directory in path_list.split(os.pathsep):
        for name in ("g++", "c++"):
            add(shutil.which(name, path=directory) if directory else None, "PATH")
    return found


def probe(compiler: str) -> str | None:
    """None when `compiler` builds shared libraries that share torch's C++ runtime; else why not."""
    with tempfile.TemporaryDirectory(prefix="kvexport-cxx-probe-") as work:
        source, library = Path(work) / "probe.cpp", Path(work) / "libprobe.so"
        source.write_text(_PROBE_SOURCE)
        try:
            result = subprocess.run(
                [compiler, "-shared", "-fPIC", "-O1", str(source), "-o", str(library)],
                capture_output=True,
                text=True,
                timeout=_COMPILE_TIMEOUT_S,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"cannot be run ({type(exc).__name__})"
        if result.returncode != 0 or not library.is_file():
            said = result.stderr.strip().splitlines()
            return f"cannot compile a shared library (exit {result.returncode}{': ' + said[-1] if said else ''})"
        with library.open("rb") as data:
            elf.check_elf(data, library.stat().st_size, str(library))
            if elf.carries_own_cxx_runtime(data, str(library)):
                return (
                    "links the C++ runtime statically into shared libraries (they carry their own copy "
                    f"instead of loading {elf.CXX_RUNTIME})"
                )
        try:
            loaded = ctypes.CDLL(str(library))
        except OSError as exc:
            return f"builds shared libraries that do not load beside torch's C++ runtime ({exc})"
        if loaded.kvexport_toolchain_probe() != 0:
            return "builds shared libraries whose C++ exceptions come back garbled beside torch's C++ runtime"
    return None


@functools.cache
def _select(tried: tuple[tuple[str, str], ...]) -> Compiler:
    reasons = []
    for path, source in tried:
        reason = probe(path)
        if reason is None:
            if reasons:
                log.warning(
                    "not using %s: it %s; using %s (%s) instead",
                    reasons[0][0],
                    reasons[0][1],
                    path,
                    "CXX" if source == "CXX" else "found on PATH",
                )
            return Compiler(path, source)
        reasons.append((f"{'CXX=' if source == 'CXX' else ''}{path}", reason))
    if not reasons:
        raise ToolchainError("no C++ compiler found: set CXX or put g++ on PATH")
    tried_text = "; ".join(f"{name} {reason}" for name, reason in reasons)
    raise ToolchainError(
        f"no usable C++ compiler: {tried_text}. A C++ exception in the op library or a package "
        f"would crash the host: install a g++ that links {elf.CXX_RUNTIME} dynamically (a "
        "distribution's g++ does) and set CXX to it"
    )


def select_compiler(environ: Mapping[str, str] | None = None) -> Compiler:
    """The first compiler (CXX, then g++ and c++ on PATH) whose shared libraries share torch's C++
    runtime; probed once per process for each set of candidates. ToolchainError when none does."""
    return _select(tuple(candidates(os.environ if environ is None else environ)))


def runtime_directory(compiler: Compiler) -> str | None:
    """The directory holding the shared C++ runtime (libstdc++.so) this compiler links, if it says.

    Linked first, so that a directory another toolchain adds to the link (nvcc's host compiler's,
    which may hold a static libstdc++ only) cannot put a second runtime into what CMake builds.
    """
    try:
        answer = subprocess.run(
            [compiler.path, "-print-file-name=libstdc++.so"], capture_output=True, text=True, timeout=_COMPILE_TIMEOUT_S
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return os.path.dirname(os.path.normpath(answer)) if os.path.isabs(answer) else None


def inductor_configs(compiler: Compiler) -> dict[str, object]:
    """Inductor settings that make it compile a package with `compiler` (it reads CXX otherwise)."""
    return {"cpp.cxx": (None, compiler.path)}
