"""The runtime's parts (csrc/runtime/: page pool, user table, batch plan, remote entries) pass their
own C++ unit tests (csrc/runtime/*_test.cpp, GoogleTest), built by the op library's CMake project
and run through ctest, one ctest test per TEST()."""

from __future__ import annotations

import re
import subprocess

import pytest

from kvexport.native.build import build_native
from kvexport.native.paths import BUILD_DIR, SOURCE_DIR

TIMEOUT_S = 600


def cpp_tests() -> list[str]:
    """Suite.Name of every TEST() in the runtime's test sources."""
    return [
        f"{suite}.{name}"
        for path in sorted((SOURCE_DIR / "runtime").glob("*_test.cpp"))
        for suite, name in re.findall(r"^TEST\((\w+), (\w+)\)", path.read_text(), re.M)
    ]


def gtest_found() -> bool:
    """Whether CMake found GoogleTest when it configured the build directory."""
    found = re.search(r"^GTest_DIR:PATH=(.*)$", (BUILD_DIR / "CMakeCache.txt").read_text(), re.M)
    return bool(found) and not found.group(1).endswith("-NOTFOUND")


@pytest.mark.slow
def test_the_runtime_parts_pass_every_cpp_unit_test():
    build_native(("kvexport_runtime",))  # configures the build directory (CMake looks for GoogleTest)
    if not gtest_found():
        pytest.skip(
            "GoogleTest is not installed (Debian/Ubuntu: apt-get install libgtest-dev; make system-packages "
            "installs it)"
        )
    build_native(("kvexport_runtime_tests",))
    result = subprocess.run(
        ["ctest", "--test-dir", str(BUILD_DIR), "--output-on-failure", "-j", "2"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    ran = re.findall(r"Test +#\d+: (\S+) \.+ +Passed", result.stdout)
    assert ran and sorted(ran) == sorted(cpp_tests()), result.stdout[-4000:]
