"""The C++ toolchain: a compiler that links libstdc++ statically into shared objects (as the GPU
host's default CXX does) is never used, and what such a compiler built is refused before loading.

The stand-in compiler is the one the GPU host's defect was reproduced with: /usr/bin/g++ with
-static-libstdc++ added to every link of a shared object.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvexport.artifact import open_artifact
from kvexport.errors import UserError
from kvexport.native import elf, toolchain
from kvexport.native.paths import OPS_LIBRARY, SOURCE_DIR
from kvexport.trace.replay import harness, library_flags
from tests.helpers.artifacts import rehash, replace_shared_objects

REAL_GXX = shutil.which("g++")
STATIC_WRAPPER = f"""#!/bin/sh
for a in "$@"; do [ "$a" = -shared ] && exec {REAL_GXX} -static-libstdc++ "$@"; done
exec {REAL_GXX} "$@"
"""
THROWS = 'extern "C" int kvexport_throws(int x) { if (x) throw x; return 0; }\n'


@pytest.fixture(scope="module")
def static_cxx(tmp_path_factory) -> Path:
    """A directory holding `g++`, a compiler that links the C++ runtime statically into shared objects."""
    directory = tmp_path_factory.mktemp("static-cxx")
    (directory / "g++").write_text(STATIC_WRAPPER)
    (directory / "g++").chmod(0o755)
    return directory


@pytest.fixture(scope="module")
def tools_without_gxx(tmp_path_factory) -> Path:
    """A directory with the build tools a native build and Inductor need, and no C++ compiler."""
    directory = tmp_path_factory.mktemp("tools")
    for tool in ("as", "ld", "cmake", "ninja"):
        if shutil.which(tool):
            (directory / tool).symlink_to(shutil.which(tool))
    return directory


def compile_library(compiler: str, path: Path, *flags: str) -> Path:
    source = path.with_suffix(".cpp")
    source.write_text(THROWS)
    subprocess.run([compiler, "-shared", "-fPIC", *flags, str(source), "-o", str(path)], check=True)
    return path


def test_the_probe_tells_a_static_runtime_compiler_from_a_shared_one(static_cxx):
    assert toolchain.probe(REAL_GXX) is None
    assert toolchain.probe(str(static_cxx / "g++")) == (
        "links the C++ runtime statically into shared libraries (they carry their own copy instead of loading "
        "libstdc++.so.6)"
    )
    assert toolchain.probe(str(static_cxx / "missing")).startswith("cannot be run")


@pytest.mark.parametrize(
    ("flags", "own"),
    [
        ((), False),
        (("-static-libstdc++",), True),
        (("-static-libstdc++", "-s"), True),
        (("-static-libstdc++", "-Wl,--exclude-libs,ALL", "-s"), True),  # nothing named, nothing referenced
        (("-Wl,--as-needed", "-nodefaultlibs", "-lgcc_s", "-lc"), False),  # runtime left to the loader
    ],
)
def test_an_object_with_its_own_cxx_runtime_is_recognised(tmp_path, flags, own):
    library = compile_library(REAL_GXX, tmp_path / "lib.so", *flags)
    with library.open("rb") as data:
        assert elf.carries_own_cxx_runtime(data, str(library)) is own


def test_cxx_is_tried_first_then_every_gxx_on_path(static_cxx, caplog):
    environ = {"CXX": str(static_cxx / "g++"), "PATH": f"{static_cxx}{os.pathsep}{Path(REAL_GXX).parent}"}
    # c++ is g++ under another name here: tried once
    assert toolchain.candidates(environ) == [(str(static_cxx / "g++"), "CXX"), (REAL_GXX, "PATH")]
    with caplog.at_level(logging.WARNING, logger="kvexport.native.toolchain"):
        chosen = toolchain.select_compiler(environ)
    assert chosen == toolchain.Compiler(str(Path(REAL_GXX).parent / "g++"), "PATH")
    assert [r.getMessage() for r in caplog.records] == [
        f"not using CXX={static_cxx / 'g++'}: it links the C++ runtime statically into shared libraries (they carry "
        f"their own copy instead of loading libstdc++.so.6); using {chosen.path} (found on PATH) instead"
    ]


def _refusal(static_cxx) -> str:
    return (
        f"error: no usable C++ compiler: CXX={static_cxx / 'g++'} links the C++ runtime statically into shared "
        "libraries (they carry their own copy instead of loading libstdc++.so.6). A C++ exception in the op "
        "library or a package would crash the host: install a g++ that links libstdc++.so.6 dynamically (a "
        "distribution's g++ does) and set CXX to it"
    )


def test_a_native_build_with_no_usable_compiler_is_refused_in_one_line(static_cxx, tools_without_gxx):
    before = OPS_LIBRARY.stat().st_mtime_ns
    env = {**os.environ, "CXX": str(static_cxx / "g++"), "PATH": f"{static_cxx}{os.pathsep}{tools_without_gxx}"}
    result = subprocess.run(
        [sys.executable, "-m", "kvexport.native"], env=env, capture_output=True, text=True, timeout=300
    )
    assert (result.returncode, result.stderr.strip().splitlines()) == (2, [_refusal(static_cxx)])
    assert OPS_LIBRARY.stat().st_mtime_ns == before


@pytest.mark.slow
def test_kvexport_build_refuses_before_any_work_or_corrects_the_compiler(static_cxx, tools_without_gxx, tmp_path):
    """With only the static-runtime compiler: one line, exit 2, no output. With a g++ on PATH too:
    the build warns, compiles the package with that g++, and the package verifies (its self-test
    already sent it a refused request in a fresh process)."""
    kvexport = [sys.executable, "-m", "kvexport"]
    config = str(SOURCE_DIR.parent / "configs" / "hstu-tiny.yaml")
    refused = subprocess.run(
        [*kvexport, "build", config, "-o", str(tmp_path / "refused")],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "CXX": str(static_cxx / "g++"), "PATH": f"{static_cxx}{os.pathsep}{tools_without_gxx}"},
    )
    assert (refused.returncode, refused.stderr.strip().splitlines()) == (2, [_refusal(static_cxx)])
    assert not (tmp_path / "refused").exists()

    corrected = subprocess.run(
        [*kvexport, "build", config, "-o", str(tmp_path / "corrected")],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "CXX": str(static_cxx / "g++")},
    )
    assert corrected.returncode == 0, corrected.stderr
    assert f"not using CXX={static_cxx / 'g++'}: it links the C++ runtime statically" in corrected.stderr
    assert "self-test" in corrected.stderr
    verified = subprocess.run(
        [*kvexport, "verify", str(tmp_path / "corrected")],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "CXX": str(static_cxx / "g++")},
    )
    assert verified.returncode == 0, verified.stdout + verified.stderr


@pytest.mark.slow
@pytest.mark.parametrize("flags", [(), ("-Wl,--exclude-libs,ALL", "-s")], ids=["exported", "hidden"])
def test_a_package_member_with_its_own_runtime_is_refused_by_python_and_the_harness(
    tiny_artifact, tmp_path, static_cxx, flags
):
    member = compile_library(str(static_cxx / "g++"), tmp_path / "own-runtime.so", *flags).read_bytes()
    artifact = shutil.copytree(tiny_artifact, tmp_path / "hstu-tiny")
    replace_shared_objects(artifact / "model.pt2", member)
    rehash(artifact, "model.pt2")
    import kvexport

    with pytest.raises(UserError) as python:
        kvexport.load(artifact)
    assert "carries its own copy of the C++ runtime (it does not use the host's libstdc++.so.6)" in str(python.value)
    flags = library_flags(open_artifact(artifact).required_libraries)
    replayed = subprocess.run(
        [str(harness()), "--artifact", str(artifact), *flags], capture_output=True, text=True, timeout=300
    )
    assert (replayed.returncode, replayed.stderr.strip()) == (2, f"error: {python.value}")


def test_an_op_library_with_its_own_runtime_is_not_loaded(tmp_path, static_cxx):
    library = compile_library(str(static_cxx / "g++"), tmp_path / "libkvexport_ops.so")
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from pathlib import Path; from kvexport.ops import library; library.load(Path(sys.argv[1]))",
            str(library),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1
    assert (
        f"UserError: {library} carries its own copy of the C++ runtime (it does not use the host's libstdc++.so.6)"
    ) in result.stderr


@pytest.mark.slow
def test_the_self_test_catches_the_op_library_a_static_runtime_compiler_builds(static_cxx, tmp_path):
    """The defect itself, reproduced: CMake builds the op library with the static-runtime compiler
    (a compiler kvexport's own choice passes over); its refusal comes back cut at the first formatted integer or
    kills the process, and the self-test says so in one line."""
    import nlohmann_json

    from kvexport.native.selftest import SelfTestError, run_self_test

    build = tmp_path / "build"
    subprocess.run(
        [
            "cmake",
            "-S",
            str(SOURCE_DIR),
            "-B",
            str(build),
            "-G",
            "Ninja",
            "-DCMAKE_BUILD_TYPE=Release",
            f"-DCMAKE_CXX_COMPILER={static_cxx / 'g++'}",
            f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}",
            f"-DNLOHMANN_JSON_INCLUDE_DIR={Path(nlohmann_json.__file__).parent / 'include'}",
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    subprocess.run(
        ["cmake", "--build", str(build), "--target", "kvexport_ops"], check=True, capture_output=True, timeout=900
    )
    library = build / "libkvexport_ops.so"
    with library.open("rb") as data:
        assert elf.carries_own_cxx_runtime(data, str(library))
    with pytest.raises(SelfTestError) as failed:
        run_self_test("kvexport.native.selftest", library, str(static_cxx / "g++"))
    message = str(failed.value)
    assert message.startswith(f"self-test of {library}: ")
    assert (
        "the op library's refusal came back garbled: 'paged_attention: cache [" in message
        or f"killed a fresh process (SIGSEGV); it was compiled by {static_cxx / 'g++'}" in message
    )
    run_self_test("kvexport.native.selftest", OPS_LIBRARY, REAL_GXX)  # the installed one passes


def test_a_build_that_links_a_second_runtime_despite_the_probe_is_a_native_build_error(tmp_path, static_cxx):
    """What the GPU host's CUDAHOSTCXX once did to the link line: caught after the build, not at load."""
    from kvexport.native.build import NativeBuildError, _check_runtime

    library = compile_library(str(static_cxx / "g++"), tmp_path / "libkvexport_ops.so")
    compiler = toolchain.Compiler(REAL_GXX, "PATH")
    with pytest.raises(
        NativeBuildError,
        match=f"^{re.escape(str(library))} carries its own copy of the C\\+\\+ runtime "
        f"although {re.escape(REAL_GXX)} links the shared one: .*build.log\\): "
        "a kvexport defect",
    ):
        _check_runtime(library, compiler, tmp_path)
    _check_runtime(compile_library(REAL_GXX, tmp_path / "shared.so"), compiler, tmp_path)
