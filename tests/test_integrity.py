"""One integrity contract (kvexport/contract.json), two checkers that follow it.

Every artifact of one corpus of tampered copies must get the same exit code, for the same reason,
from `kvexport verify` (Python), `kvexport replay` (the launcher, then the C++ harness) and the
C++ harness run on its own (it has the contract compiled in). Expected codes are the documented
ones: 0 pass, 1 a file or manifest that does not hold what was built, 2 an unusable artifact.
"""

from __future__ import annotations

import shutil
import struct
import subprocess
import sys
import zipfile

import pytest
import torch
from click.testing import CliRunner

from kvexport.artifact import MANIFEST, open_artifact
from kvexport.commands.cli import main
from kvexport.trace.replay import harness, library_flags
from tests.helpers.artifacts import edit_manifest, rehash, replace_shared_objects

pytestmark = pytest.mark.slow


def flip_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def truncate(path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def perturb_and_rehash(artifact, rel: str) -> None:
    """Changes an expected output and records the file's new sha256: only the package's trace digest disagrees."""
    data = torch.load(artifact / rel, weights_only=True)
    data["expected_cached"] = data["expected_cached"] + 1e-2
    torch.save(data, artifact / rel)
    rehash(artifact, rel)


def write(rel: str, content: bytes = b"extra"):
    def tamper(artifact):
        (artifact / rel).parent.mkdir(parents=True, exist_ok=True)
        (artifact / rel).write_bytes(content)

    return tamper


def unlink(*rels: str):
    def tamper(artifact):
        for rel in rels:
            (artifact / rel).unlink()

    return tamper


def delete_package_and_its_listing(artifact) -> None:
    """Only the contract's required files catch this: nothing listed is missing."""
    (artifact / "model.pt2").unlink()
    edit_manifest(artifact, lambda m: m["files"].pop("model.pt2"))


def set_field(*path, value):
    """A manifest edit setting manifest[path[0]][path[1]]... to value."""

    def edit(manifest):
        node = manifest
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value(node[path[-1]]) if callable(value) else value

    return lambda artifact: edit_manifest(artifact, edit)


# name: (tamper(artifact_dir), expected exit code, text every runner's output must contain)
CORPUS = {
    "pristine": (lambda a: None, 0, "verdict: PASS"),
    "reports directory (not hashed)": (write("reports/verify.json", b"{}"), 0, "verdict: PASS"),
    "modified trace file": (
        lambda a: flip_byte(a / "trace/step_0003.pt"),
        1,
        "trace/step_0003.pt does not match its sha256 in the manifest",
    ),
    "modified reference file": (
        lambda a: flip_byte(a / "trace/step_0003.reference.pt"),
        1,
        "trace/step_0003.reference.pt does not match its sha256 in the manifest",
    ),
    "truncated model.pt2": (lambda a: truncate(a / "model.pt2"), 1, "model.pt2 does not match its sha256"),
    "unlisted file at the top": (write("notes.txt"), 1, "notes.txt is not listed in the manifest"),
    "unlisted trace file": (write("trace/step_9999.pt"), 1, "trace/step_9999.pt is not listed in the manifest"),
    "unlisted library": (write("lib/libextra.so"), 1, "lib/libextra.so is not listed in the manifest"),
    "unlisted hidden file": (write("trace/.hidden"), 1, "trace/.hidden is not listed in the manifest"),
    "trace file deleted": (
        unlink("trace/step_0001.pt"),
        2,
        "is incomplete: trace/step_0001.pt is listed in the manifest but missing",
    ),
    "reference file deleted": (
        unlink("trace/step_0001.reference.pt"),
        2,
        "is incomplete: trace/step_0001.reference.pt is listed in the manifest but missing",
    ),
    "listed op library deleted": (
        unlink("lib/libkvexport_ops.so"),
        2,
        "is incomplete: lib/libkvexport_ops.so is listed in the manifest but missing",
    ),
    "package deleted": (unlink("model.pt2"), 2, "is incomplete: model.pt2 is listed in the manifest but missing"),
    "package deleted and unlisted": (delete_package_and_its_listing, 2, "is incomplete: model.pt2 is missing"),
    "manifest deleted": (unlink(MANIFEST), 2, "is not a kvexport artifact: manifest.json is missing"),
    "manifest not JSON": (write(MANIFEST, b"{not json"), 2, "manifest.json is not valid JSON"),
    "manifest lacks a field": (
        lambda a: edit_manifest(a, lambda m: m.pop("tolerance")),
        2,
        "manifest.json lacks the field tolerance",
    ),
    "manifest of another format": (
        set_field("format_version", value=1),
        2,
        "has format_version 1, this kvexport reads 3",
    ),
    "manifest with malformed files": (set_field("files", value=[]), 2, "manifest.json has a malformed files"),
    "edited tolerance": (
        set_field("tolerance", "atol", value=lambda atol: atol * 10),
        1,
        "manifest.json was edited: its tolerance does not match model.pt2's metadata",
    ),
    "edited runtime_config": (
        set_field("runtime_config", "host_pages", value=lambda n: n + 16),
        1,
        "its runtime_config does not match model.pt2's metadata",
    ),
    "edited config": (
        set_field("config", "trace", "seed", value=1),
        1,
        "its config does not match model.pt2's metadata",
    ),
    "edited runtime_name": (
        set_field("runtime_name", value="hstu-tiny-000000000000"),
        1,
        "its runtime_name does not match model.pt2's metadata",
    ),
    "edited weights": (
        set_field("weights", value={"source": "seed", "seed": 0}),
        1,
        "its weights does not match model.pt2's metadata",
    ),
    "edited device": (set_field("device", value="cuda"), 1, "its device does not match model.pt2's metadata"),
    "edited isa": (
        set_field("isa", "package", "march", value="x86-64-v2"),
        1,
        "its isa does not match model.pt2's metadata",
    ),
    "edited step description": (
        set_field("trace", "steps", 0, "description", value="anything"),
        1,
        "its trace does not match model.pt2's metadata",
    ),
    "trace step removed": (
        set_field("trace", "steps", value=lambda steps: steps[:-1]),
        1,
        "its trace does not match model.pt2's metadata",
    ),
    "trace file changed and rehashed": (
        lambda a: perturb_and_rehash(a, "trace/step_0002.pt"),
        1,
        "its trace does not match model.pt2's metadata",
    ),
}


@pytest.fixture(scope="module")
def harness_flags(tiny_artifact) -> list[str]:
    """--library flags for the package's required libraries, taken from the untouched artifact
    (a tampered manifest may not be readable)."""
    return library_flags(open_artifact(tiny_artifact).required_libraries)


def run_verify(artifact, capfd, flags) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["verify", str(artifact)])
    return result.exit_code, result.output


def run_replay(artifact, capfd, flags) -> tuple[int, str]:
    """`kvexport replay`: its own output and the harness's (a child process writing to the real fds)."""
    capfd.readouterr()
    result = CliRunner().invoke(main, ["replay", str(artifact)])
    captured = capfd.readouterr()
    return result.exit_code, result.output + captured.out + captured.err


def run_harness(artifact, capfd, flags) -> tuple[int, str]:
    """The C++ harness on its own: the contract it follows is the one compiled into it."""
    result = subprocess.run([str(harness()), "--artifact", str(artifact), *flags], capture_output=True, text=True)
    return result.returncode, result.stdout + result.stderr


RUNNERS = {"verify": run_verify, "replay": run_replay, "harness": run_harness}


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("case", CORPUS)
def test_corpus_outcome_is_the_same_in_python_and_cpp(tiny_artifact, tmp_path, capfd, harness_flags, case, runner):
    artifact = shutil.copytree(tiny_artifact, tmp_path / "hstu-tiny")
    tamper, expected_exit, needle = CORPUS[case]
    tamper(artifact)
    exit_code, output = RUNNERS[runner](artifact, capfd, harness_flags)
    assert exit_code == expected_exit, output
    assert needle in output, output


def refusal_in_a_fresh_process(artifact) -> list[str]:
    """`kvexport verify` in a new interpreter (its op library and package load there first): asserts
    exit 2 and returns its stderr lines."""
    result = subprocess.run(
        [sys.executable, "-m", "kvexport", "verify", str(artifact)], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 2, result.stdout + result.stderr
    return result.stderr.strip().splitlines()


def test_an_op_library_of_another_kvexport_version_is_refused_in_one_line(tiny_artifact, tmp_path):
    """An artifact ships its own op library; one from another kvexport version may lack an op this
    kvexport declares. Simulated by renaming gpu_info inside the shipped library (same length: the
    library then defines kvexport::gpu_infX instead)."""
    artifact = shutil.copytree(tiny_artifact, tmp_path / "hstu-tiny")
    library = artifact / "lib" / "libkvexport_ops.so"
    data = library.read_bytes()
    assert data.count(b"gpu_info") >= 2  # the schema and the kernel's registration
    library.write_bytes(data.replace(b"gpu_info", b"gpu_infX"))
    rehash(artifact, "lib/libkvexport_ops.so")
    assert refusal_in_a_fresh_process(artifact) == [
        f"error: {library} is an op library of another kvexport version (it lacks kvexport::gpu_info): "
        "rebuild the artifact (or the op library: python -m kvexport.native) with this kvexport"
    ]


def _truncate_shared_objects(package, compress: bool = False) -> None:
    """Rewrites the package with every .so cut to half its bytes (the zip itself stays valid), stored
    as torch writes it or, with compress, deflated."""
    rewritten = package.with_suffix(".tmp")
    with zipfile.ZipFile(package) as source, zipfile.ZipFile(rewritten, "w") as target:
        for member in source.infolist():
            data = source.read(member.filename)
            if member.filename.endswith(".so"):
                data = data[: len(data) // 2]
                member.compress_type = zipfile.ZIP_DEFLATED if compress else member.compress_type
            target.writestr(member, data)
    rewritten.replace(package)


@pytest.mark.parametrize("compress", [False, True], ids=["stored", "deflated"])
def test_a_truncated_shared_object_is_refused_before_loading(tiny_artifact, tmp_path, compress):
    """torch's loader maps a .so whose bytes end early and the process dies of SIGBUS, with no message;
    kvexport and the C++ harness read the ELF tables first and say the same. The manifest's hash is
    updated, as for a package written short before it was hashed."""
    artifact = shutil.copytree(tiny_artifact, tmp_path / "hstu-tiny")
    _truncate_shared_objects(artifact / "model.pt2", compress)
    rehash(artifact, "model.pt2")
    lines = refusal_in_a_fresh_process(artifact)
    assert len(lines) == 1 and lines[0].startswith("error: ") and "is truncated or corrupt" in lines[0], lines
    assert f"{artifact / 'model.pt2'}: model/data/aotinductor/model/" in lines[0]
    flags = library_flags(open_artifact(artifact).required_libraries)
    replayed = subprocess.run(
        [str(harness()), "--artifact", str(artifact), *flags], capture_output=True, text=True, timeout=300
    )
    assert (replayed.returncode, replayed.stderr.strip().splitlines()) == (2, lines)


def elf(
    segment_bytes: int,
    section_table_at: int = 0,
    *,
    program_headers_at: int = 64,
    entry_size: int = 56,
    segment_at: int = 0,
) -> bytes:
    """A 220-byte ELF file: one loadable segment of segment_bytes at segment_at."""
    header = bytearray(64)
    header[:6] = b"\x7fELF\x02\x01"
    struct.pack_into("<QQ", header, 0x20, program_headers_at, section_table_at)
    struct.pack_into("<HHHH", header, 0x36, entry_size, 1, 64, 1 if section_table_at else 0)
    segment = struct.pack("<IIQQQQQQ", 1, 5, segment_at, 0, 0, segment_bytes, segment_bytes, 4096)
    return bytes(header) + segment + bytes(100)


@pytest.mark.parametrize(
    ("member", "message"),
    [
        (elf(500), "a loadable segment ends at byte 500, past its 220 bytes"),
        (elf(2**64 - 1, segment_at=8), f"a loadable segment ends at byte {2**64 + 7}, past its 220 bytes"),
        (elf(220, program_headers_at=2**64 - 56), "its ELF tables lie past its 220 bytes"),
        (elf(220, section_table_at=2**64 - 8), "its ELF tables lie past its 220 bytes"),
        (elf(220, entry_size=32), "its program headers are 32 bytes each"),
        (elf(220)[:40], "is not a 64-bit little-endian ELF shared object"),
    ],
)
@pytest.mark.parametrize("compress", [False, True], ids=["stored", "deflated"])
def test_the_harness_checks_shared_objects_as_kvexport_does(tiny_artifact, tmp_path, member, message, compress):
    """Hand-made members, overflowing offsets among them: the harness refuses each before it loads
    anything, with kvexport.export.compile's message."""
    from kvexport.errors import UserError
    from kvexport.host.package_file import check_shared_objects

    artifact = shutil.copytree(tiny_artifact, tmp_path / "hstu-tiny")
    replace_shared_objects(artifact / "model.pt2", member, compress)
    rehash(artifact, "model.pt2")
    with pytest.raises(UserError) as python:
        check_shared_objects(artifact / "model.pt2")
    assert message in str(python.value)
    flags = library_flags(open_artifact(artifact).required_libraries)
    replayed = subprocess.run(
        [str(harness()), "--artifact", str(artifact), *flags], capture_output=True, text=True, timeout=300
    )
    assert (replayed.returncode, replayed.stderr.strip()) == (2, f"error: {python.value}")


def test_elf_segments_and_tables_are_checked_against_the_size():
    import io

    from kvexport.errors import UserError
    from kvexport.native.elf import check_elf

    whole = elf(220)
    check_elf(io.BytesIO(whole), len(whole), "whole.so")
    short = elf(500)
    with pytest.raises(
        UserError, match="^short.so is truncated or corrupt: a loadable segment ends at byte 500, past its 220 bytes$"
    ):
        check_elf(io.BytesIO(short), len(short), "short.so")
    tables = elf(220, section_table_at=200)
    with pytest.raises(UserError, match="its ELF tables lie past its 220 bytes"):
        check_elf(io.BytesIO(tables), len(tables), "tables.so")
    with pytest.raises(UserError, match="not a 64-bit little-endian ELF"):
        check_elf(io.BytesIO(b"#!/bin/sh\n"), 10, "script.so")
