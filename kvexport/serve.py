"""Scoring a user's request file, and describing a built artifact (`kvexport run`, `kvexport inspect`)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kvexport.artifact import MANIFEST, PACKAGE, open_artifact
from kvexport.errors import UserError
from kvexport.export.package import read_package
from kvexport.model.batch import RequestError, check_batch
from kvexport.io import load_tensor_file, write_atomically


def load_requests(path: Path, config) -> list:
    """Reads and validates every batch before any runs (a bad file leaves no output and no cache change)."""
    raw = load_tensor_file(path, "request file")
    if not isinstance(raw, (list, tuple)):
        raise RequestError(f"request file {path} must hold a list of batches, got {type(raw).__name__}")
    if not raw:
        raise RequestError(f"request file {path} holds no batches")
    return [check_batch(batch, config, index) for index, batch in enumerate(raw)]


def score_request_file(out: Path, requests_path: Path, output_path: Path) -> int:
    from kvexport.runner import PackageRunner

    artifact = open_artifact(out)
    batches = load_requests(requests_path, artifact.config)
    if not output_path.resolve().parent.is_dir():
        raise UserError(f"cannot write output {output_path}: its directory does not exist")
    runner = PackageRunner(artifact)
    outputs = [runner.run(batch).contiguous() for batch in batches]
    write_atomically(output_path, lambda tmp: torch.save(outputs, tmp), "output")
    return len(outputs)


def describe(target: Path) -> dict:
    """What `kvexport inspect` shows, from the manifest (a directory) or the package alone."""
    if target.is_dir():
        artifact = open_artifact(target)
        package = artifact.package
        manifest = artifact.manifest
    elif target.is_file():
        package, manifest = target, None
    else:
        raise UserError(f"{target} does not exist")
    metadata, ops = read_package(package)
    info = {
        "package": str(package),
        "package_bytes": package.stat().st_size,
        "name": json.loads(metadata.get("kvexport.config", "{}")).get("name", "?"),
        "runtime_name": metadata.get("kvexport.runtime_name", "?"),
        "kvexport_version": metadata.get("kvexport.version", "?"),
        "torch_version": metadata.get("kvexport.torch_version", "?"),
        "signature": json.loads(metadata.get("kvexport.signature", "[]")),
        "required_libraries": json.loads(metadata.get("kvexport.required_libraries", "[]")),
        "runtime_config": json.loads(metadata.get("kvexport.runtime_config", "{}")),
        "package_ops": dict(sorted(ops.items())),
        "aoti": {k: v for k, v in metadata.items() if k.startswith("AOTI_")},
    }
    if manifest is not None:
        info.update({
            "dims": manifest["dims"],
            "versions": manifest["versions"],
            "tolerance": manifest["tolerance"],
            "trace_steps": len(manifest["trace"]["steps"]),
            "timings_seconds": manifest.get("timings_seconds", {}),
            "artifact_bytes": sum((target / rel).stat().st_size for rel in manifest["files"]
                                  if (target / rel).is_file()) + (target / MANIFEST).stat().st_size,
        })
    if not metadata.get("kvexport.version"):
        raise UserError(f"{package} was not built by kvexport (no kvexport metadata); see {PACKAGE}")
    return info
