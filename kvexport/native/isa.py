"""CPU instruction sets: what a package and its op library were compiled for, and whether a host has them.

Two parts of an artifact carry machine code built for a CPU:

- the op library (`lib/libkvexport_ops.so`): its attention kernel is compiled with
  `-march=KVEXPORT_KERNEL_ARCH` (`native` by default; a portable baseline such as `x86-64-v3` with
  `python -m kvexport.native --isa x86-64-v3`). The library records the features that build may
  use (csrc/ops/compiled_isa.h) in a string found here by its marker, without loading the .so;
- the package (`model.pt2`): AOTInductor compiles its kernels with `-march=native` (inductor config
  `cpp.march`) plus the vector ISA it picked (`AOTI_CPU_ISA` in its metadata).

A config's `serving.cpu_isa` picks both: `native` (the default), or a portable x86-64 baseline for
which `inductor_configs()` sets the march and a vector width within it. `artifact_isa()` describes
what was built for the manifest; `check_host()` refuses, in one line, a host that lacks a feature
either part requires (csrc/replay/isa.cpp is the C++ harness's twin). A CUDA package also records
the build GPU (`gpu_isa()`): its Triton kernels run on that compute capability only, which
`check_device()` checks.
"""

from __future__ import annotations

import functools
import logging
import subprocess
from pathlib import Path

from kvexport.errors import UserError
from kvexport.native.paths import NATIVE_ISA, OPS_LIBRARY

log = logging.getLogger(__name__)

# Feature name (as compiled_isa.h and csrc/replay/isa.cpp spell it) -> (compiler macro, the
# /proc/cpuinfo flags that show it). Ordered from the oldest extension to the newest, so that the
# first missing feature named is the most basic one.
FEATURES: dict[str, tuple[str, tuple[str, ...]]] = {
    "SSE3": ("__SSE3__", ("pni",)),
    "SSSE3": ("__SSSE3__", ("ssse3",)),
    "SSE4_1": ("__SSE4_1__", ("sse4_1",)),
    "SSE4_2": ("__SSE4_2__", ("sse4_2",)),
    "POPCNT": ("__POPCNT__", ("popcnt",)),
    "AVX": ("__AVX__", ("avx",)),
    "AVX2": ("__AVX2__", ("avx2",)),
    "FMA": ("__FMA__", ("fma",)),
    "F16C": ("__F16C__", ("f16c",)),
    "BMI1": ("__BMI__", ("bmi1",)),
    "BMI2": ("__BMI2__", ("bmi2",)),
    "LZCNT": ("__LZCNT__", ("abm", "lzcnt")),
    "MOVBE": ("__MOVBE__", ("movbe",)),
    "AVX512F": ("__AVX512F__", ("avx512f",)),
    "AVX512CD": ("__AVX512CD__", ("avx512cd",)),
    "AVX512BW": ("__AVX512BW__", ("avx512bw",)),
    "AVX512DQ": ("__AVX512DQ__", ("avx512dq",)),
    "AVX512VL": ("__AVX512VL__", ("avx512vl",)),
    "AVX512IFMA": ("__AVX512IFMA__", ("avx512ifma",)),
    "AVX512VBMI": ("__AVX512VBMI__", ("avx512vbmi",)),
    "AVX512VBMI2": ("__AVX512VBMI2__", ("avx512_vbmi2",)),
    "AVX512VNNI": ("__AVX512VNNI__", ("avx512_vnni",)),
    "AVX512BITALG": ("__AVX512BITALG__", ("avx512_bitalg",)),
    "AVX512VPOPCNTDQ": ("__AVX512VPOPCNTDQ__", ("avx512_vpopcntdq",)),
    "AVX512BF16": ("__AVX512BF16__", ("avx512_bf16",)),
    "AVX512FP16": ("__AVX512FP16__", ("avx512_fp16",)),
    "GFNI": ("__GFNI__", ("gfni",)),
    "VAES": ("__VAES__", ("vaes",)),
    "VPCLMULQDQ": ("__VPCLMULQDQ__", ("vpclmulqdq",)),
}
MARKER = b"kvexport-ops-isa:"
# Portable baseline -> the widest vector width (bits) Inductor may use within it: AVX2's 256 for
# x86-64-v3; x86-64-v2 has no vector ISA Inductor generates, so its kernels are scalar (width 1
# matches none). A width, not a named ISA, is all Inductor's config takes.
BASELINE_SIMD_BITS = {"x86-64-v2": 1, "x86-64-v3": 256}
# What each part is called in check_host's message.
PARTS = {"op_library": "the op library", "package": "the package"}


def library_isa(path: Path = OPS_LIBRARY) -> dict:
    """The op library's build target: {"march", "cpu_features", "multiversion"}, read from the file."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise UserError(f"cannot read op library {path}: {exc.strerror}") from exc
    start = data.find(MARKER)
    if start < 0:
        raise UserError(f"{path} does not record the CPU it was compiled for; rebuild it (python -m kvexport.native)")
    text = data[start + len(MARKER) : data.index(b"\0", start)].decode()
    fields = dict(part.split("=", 1) for part in text.split(";"))
    return {
        "march": fields["march"],
        "cpu_features": _split(fields["features"]),
        "multiversion": _split(fields["clones"]),
    }


def _split(names: str) -> list[str]:
    return [name for name in names.split(",") if name]


def compiler_features(flags: list[str]) -> list[str]:
    """The features the C++ compiler Inductor uses enables with these flags (-march=..., -mavx512f ...)."""
    from torch._inductor.cpp_builder import get_cpp_compiler

    command = [get_cpp_compiler(), *flags, "-dM", "-E", "-x", "c++", "/dev/null"]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise UserError(f"{' '.join(command)} failed: {result.stderr.strip().splitlines()[-1:]}")
    defined = {line.split()[1] for line in result.stdout.splitlines() if line.startswith("#define ")}
    return [name for name, (macro, _) in FEATURES.items() if macro in defined]


def inductor_configs(cpu_isa: str) -> dict[str, object]:
    """AOTInductor settings that compile a package's CPU code for `cpu_isa` ("native": none).

    Torch before 2.13 has no `cpp.march` and always compiles for the build host: a portable
    baseline is refused there (UserError) rather than recorded for code that does not honour it.
    """
    if cpu_isa == NATIVE_ISA:
        return {}
    from torch._inductor import config

    if not hasattr(config.cpp, "march"):
        import torch

        raise UserError(
            f"serving.cpu_isa {cpu_isa} needs torch 2.13 or later: torch {torch.__version__} "
            "compiles a package's CPU code for the build host only"
        )
    return {"cpp.march": cpu_isa, "cpp.simdlen": BASELINE_SIMD_BITS[cpu_isa]}


def package_isa() -> dict:
    """What AOTInductor compiles the package's kernels for under the inductor config in effect now:
    {"march", "vec_isa" (AOTI_CPU_ISA), "cpu_features"}. Call it where the package is compiled."""
    from torch._inductor import config
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    march = getattr(config.cpp, "march", None)  # torch < 2.13 has no such option: -march=native
    march = "native" if march is None else march
    vec_isa = pick_vec_isa()
    flags = ([f"-march={march}"] if march else []) + vec_isa.build_arch_flags().split()
    return {"march": march, "vec_isa": str(vec_isa).upper(), "cpu_features": compiler_features(flags)}


def artifact_isa(cpu_isa: str = NATIVE_ISA, library: Path = OPS_LIBRARY) -> dict:
    """The manifest's record of what the artifact's machine code requires of a host's CPU, for a
    package compiled with inductor_configs(cpu_isa) and the op library at `library`."""
    from torch._inductor import config

    with config.patch(inductor_configs(cpu_isa)):
        package = package_isa()
    return {"op_library": library_isa(library), "package": package}


@functools.lru_cache(maxsize=1)
def host_flags() -> frozenset[str]:
    """This CPU's feature flags as Linux reports them (/proc/cpuinfo)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError as exc:
        raise UserError(f"cannot read this host's CPU features from /proc/cpuinfo: {exc.strerror}") from exc
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def host_has(feature: str, flags: frozenset[str]) -> bool:
    """Whether the flags show the feature; a name this table lacks is looked up as its lowercase."""
    _, names = FEATURES.get(feature, ("", (feature.lower(),)))
    return any(name in flags for name in names)


def check_host(required: dict, flags: frozenset[str] | None = None) -> None:
    """Raises UserError naming the first feature a part of the artifact requires and this CPU lacks.

    required: artifact_isa()'s dict (from the manifest); parts it does not list are not checked.
    flags: the CPU's flags, this host's by default (tests pass synthetic ones).
    """
    flags = host_flags() if flags is None else flags
    for part, label in PARTS.items():
        spec = required.get(part)
        if not spec:
            continue
        for feature in spec.get("cpu_features", []):
            if not host_has(feature, flags):
                raise UserError(
                    f"this host lacks {feature} required by {label} (compiled with -march={spec.get('march', '?')})"
                )
    log.debug("host CPU has every feature the artifact requires")


def gpu_isa(device: str) -> dict:
    """What a CUDA package's GPU code is compiled for: the build GPU's compute capability (Inductor
    compiles the package's Triton kernels for that architecture alone) and its name."""
    import torch

    major, minor = torch.cuda.get_device_capability(device)
    return {"capability": f"{major}.{minor}", "name": torch.cuda.get_device_name(device)}


def check_device(required: dict, device) -> None:
    """Raises UserError when `device` cannot run the GPU code of a package whose artifact_isa() is
    `required`: no CUDA device, or one of another compute capability than the build GPU's."""
    spec = required.get("gpu")
    if not spec or device.type != "cuda":
        return
    import torch

    index = device.index if device.index is not None else 0
    if not torch.cuda.is_available() or index >= torch.cuda.device_count():
        raise UserError(
            f"this is a CUDA package (built on {spec.get('name', '?')}) and this host has no CUDA device {device}"
        )
    major, minor = torch.cuda.get_device_capability(device)
    if f"{major}.{minor}" != spec.get("capability"):
        raise UserError(
            f"the package's GPU code is compiled for compute capability {spec.get('capability')} "
            f"({spec.get('name', '?')}); {device} has {major}.{minor} "
            f"({torch.cuda.get_device_name(device)}): build the package on a GPU of this architecture"
        )
