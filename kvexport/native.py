"""Builds kvexport's C++ code (op library, replay harness) with CMake against the installed torch.

Sources live in `csrc/` beside the package (a source checkout, installed with `pip install -e`);
outputs go to `build/` there, and the op library is installed into `kvexport/_lib/`.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import time
from pathlib import Path

import nlohmann_json
import torch

from kvexport.errors import UserError

log = logging.getLogger(__name__)

PACKAGE_DIR = Path(__file__).resolve().parent
SOURCE_DIR = PACKAGE_DIR.parent / "csrc"
BUILD_DIR = PACKAGE_DIR.parent / "build" / "csrc"
OPS_LIBRARY_NAME = "libkvexport_ops.so"
OPS_LIBRARY = PACKAGE_DIR / "_lib" / OPS_LIBRARY_NAME
REPLAY_BINARY = BUILD_DIR / "replay" / "kvexport_replay"


class NativeBuildError(UserError):
    """CMake or the compiler failed; the message names the step and the log."""


def _run(step: str, command: list[str], log_path: Path) -> None:
    with log_path.open("w") as out:
        result = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT)
    if result.returncode != 0:
        tail = log_path.read_text().strip().splitlines()[-15:]
        log.error("%s", "\n".join(tail))
        raise NativeBuildError(f"{step} failed (exit {result.returncode}); full log: {log_path}")


def build_native(targets: tuple[str, ...] = ("kvexport_ops", "kvexport_replay")) -> None:
    """Configures (once) and builds the given CMake targets; installs the op library."""
    if not SOURCE_DIR.is_dir():
        raise NativeBuildError(f"C++ sources not found at {SOURCE_DIR}; install kvexport from a source checkout")
    if shutil.which("cmake") is None:
        raise NativeBuildError("cmake is not installed")
    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    if not (BUILD_DIR / "CMakeCache.txt").exists():
        _run("cmake configure", [
            "cmake", "-S", str(SOURCE_DIR), "-B", str(BUILD_DIR), *generator,
            "-DCMAKE_BUILD_TYPE=Release",
            f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}",
            f"-DNLOHMANN_JSON_INCLUDE_DIR={Path(nlohmann_json.__file__).parent / 'include'}",
        ], BUILD_DIR / "configure.log")
    _run("C++ build", ["cmake", "--build", str(BUILD_DIR), "--target", *targets], BUILD_DIR / "build.log")
    if "kvexport_ops" in targets:
        OPS_LIBRARY.parent.mkdir(exist_ok=True)
        shutil.copy2(BUILD_DIR / OPS_LIBRARY_NAME, OPS_LIBRARY)
    log.debug("built %s in %.1f s", ", ".join(targets), time.perf_counter() - started)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    started = time.perf_counter()
    build_native()
    log.info("native code (op library, replay harness) up to date in %.1f s", time.perf_counter() - started)
