"""Builds kvexport's C++ code (op library, replay harness) with CMake against the installed torch.

Sources live in `csrc/` beside the package (a source checkout, installed with `pip install -e`);
outputs go to `build/` there, and the op library is installed into `kvexport/_lib/`.

The compiler is kvexport.native.toolchain's choice (CXX if it builds libraries that share torch's C++
runtime, else a g++ on PATH that does); a build directory configured with another one is configured
again. Each new op library is self-tested in a fresh interpreter (kvexport.native.selftest) before it is
installed.

The attention kernel is compiled for this host's CPU (`-march=native`) unless a portable baseline
is asked for: `python -m kvexport.native --isa x86-64-v3` builds the op library into its own
directory, `build/csrc-x86-64-v3/` (never installed over the native one), with the kernel's hot
loops also compiled for x86-64-v4 and picked at load time (GCC function multiversioning;
`--no-multiversion` leaves the baseline alone). kvexport/native/isa.py reads what a build was made for.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import shutil
import subprocess
import time
from pathlib import Path

import torch

from kvexport.errors import UserError
from kvexport.native import elf, selftest, toolchain
from kvexport.native.paths import BUILD_DIR, NATIVE_ISA, OPS_LIBRARY, OPS_LIBRARY_NAME, PORTABLE_ISAS, SOURCE_DIR
from kvexport.native.selftest import run_self_test

log = logging.getLogger(__name__)


class NativeBuildError(UserError):
    """CMake or the compiler failed; the message names the step and the log."""


def _run(step: str, command: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
    with log_path.open("w") as out:
        result = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    if result.returncode != 0:
        tail = log_path.read_text().strip().splitlines()[-15:]
        log.error("%s", "\n".join(tail))
        raise NativeBuildError(f"{step} failed (exit {result.returncode}); full log: {log_path}")


def build_dir_for(isa: str = NATIVE_ISA, multiversion: bool = True) -> Path:
    """Where the build for this kernel ISA lives: build/csrc for native, build/csrc-ISA[-nomv] otherwise."""
    if isa == NATIVE_ISA:
        return BUILD_DIR
    if isa not in PORTABLE_ISAS:
        raise NativeBuildError(f"--isa {isa}: expected {NATIVE_ISA} or one of {', '.join(PORTABLE_ISAS)}")
    return BUILD_DIR.parent / f"csrc-{isa}{'' if multiversion else '-nomv'}"


def ops_library_for(isa: str = NATIVE_ISA, multiversion: bool = True) -> Path:
    """The op library a build for this kernel ISA produces (the installed one for native)."""
    return OPS_LIBRARY if isa == NATIVE_ISA else build_dir_for(isa, multiversion) / OPS_LIBRARY_NAME


def _hiredis_installed_since(build_dir: Path) -> bool:
    """Whether the build directory was configured without hiredis (the remote tier's client) that
    pkg-config finds now: it is then configured again, so the op library gets the remote tier."""
    cache = (build_dir / "CMakeCache.txt").read_text()
    if "HIREDIS_FOUND:INTERNAL=1" in cache or shutil.which("pkg-config") is None:
        return False
    return subprocess.run(["pkg-config", "--exists", "hiredis"]).returncode == 0


def _cache_value(build_dir: Path, name: str) -> str | None:
    """A CMake cache entry of a configured build directory (None when unconfigured or absent)."""
    cache = build_dir / "CMakeCache.txt"
    if not cache.exists():
        return None
    for line in cache.read_text().splitlines():
        if line.startswith(f"{name}:"):
            return line.split("=", 1)[1]
    return None


def cutlass_include_dir() -> Path | None:
    """CUTLASS/CuTe's headers from the installed nvidia-cutlass distribution (its `cutlass_library`
    package carries the whole include tree), or None where it is not installed. Only the CUDA op
    library's Hopper attention path needs them."""
    spec = importlib.util.find_spec("cutlass_library")
    if spec is None or not spec.submodule_search_locations:
        return None
    include = Path(next(iter(spec.submodule_search_locations))) / "source" / "include"
    return include if (include / "cute" / "tensor.hpp").is_file() else None


def _configure_environment(compiler: toolchain.Compiler) -> dict[str, str]:
    """CMake's environment: nvcc's host compiler (CMake takes it from CUDAHOSTCXX, which a GPU host
    may point at another compiler) is the chosen one too, so one toolchain builds the whole library."""
    return {**os.environ, "CUDAHOSTCXX": compiler.path}


def _forget_configuration(build_dir: Path) -> None:
    """Drops CMake's cache, so the next configure starts afresh (CMake keeps a compiler once chosen)."""
    (build_dir / "CMakeCache.txt").unlink(missing_ok=True)
    shutil.rmtree(build_dir / "CMakeFiles", ignore_errors=True)


def build_native(
    targets: tuple[str, ...] = ("kvexport_ops", "kvexport_replay"), isa: str = NATIVE_ISA, multiversion: bool = True
) -> Path:
    """Configures (once per build directory) and builds the given CMake targets.

    isa: the attention kernel's -march (native, or a portable baseline built in its own directory).
    Installs the native op library into kvexport/_lib; returns the op library's path for this isa.
    """
    if not SOURCE_DIR.is_dir():
        raise NativeBuildError(f"C++ sources not found at {SOURCE_DIR}; install kvexport from a source checkout")
    if shutil.which("cmake") is None:
        raise NativeBuildError("cmake is not installed")
    import nlohmann_json  # a build-time header package: loading an op library must not need it

    compiler = toolchain.select_compiler()
    build_dir = build_dir_for(isa, multiversion)
    build_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    runtime_dir = toolchain.runtime_directory(compiler) or ""
    configured = _cache_value(build_dir, "CMAKE_CXX_COMPILER")
    if configured is not None and (
        os.path.realpath(configured) != os.path.realpath(compiler.path)
        or _cache_value(build_dir, "KVEXPORT_CXX_RUNTIME_DIR") != runtime_dir
    ):
        log.info(
            "%s was configured for another compiler or C++ runtime: configuring it again with %s (runtime from %s)",
            build_dir,
            compiler.path,
            runtime_dir or "its default directories",
        )
        _forget_configuration(build_dir)
    cutlass = str(cutlass_include_dir() or "")
    configured_cutlass = _cache_value(build_dir, "KVEXPORT_CUTLASS_INCLUDE_DIR")
    if configured_cutlass is not None and configured_cutlass != cutlass:
        log.info("CUTLASS's headers changed since %s was configured: configuring it again", build_dir)
        _forget_configuration(build_dir)
    if not (build_dir / "CMakeCache.txt").exists() or _hiredis_installed_since(build_dir):
        _run(
            "cmake configure",
            [
                "cmake",
                "-S",
                str(SOURCE_DIR),
                "-B",
                str(build_dir),
                *generator,
                "-DCMAKE_BUILD_TYPE=Release",
                f"-DCMAKE_CXX_COMPILER={compiler.path}",
                f"-DKVEXPORT_CXX_RUNTIME_DIR={runtime_dir}",
                f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}",
                f"-DNLOHMANN_JSON_INCLUDE_DIR={Path(nlohmann_json.__file__).parent / 'include'}",
                f"-DKVEXPORT_KERNEL_ARCH={isa}",
                f"-DKVEXPORT_KERNEL_MULTIVERSION={'ON' if multiversion else 'OFF'}",
                f"-DKVEXPORT_CUTLASS_INCLUDE_DIR={cutlass}",
            ],
            build_dir / "configure.log",
            env=_configure_environment(compiler),
        )
    _run("C++ build", ["cmake", "--build", str(build_dir), "--target", *targets], build_dir / "build.log")
    if "kvexport_replay" in targets:
        _check_runtime(build_dir / "replay" / "kvexport_replay", compiler, build_dir)
    if "kvexport_ops" in targets:
        built = build_dir / OPS_LIBRARY_NAME
        _check_runtime(built, compiler, build_dir)
        _self_test_once(built, compiler)
        if isa == NATIVE_ISA:
            OPS_LIBRARY.parent.mkdir(exist_ok=True)
            shutil.copy2(built, OPS_LIBRARY)
    log.debug("built %s (kernel ISA %s) in %.1f s", ", ".join(targets), isa, time.perf_counter() - started)
    return ops_library_for(isa, multiversion)


def _check_runtime(path: Path, compiler: toolchain.Compiler, build_dir: Path) -> None:
    """What CMake linked must use the shared C++ runtime, as the chosen compiler's probe did; if not,
    something else on the link line brought a static libstdc++ (docs/design.md §3.8)."""
    try:
        elf.check_shared_object_file(path)
    except UserError:
        raise NativeBuildError(
            f"{path} carries its own copy of the C++ runtime although {compiler.path} links the "
            f"shared one: a directory with a static libstdc++ reached its link line (see "
            f"{build_dir / 'build.log'}): a kvexport defect, please report it with that log"
        ) from None


def _self_test_once(library: Path, compiler: toolchain.Compiler) -> None:
    """kvexport.native.selftest's op-library check, once per built file (a stamp beside it records which)."""
    stamp = library.with_name(library.name + ".selftest")
    built = f"{library.stat().st_mtime_ns} {library.stat().st_size}"
    if stamp.exists() and stamp.read_text() == built:
        return
    run_self_test(selftest.__name__, library, compiler.path)
    stamp.write_text(built)


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m kvexport.native", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--isa",
        default=NATIVE_ISA,
        choices=(NATIVE_ISA, *PORTABLE_ISAS),
        help="-march of the attention kernel; a portable build goes to build/csrc-ISA/ and builds the op library only",
    )
    parser.add_argument(
        "--no-multiversion",
        dest="multiversion",
        action="store_false",
        help="portable builds: no x86-64-v4 clones of the kernel's hot loops",
    )
    return parser.parse_args()


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = _parse_args()
    started = time.perf_counter()
    try:
        if args.isa == NATIVE_ISA:
            build_native()
            log.info("native code (op library, replay harness) up to date in %.1f s", time.perf_counter() - started)
        else:
            library = build_native(("kvexport_ops",), isa=args.isa, multiversion=args.multiversion)
            log.info("op library for %s up to date in %.1f s: %s", args.isa, time.perf_counter() - started, library)
    except UserError as exc:
        log.error("error: %s", exc)
        raise SystemExit(exc.exit_code) from None
