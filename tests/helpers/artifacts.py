"""Editing a built artifact as a tamperer would, and checking a GPU package end to end."""

from __future__ import annotations

import json
import subprocess
import zipfile
from pathlib import Path

from kvexport.artifact import MANIFEST, sha256_of


def edit_manifest(artifact: Path, edit) -> None:
    """Applies edit(manifest dict) and writes manifest.json back, as a hand edit would."""
    manifest = json.loads((artifact / MANIFEST).read_text())
    edit(manifest)
    (artifact / MANIFEST).write_text(json.dumps(manifest, indent=2))


def rehash(artifact: Path, rel: str) -> None:
    """Records a changed file's sha256 in the artifact's manifest, as a tamperer would."""
    edit_manifest(artifact, lambda manifest: manifest["files"].update({rel: sha256_of(artifact / rel)}))


def assert_verifies_and_replays(package: Path, tmp_path: Path) -> None:
    """A GPU package passes verify, and the C++ replay through model.pt2 and through CUDA graphs."""
    from kvexport.trace.replay import replay_command
    from kvexport.trace.verify import verify_artifact

    report = verify_artifact(package)
    assert report.passed, [s for s in report.steps if not s.passed]
    for route in ("model", "graphs"):
        result = subprocess.run(
            replay_command(package, tmp_path / f"{route}.json", route=route),
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert result.returncode == 0, result.stderr[-3000:]


def replace_shared_objects(package, data: bytes, compress: bool = False) -> None:
    """Rewrites the package with every .so member's bytes replaced by data."""
    rewritten = package.with_suffix(".tmp")
    with zipfile.ZipFile(package) as source, zipfile.ZipFile(rewritten, "w") as target:
        for member in source.infolist():
            if member.filename.endswith(".so"):
                member.compress_type = zipfile.ZIP_DEFLATED if compress else member.compress_type
                target.writestr(member, data)
            else:
                target.writestr(member, source.read(member.filename))
    rewritten.replace(package)
