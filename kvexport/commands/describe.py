"""What `kvexport inspect` shows of a built artifact or a bare model.pt2: metadata, signatures,
dims, required libraries, package ops, sizes and versions."""

from __future__ import annotations

import json
from pathlib import Path

from kvexport.artifact import MANIFEST, PACKAGE, Manifest, open_artifact
from kvexport.errors import UserError
from kvexport.host.package_file import read_package


def _signature(metadata: dict[str, str], manifest: Manifest | None) -> dict:
    """Inputs and output with dtype, shape and device: the manifest's, or derived from the package's
    own config and device."""
    from kvexport.config import config_from_dict
    from kvexport.export.build import signature

    if manifest is not None and manifest.signature:
        return manifest.signature
    if "kvexport.config" not in metadata:
        return {}
    return signature(config_from_dict(json.loads(metadata["kvexport.config"])), metadata.get("kvexport.device", "cpu"))


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
        "signature": _signature(metadata, manifest),
        "required_libraries": json.loads(metadata.get("kvexport.required_libraries", "[]")),
        "runtime_config": json.loads(metadata.get("kvexport.runtime_config", "{}")),
        "package_ops": dict(sorted(ops.items())),
        "aoti": {k: v for k, v in metadata.items() if k.startswith("AOTI_")},
    }
    if manifest is not None:
        info.update(
            {
                "dims": manifest.dims,
                "versions": manifest.versions,
                "tolerance": manifest.tolerance,
                "trace_steps": len(manifest.trace_steps),
                "step_program": manifest.step_program,
                "timings_seconds": manifest.timings_seconds,
                "artifact_bytes": sum(
                    (target / rel).stat().st_size for rel in manifest.files if (target / rel).is_file()
                )
                + (target / MANIFEST).stat().st_size,
            }
        )
    if not metadata.get("kvexport.version"):
        raise UserError(f"{package} was not built by kvexport (no kvexport metadata); see {PACKAGE}")
    return info
