"""Host ISA: what the op library and package were compiled for, and the one-line refusal of a host
that lacks a feature (Python and the C++ harness's twin, on synthetic requirements)."""

from __future__ import annotations

import json
import re
import subprocess

import nlohmann_json
import pytest

from kvexport import isa
from kvexport.errors import UserError
from kvexport.native import NATIVE_ISA, OPS_LIBRARY, PORTABLE_ISAS, build_dir_for
from tests.conftest import ROOT

# Every feature isa.py knows, as Linux would show a CPU that has them all.
ALL_FLAGS = frozenset(flag for _, flags in isa.FEATURES.values() for flag in flags)
NATIVE_AVX2_HOST = ALL_FLAGS - {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
REQUIRES_AVX512 = {"op_library": {"march": "native", "cpu_features": ["SSE3", "AVX2", "AVX512F", "AVX512BW"]},
                   "package": {"march": "native", "vec_isa": "AVX512", "cpu_features": ["AVX2", "AVX512VNNI"]}}


def test_check_host_names_the_first_missing_feature_in_one_line():
    with pytest.raises(UserError) as caught:
        isa.check_host(REQUIRES_AVX512, flags=NATIVE_AVX2_HOST)
    assert str(caught.value) == "this host lacks AVX512F required by the op library (compiled with -march=native)"


def test_check_host_checks_the_package_too():
    required = {"op_library": {"march": "x86-64-v3", "cpu_features": ["AVX2", "FMA"]},
                "package": REQUIRES_AVX512["package"]}
    with pytest.raises(UserError, match="^this host lacks AVX512VNNI required by the package "
                                        r"\(compiled with -march=native\)$"):
        isa.check_host(required, flags=ALL_FLAGS - {"avx512_vnni"})


def test_check_host_accepts_a_host_with_every_feature():
    isa.check_host(REQUIRES_AVX512, flags=ALL_FLAGS)
    isa.check_host({}, flags=frozenset())  # nothing recorded: nothing to check


def test_linux_flag_names_differ_from_the_feature_names():
    isa.check_host({"op_library": {"march": "x86-64-v3", "cpu_features": ["SSE3", "LZCNT", "BMI1"]}},
                   flags=frozenset({"pni", "abm", "bmi1"}))


def test_a_feature_unknown_to_this_version_is_looked_up_as_its_flag():
    required = {"op_library": {"march": "future", "cpu_features": ["AMX_TILE"]}}
    isa.check_host(required, flags=frozenset({"amx_tile"}))
    with pytest.raises(UserError, match="lacks AMX_TILE"):
        isa.check_host(required, flags=ALL_FLAGS)


def test_the_installed_op_library_records_what_it_was_built_for():
    recorded = isa.library_isa(OPS_LIBRARY)
    assert recorded["march"] in (NATIVE_ISA, *PORTABLE_ISAS)
    assert recorded["cpu_features"] and set(recorded["cpu_features"]) <= set(isa.FEATURES)
    isa.check_host({"op_library": recorded})  # built here, so this host has what it needs


def test_library_isa_reads_the_marker_without_loading(tmp_path):
    fake = tmp_path / "lib.so"
    fake.write_bytes(b"\x7fELF...\0" + isa.MARKER + b"march=x86-64-v3;features=AVX,AVX2;clones=x86-64-v4\0tail")
    assert isa.library_isa(fake) == {"march": "x86-64-v3", "cpu_features": ["AVX", "AVX2"],
                                     "multiversion": ["x86-64-v4"]}
    fake.write_bytes(b"\x7fELF without a marker")
    with pytest.raises(UserError, match="does not record the CPU it was compiled for"):
        isa.library_isa(fake)


def test_compiler_features_follow_march():
    v3 = isa.compiler_features(["-march=x86-64-v3"])
    assert {"AVX2", "FMA", "BMI2", "LZCNT"} <= set(v3) and "AVX512F" not in v3
    assert {"AVX512F", "AVX512BW", "AVX512DQ", "AVX512VL"} <= set(isa.compiler_features(["-march=x86-64-v4"]))


def test_feature_tables_agree():
    """kvexport/isa.py, the library's record (compiled_isa.h) and the harness (isa.cpp): same names, same order."""
    header = (ROOT / "csrc" / "ops" / "compiled_isa.h").read_text()
    harness = (ROOT / "csrc" / "replay" / "isa.cpp").read_text()
    assert re.findall(r'\{"(\w+)", KVEXPORT_IS_SET\(__\w+__\)\}', header) == list(isa.FEATURES)
    assert re.findall(r'\{"(\w+)", __builtin_cpu_supports\("[\w.]+"\)\}', harness) == list(isa.FEATURES)
    macros = re.findall(r'\{"\w+", KVEXPORT_IS_SET\((__\w+__)\)\}', header)
    assert macros == [macro for macro, _ in isa.FEATURES.values()]


def test_portable_builds_have_their_own_directory():
    assert build_dir_for(NATIVE_ISA).name == "csrc"
    assert build_dir_for("x86-64-v3").name == "csrc-x86-64-v3"
    assert build_dir_for("x86-64-v3", multiversion=False).name == "csrc-x86-64-v3-nomv"
    with pytest.raises(UserError, match="--isa znver4"):
        build_dir_for("znver4")


CPP_DRIVER = """
#include "replay/isa.h"
#include <iostream>
int main(int, char** argv) {
  std::cout << kvexport::replay::missing_cpu_feature(nlohmann::json::parse(argv[1])) << std::endl;
}
"""


@pytest.fixture(scope="module")
def cpp_check(tmp_path_factory):
    """The harness's check, compiled alone: a program that prints missing_cpu_feature(argv[1])."""
    workdir = tmp_path_factory.mktemp("isa-cpp")
    (workdir / "driver.cpp").write_text(CPP_DRIVER)
    binary = workdir / "isa_check"
    include = nlohmann_json.__file__.rsplit("/", 1)[0] + "/include"
    subprocess.run(["g++", "-std=c++20", "-O1", f"-I{ROOT / 'csrc'}", f"-I{include}", str(workdir / "driver.cpp"),
                    str(ROOT / "csrc" / "replay" / "isa.cpp"), "-o", str(binary)], check=True)
    return lambda required: subprocess.run([str(binary), json.dumps(required)], check=True, capture_output=True,
                                           text=True).stdout.strip()


def _python_message(required: dict) -> str:
    try:
        isa.check_host(required)
    except UserError as exc:
        return str(exc)
    return ""


@pytest.mark.slow  # compiles the harness check
def test_cpp_harness_sees_the_features_python_sees(cpp_check):
    for feature in isa.FEATURES:
        required = {"op_library": {"march": "native", "cpu_features": [feature]}}
        assert cpp_check(required) == _python_message(required), feature


@pytest.mark.slow
def test_cpp_harness_refuses_with_the_same_line(cpp_check):
    required = {"op_library": {"march": "x86-64-v3", "cpu_features": ["AVX2"]},
                "package": {"march": "native", "cpu_features": ["AVX2", "NOT_A_FEATURE"]}}
    assert cpp_check(required) == _python_message(required) == (
        "this host lacks NOT_A_FEATURE required by the package (compiled with -march=native)")
    assert cpp_check({}) == ""


@pytest.mark.slow  # pick_vec_isa compiles and runs test programs
def test_artifact_isa_describes_both_parts():
    recorded = isa.artifact_isa()
    assert recorded["op_library"] == isa.library_isa(OPS_LIBRARY)
    package = recorded["package"]
    assert package["march"] == "native" and package["vec_isa"]
    if package["vec_isa"].startswith("AVX512"):
        assert {"AVX512F", "AVX512BW", "AVX512DQ", "AVX512VL"} <= set(package["cpu_features"])
    isa.check_host(recorded)
    json.dumps(recorded)  # goes into manifest.json as is
