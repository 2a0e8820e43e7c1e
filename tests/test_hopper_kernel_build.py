"""Compile-time evidence for the Hopper attention path (csrc/ops/paged_attention_sm90.cu) on a
machine without a GPU: nvcc compiles it for sm_90a exactly as the op library's CMake block does,
and the machine code is read back. Every kernel instantiation must

- run its products on the Hopper tensor-core instructions (HGMMA, wgmma's SASS), both the 64-key
  score tile (S = Q K^T) and the P V product whose width is the head dim;
- keep its registers: no local-memory spills (ptxas's report, and no LDL/STL in the SASS);
- keep its wgmma asynchronous: ptxas serialises them (and says so) where it cannot prove that an
  in-flight product's registers are left alone, which would undo the P V product's overlap with
  the next block;
- compute SiLU's sigmoid through tanh.approx for bf16 (MUFU.TANH).

Skipped with one line where nvcc, CUTLASS's headers (nvidia-cutlass) or cuobjdump/nvdisasm
(nvidia-cuda-cuobjdump, nvidia-cuda-nvdisasm) are absent; `make test` installs the latter two.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from kvexport.native.build import cutlass_include_dir
from kvexport.native.paths import SOURCE_DIR

pytestmark = pytest.mark.slow

KERNEL = SOURCE_DIR / "ops" / "paged_attention_sm90.cu"
# One instantiation per (element, head_dim, consumer warpgroups): 2 x 2 x 3.
NUM_KERNELS = 12


def _cuda_binaries() -> Path | None:
    """The directory holding cuobjdump and nvdisasm: the PATH's, else the NVIDIA wheels'."""
    found = shutil.which("cuobjdump")
    if found and shutil.which("nvdisasm"):
        return Path(found).parent
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        for bin_dir in sorted(Path(root).glob("cu*/bin")):
            if (bin_dir / "cuobjdump").is_file() and (bin_dir / "nvdisasm").is_file():
                return bin_dir
    return None


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> tuple[str, str]:
    """(ptxas's resource report, the SASS) of the Hopper kernels compiled for sm_90a."""
    nvcc = shutil.which("nvcc")
    cutlass = cutlass_include_dir()
    tools = _cuda_binaries()
    if nvcc is None:
        pytest.skip("nvcc is not installed")
    if cutlass is None:
        pytest.skip("CUTLASS headers not installed (pip install --no-deps nvidia-cutlass==4.2.0.0)")
    if tools is None:
        pytest.skip("cuobjdump/nvdisasm not found (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
    obj = tmp_path_factory.mktemp("sm90") / "paged_attention_sm90.o"
    build = subprocess.run(
        [
            nvcc,
            "-std=c++20",
            "-O3",
            "--expt-relaxed-constexpr",
            "-gencode=arch=compute_90a,code=sm_90a",
            "-Xptxas",
            "-v",
            f"-I{SOURCE_DIR}",
            "-isystem",
            str(cutlass),
            "-c",
            str(KERNEL),
            "-o",
            str(obj),
        ],
        capture_output=True,
        text=True,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    env = {**os.environ, "PATH": f"{tools}{os.pathsep}{os.environ.get('PATH', '')}"}
    sass = subprocess.run([str(tools / "cuobjdump"), "-sass", str(obj)], capture_output=True, text=True, env=env)
    assert sass.returncode == 0, sass.stderr
    return build.stderr, sass.stdout


def _kernels(sass: str) -> dict[str, str]:
    """Each kernel's SASS by its (mangled) name."""
    parts = re.split(r"\n\s*Function : (\S+)\n", sass)
    return {name: body for name, body in zip(parts[1::2], parts[2::2]) if "attention_sm90_kernel" in name}


def test_every_instantiation_uses_wgmma(compiled):
    kernels = _kernels(compiled[1])
    assert len(kernels) == NUM_KERNELS, sorted(kernels)
    for name, body in kernels.items():
        head_dim = 64 if "ELi64E" in name else 128
        assert re.search(r"HGMMA\.64x64x16\.F32", body), f"{name}: no 64x64 wgmma (S = Q K^T)"
        assert re.search(rf"HGMMA\.64x{head_dim}x16\.F32", body), f"{name}: no 64x{head_dim} wgmma (P V)"
        assert "HMMA" not in body.replace("HGMMA", ""), f"{name}: falls back to mma.sync"


def test_no_local_memory(compiled):
    report, sass = compiled
    frames = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert len(frames) == NUM_KERNELS, report[-2000:]
    assert all(frame == ("0", "0", "0") for frame in frames), frames
    for name, body in _kernels(sass).items():
        assert not re.search(r"\b(LDL|STL)\b", body), f"{name} reads or writes local memory"


def test_wgmma_not_serialised(compiled):
    report = compiled[0]
    assert "wgmma.mma_async instructions are serialized" not in report, report[-3000:]


def test_bf16_silu_through_tanh(compiled):
    for name, body in _kernels(compiled[1]).items():
        if "bfloat16" in name:
            assert "MUFU.TANH" in body, f"{name}: SiLU's sigmoid is not one tanh.approx"
