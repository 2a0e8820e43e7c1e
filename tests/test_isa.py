"""Host ISA: what the op library and package were compiled for, and the one-line refusal of a host
that lacks a feature (Python and the C++ harness's twin, on synthetic requirements)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import nlohmann_json
import pytest
import torch

from kvexport.errors import UserError
from kvexport.native import isa
from kvexport.native.build import build_dir_for
from kvexport.native.paths import NATIVE_ISA, OPS_LIBRARY, PORTABLE_ISAS
from tests.helpers import ROOT
from tests.helpers.artifacts import edit_manifest

# Every feature isa.py knows, as Linux would show a CPU that has them all.
ALL_FLAGS = frozenset(flag for _, flags in isa.FEATURES.values() for flag in flags)
NATIVE_AVX2_HOST = ALL_FLAGS - {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
REQUIRES_AVX512 = {
    "op_library": {"march": "native", "cpu_features": ["SSE3", "AVX2", "AVX512F", "AVX512BW"]},
    "package": {"march": "native", "vec_isa": "AVX512", "cpu_features": ["AVX2", "AVX512VNNI"]},
}


def test_check_host_names_the_first_missing_feature_in_one_line():
    with pytest.raises(UserError) as caught:
        isa.check_host(REQUIRES_AVX512, flags=NATIVE_AVX2_HOST)
    assert str(caught.value) == "this host lacks AVX512F required by the op library (compiled with -march=native)"


def test_check_host_checks_the_package_too():
    required = {
        "op_library": {"march": "x86-64-v3", "cpu_features": ["AVX2", "FMA"]},
        "package": REQUIRES_AVX512["package"],
    }
    with pytest.raises(
        UserError,
        match="^this host lacks AVX512VNNI required by the package "
        r"\(compiled with -march=native\)$",
    ):
        isa.check_host(required, flags=ALL_FLAGS - {"avx512_vnni"})


def test_check_host_accepts_a_host_with_every_feature():
    isa.check_host(REQUIRES_AVX512, flags=ALL_FLAGS)
    isa.check_host({}, flags=frozenset())  # nothing recorded: nothing to check


def test_linux_flag_names_differ_from_the_feature_names():
    isa.check_host(
        {"op_library": {"march": "x86-64-v3", "cpu_features": ["SSE3", "LZCNT", "BMI1"]}},
        flags=frozenset({"pni", "abm", "bmi1"}),
    )


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
    assert isa.library_isa(fake) == {
        "march": "x86-64-v3",
        "cpu_features": ["AVX", "AVX2"],
        "multiversion": ["x86-64-v4"],
    }
    fake.write_bytes(b"\x7fELF without a marker")
    with pytest.raises(UserError, match="does not record the CPU it was compiled for"):
        isa.library_isa(fake)


def test_compiler_features_follow_march():
    v3 = isa.compiler_features(["-march=x86-64-v3"])
    assert {"AVX2", "FMA", "BMI2", "LZCNT"} <= set(v3) and "AVX512F" not in v3
    assert {"AVX512F", "AVX512BW", "AVX512DQ", "AVX512VL"} <= set(isa.compiler_features(["-march=x86-64-v4"]))


def test_feature_tables_agree():
    """kvexport/native/isa.py, the library's record (compiled_isa.h) and the harness (isa.cpp): same
    names, same order."""
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
int main(int argc, char** argv) {
  const auto required = nlohmann::json::parse(argv[1]);
  if (argc == 5) {
    std::cout << kvexport::replay::wrong_gpu(required, argv[2], argv[3], argv[4]) << std::endl;
  } else {
    std::cout << kvexport::replay::missing_cpu_feature(required) << std::endl;
  }
}
"""


@pytest.fixture(scope="module")
def cpp_check(tmp_path_factory):
    """The harness's checks, compiled alone: a program that prints missing_cpu_feature(argv[1]), or
    wrong_gpu(argv[1], device, capability, name) when given those too."""
    workdir = tmp_path_factory.mktemp("isa-cpp")
    (workdir / "driver.cpp").write_text(CPP_DRIVER)
    binary = workdir / "isa_check"
    include = nlohmann_json.__file__.rsplit("/", 1)[0] + "/include"
    subprocess.run(
        [
            "g++",
            "-std=c++20",
            "-O1",
            f"-I{ROOT / 'csrc'}",
            f"-I{include}",
            str(workdir / "driver.cpp"),
            str(ROOT / "csrc" / "replay" / "isa.cpp"),
            "-o",
            str(binary),
        ],
        check=True,
    )
    return lambda required, *gpu: subprocess.run(
        [str(binary), json.dumps(required), *gpu], check=True, capture_output=True, text=True
    ).stdout.strip()


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
    required = {
        "op_library": {"march": "x86-64-v3", "cpu_features": ["AVX2"]},
        "package": {"march": "native", "cpu_features": ["AVX2", "NOT_A_FEATURE"]},
    }
    assert (
        cpp_check(required)
        == _python_message(required)
        == ("this host lacks NOT_A_FEATURE required by the package (compiled with -march=native)")
    )
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


# -- artifacts: the record in the manifest, the refusal, the portable build --------------------------

LACKING = "this host lacks NOT_A_FEATURE required by the op library (compiled with -march={march})"


def _require_missing_feature(artifact) -> str:
    """Makes the artifact's manifest ask for a CPU feature no host has; returns the expected line."""
    edit_manifest(artifact, lambda manifest: manifest["isa"]["op_library"]["cpu_features"].append("NOT_A_FEATURE"))
    march = json.loads((artifact / "manifest.json").read_text())["isa"]["op_library"]["march"]
    return LACKING.format(march=march)


def _package_disassembly(package) -> str:
    """objdump of the compiled model's shared object(s) inside model.pt2."""
    import tempfile
    import zipfile

    with zipfile.ZipFile(package) as archive, tempfile.TemporaryDirectory() as tmp:
        text = []
        for name in archive.namelist():
            if name.endswith(".so"):
                path = archive.extract(name, tmp)
                text.append(
                    subprocess.run(
                        ["objdump", "-d", "--no-show-raw-insn", path], check=True, capture_output=True, text=True
                    ).stdout
                )
        assert text, f"no shared object in {package}"
        return "\n".join(text)


@pytest.mark.slow
def test_the_manifest_records_what_the_artifact_was_built_for(tiny_artifact):
    from kvexport.artifact import open_artifact
    from kvexport.host.package import Package

    manifest = json.loads((tiny_artifact / "manifest.json").read_text())
    recorded = manifest["isa"]
    assert recorded["op_library"] == isa.library_isa(tiny_artifact / "lib" / "libkvexport_ops.so")
    assert recorded["package"]["march"] == "native"
    isa.check_host(recorded)
    with Package(open_artifact(tiny_artifact), check_files=True) as package:  # the metadata agrees
        assert json.loads(package._loaded.program.get_metadata()["kvexport.isa"]) == recorded


@pytest.mark.slow
def test_every_command_refuses_a_host_lacking_a_feature_in_one_line(artifact_copy, tmp_path):
    from kvexport.trace.replay import replay_command

    expected = _require_missing_feature(artifact_copy)
    commands = {
        "verify": [sys.executable, "-m", "kvexport", "verify", str(artifact_copy)],
        "soak": [sys.executable, "-m", "kvexport", "soak", str(artifact_copy), "--requests", "5"],
        "replay": replay_command(artifact_copy, tmp_path / "replay.json"),
    }
    for name, command in commands.items():
        result = subprocess.run(command, capture_output=True, text=True, timeout=300)
        assert result.returncode == 2, (name, result.stdout, result.stderr)
        assert result.stderr.strip().splitlines() == [f"error: {expected}"], (name, result.stderr)
    import kvexport

    with pytest.raises(UserError, match=re.escape(expected)):
        kvexport.load(artifact_copy, check_files=False)


@pytest.mark.slow
def test_run_refuses_a_host_lacking_a_feature(artifact_copy, tmp_path):
    import torch

    from kvexport.artifact import open_artifact
    from kvexport.trace.record import load_trace_step

    artifact = open_artifact(artifact_copy)
    requests = tmp_path / "requests.pt"
    torch.save([load_trace_step(artifact.root / artifact.trace_steps[0]["file"])[0]], requests)
    expected = _require_missing_feature(artifact_copy)
    output = tmp_path / "out.pt"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvexport",
            "run",
            str(artifact_copy),
            "--requests",
            str(requests),
            "--output",
            str(output),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [f"error: {expected}"], result.stderr
    assert not output.exists()


@pytest.fixture(scope="module")
def portable_artifact(tmp_path_factory, tiny_checkpoint):
    """hstu-tiny built with serving.cpu_isa: x86-64-v3 (the op library and the package's CPU code)."""
    from torch._inductor import config as inductor_config

    from kvexport.export.build import build_artifact
    from tests.helpers.configs import tiny_raw, write_config

    if not hasattr(inductor_config.cpp, "march"):
        pytest.skip("this torch compiles package code for the build host only (no inductor cpp.march)")
    workdir = tmp_path_factory.mktemp("portable")
    path = write_config(tiny_raw(serving={"cpu_isa": "x86-64-v3"}), workdir / "hstu-tiny-v3.yaml")
    return build_artifact(path, workdir / "out", checkpoint=tiny_checkpoint)


@pytest.mark.slow
def test_a_portable_artifact_needs_only_its_baseline(portable_artifact, tiny_artifact, tmp_path):
    from kvexport.trace.replay import replay_command

    baseline = set(isa.compiler_features(["-march=x86-64-v3"]))
    recorded = json.loads((portable_artifact / "manifest.json").read_text())["isa"]
    assert recorded["op_library"]["march"] == recorded["package"]["march"] == "x86-64-v3"
    assert recorded["package"]["vec_isa"] == "AVX2"
    for part in ("op_library", "package"):
        assert set(recorded[part]["cpu_features"]) <= baseline, part
    # The machine code itself: no 512-bit register operand in the portable package, while the
    # native one on an AVX-512 host has them (so the check can see them). The operand, not the
    # letters alone: objdump's text names each file, and AOTInductor's file names are hashes.
    zmm = re.compile(r"%zmm\d")
    assert not zmm.search(_package_disassembly(portable_artifact / "model.pt2"))
    if "avx512f" in isa.host_flags():
        assert zmm.search(_package_disassembly(tiny_artifact / "model.pt2"))
    shipped = portable_artifact / "lib" / "libkvexport_ops.so"
    assert shipped.read_bytes() != OPS_LIBRARY.read_bytes()
    # A fresh process loads the artifact's own op library and verifies the trace.
    result = subprocess.run(
        [sys.executable, "-m", "kvexport", "verify", str(portable_artifact)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    result = subprocess.run(
        replay_command(portable_artifact, tmp_path / "replay.json"), capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout + result.stderr


GPU = {"gpu": {"capability": "9.0", "name": "NVIDIA H200"}}


@pytest.fixture
def a100_host(monkeypatch):
    """torch sees one CUDA device, an A100 (compute capability 8.0)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")


def test_check_device_refuses_another_gpu_architecture(a100_host, monkeypatch):
    """A CUDA package's Triton kernels are compiled for the build GPU's architecture only."""
    with pytest.raises(UserError) as refused:
        isa.check_device(GPU, torch.device("cuda", 0))
    message = str(refused.value)
    assert "\n" not in message
    assert "compute capability 9.0 (NVIDIA H200)" in message and "cuda:0 has 8.0 (NVIDIA A100)" in message
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    isa.check_device(GPU, torch.device("cuda", 0))


@pytest.mark.slow  # compiles the harness check
def test_cpp_harness_checks_the_gpu_as_python_does(cpp_check, a100_host, monkeypatch):
    with pytest.raises(UserError) as refused:
        isa.check_device(GPU, torch.device("cuda", 0))
    assert cpp_check(GPU, "cuda:0", "8.0", "NVIDIA A100") == str(refused.value)
    assert cpp_check(GPU, "cuda:0", "9.0", "NVIDIA H200") == ""
    assert cpp_check({"op_library": {}}, "cuda:0", "8.0", "NVIDIA A100") == ""  # a CPU package
    assert cpp_check({"gpu": {}}, "cuda:0", "8.0", "NVIDIA A100") == ""
    isa.check_device({"gpu": {}}, torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError) as refused:
        isa.check_device(GPU, torch.device("cuda"))
    assert (
        cpp_check(GPU, "cuda", "", "")
        == str(refused.value)
        == ("this is a CUDA package (built on NVIDIA H200) and this host has no CUDA device cuda")
    )


def test_gpu_info_names_no_gpu_for_cpu_devices():
    from kvexport.ops import wrappers as kv

    assert kv.gpu_info(torch.device("cpu")) == ("", "")
    if not torch.cuda.is_available():
        assert kv.gpu_info(torch.device("cuda", 0)) == ("", "")


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a host without a CUDA device")
def test_replay_refuses_a_cuda_package_on_a_host_without_cuda(artifact_copy, tmp_path):
    from kvexport.trace.replay import replay_command

    def make_cuda(manifest):
        manifest["device"] = "cuda"
        manifest["isa"].update(GPU)

    edit_manifest(artifact_copy, make_cuda)
    result = subprocess.run(
        replay_command(artifact_copy, tmp_path / "replay.json"), capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: this is a CUDA package (built on NVIDIA H200) and this host has no CUDA device cuda"
    ]


def test_check_device_without_cuda_and_for_cpu_packages(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError, match="CUDA package .*has no CUDA device cuda$"):
        isa.check_device(GPU, torch.device("cuda"))
    isa.check_device(GPU, torch.device("cpu"))  # a CPU device of a CUDA package is refused elsewhere
    isa.check_device({}, torch.device("cuda"))  # a CPU package records no GPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(UserError, match="has no CUDA device cuda:3$"):
        isa.check_device(GPU, torch.device("cuda", 3))
