"""The artifact directory written by `kvexport build`, and its manifest.

    OUT/model.pt2        AOTInductor package (metadata inside)
    OUT/lib/             the op library the package calls
    OUT/trace/           recorded requests + expected outputs, step_NNNN.pt
    OUT/manifest.json    config, signature, dims, tolerances, versions, timings, sha256 of every file
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from pathlib import Path
from typing import Any

from kvexport.config import Config, config_from_dict
from kvexport.errors import UserError, VerificationError

MANIFEST = "manifest.json"
PACKAGE = "model.pt2"
TRACE_DIR = "trace"
LIB_DIR = "lib"
REPORTS_DIR = "reports"  # written by verify/replay --json and scripts/package.sh; not hashed
FORMAT_VERSION = 1


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def hash_files(root: Path) -> dict[str, str]:
    """sha256 of every file under root except the manifest, by relative path."""
    return {
        str(p.relative_to(root)): sha256_of(p)
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }


@dataclasses.dataclass(frozen=True)
class Artifact:
    """A built artifact directory and its parsed manifest."""

    root: Path
    manifest: dict[str, Any]

    @functools.cached_property
    def config(self) -> Config:
        return config_from_dict(self.manifest["config"])

    @property
    def package(self) -> Path:
        return self.root / PACKAGE

    @property
    def trace_steps(self) -> list[dict[str, Any]]:
        return self.manifest["trace"]["steps"]

    @property
    def tolerance(self) -> dict[str, float]:
        return self.manifest["tolerance"]

    @property
    def runtime_name(self) -> str:
        return self.manifest["runtime_name"]

    @property
    def required_libraries(self) -> list[str]:
        return self.manifest["required_libraries"]


def open_artifact(root: str | Path) -> Artifact:
    """Reads OUT/manifest.json; an unusable directory is a UserError (exit 2)."""
    root = Path(root)
    if not root.is_dir():
        raise UserError(f"artifact directory {root} does not exist")
    path = root / MANIFEST
    if not path.is_file():
        raise UserError(f"{root} is not a kvexport artifact: {MANIFEST} is missing")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{path} is not valid JSON") from exc
    required = ("format_version", "config", "runtime_config", "dims", "files", "trace", "tolerance", "runtime_name",
                "required_libraries")
    missing = [key for key in required if not isinstance(manifest, dict) or key not in manifest]
    if missing:
        raise UserError(f"{path} lacks the field {missing[0]}")
    if not isinstance(manifest["trace"], dict) or not isinstance(manifest["trace"].get("steps"), list):
        raise UserError(f"{path} lacks the trace step list")
    if manifest["format_version"] != FORMAT_VERSION:
        raise UserError(f"{path} has format_version {manifest['format_version']}, this kvexport reads {FORMAT_VERSION}")
    try:
        config_from_dict(manifest["config"])
    except UserError as exc:
        raise UserError(f"{path}: {exc}") from exc
    return Artifact(root, manifest)


def check_files(artifact: Artifact) -> int:
    """Compares every file with its manifest sha256; returns how many were checked.

    A missing file makes the artifact incomplete (UserError, exit 2); a changed or unlisted
    file is a VerificationError (exit 1). Both name the file.
    """
    expected: dict[str, str] = artifact.manifest["files"]
    for rel, digest in sorted(expected.items()):
        path = artifact.root / rel
        if not path.is_file():
            raise UserError(f"artifact {artifact.root} is incomplete: {rel} is listed in the manifest but missing")
        if sha256_of(path) != digest:
            raise VerificationError(f"{rel} does not match its sha256 in the manifest (modified or corrupted)")
    unlisted = sorted(set(hash_files(artifact.root)) - set(expected))
    extra = [rel for rel in unlisted if not rel.startswith(REPORTS_DIR + "/")]
    if extra:
        raise VerificationError(f"{extra[0]} is not listed in the manifest")
    return len(expected)


def trace_digest(steps: list[dict[str, Any]], files: dict[str, str]) -> str:
    """sha256 over each trace step's file, file hash and expected error, one line a step.

    Stored in the package metadata, so an edited trace list or trace hash in manifest.json is
    caught (the C++ harness computes the same lines).
    """
    lines = "".join(f"{s['file']}\t{files.get(s['file'], '')}\t{s.get('expect_error', '')}\n" for s in steps)
    return hashlib.sha256(lines.encode()).hexdigest()


def check_manifest_against_package(artifact: Artifact, metadata: dict[str, str]) -> None:
    """manifest.json must agree with the metadata compiled into model.pt2 (VerificationError otherwise)."""
    m = artifact.manifest
    checks = {
        "runtime_config": (m["runtime_config"], json.loads(metadata.get("kvexport.runtime_config", "null"))),
        "tolerance": (m["tolerance"], json.loads(metadata.get("kvexport.tolerance", "null"))),
        "required_libraries": (m["required_libraries"],
                               json.loads(metadata.get("kvexport.required_libraries", "null"))),
        "trace": (trace_digest(artifact.trace_steps, m["files"]), metadata.get("kvexport.trace_digest")),
    }
    for field, (in_manifest, in_package) in checks.items():
        if in_manifest != in_package:
            raise VerificationError(f"{MANIFEST} was edited: its {field} does not match {PACKAGE}'s metadata")
