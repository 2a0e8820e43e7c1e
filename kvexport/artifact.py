"""The artifact directory written by `kvexport build`, and its manifest.

    OUT/model.pt2        AOTInductor package (metadata inside)
    OUT/step.pt2         the request's device part alone, for CUDA graphs (CUDA packages; optional)
    OUT/lib/             the op library the package calls
    OUT/trace/           recorded requests + expected outputs, step_NNNN.pt (+ step_NNNN.reference.pt)
    OUT/manifest.json    config, signature, dims, tolerances, versions, timings, sha256 of every file

The integrity rules are stated once, in kvexport/contract.json, which the C++ replay harness
compiles in: this module only follows them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.resources
import json
from pathlib import Path
from typing import Any

from kvexport.config import Config, config_from_dict
from kvexport.errors import UserError, VerificationError


def _load_contract() -> dict[str, Any]:
    """kvexport/contract.json, shipped as package data (the harness embeds the same file)."""
    return json.loads(importlib.resources.files(__package__).joinpath("contract.json").read_text())


CONTRACT = _load_contract()
TRACE_KEYS: dict[str, str] = CONTRACT["trace"]
MANIFEST = CONTRACT["manifest"]
PACKAGE = CONTRACT["package"]
FORMAT_VERSION = CONTRACT["format_version"]
TRACE_DIR = "trace"
STEP_PACKAGE = "step.pt2"
LIB_DIR = "lib"


def contract_failure(rule: str, **values: object) -> UserError:
    """The contract's failure `rule`, its message filled in: VerificationError for exit 1, else UserError."""
    failure = CONTRACT["failures"][rule]
    message = failure["message"]
    for name, value in values.items():
        message = message.replace("{" + name + "}", str(value))
    return VerificationError(message) if failure["exit"] == VerificationError.exit_code else UserError(message)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@dataclasses.dataclass(frozen=True)
class Manifest:
    """OUT/manifest.json, read once: each field hosts and tools read, typed, with what an older
    manifest lacks filled in here; `fields` keeps the whole document for the contract's
    field-by-field checks."""

    name: str
    device: str  # the device the package was built for ("cpu", "cuda")
    runtime_name: str
    config: Config
    signature: dict[str, Any]  # {"inputs": [{"name", "dtype", "shape"}, ...], "output": {...}}
    dims: dict[str, Any]
    tolerance: dict[str, float]
    versions: dict[str, Any]
    required_libraries: tuple[str, ...]
    isa: dict[str, Any]  # the instruction sets the package's machine code needs
    weights: dict[str, Any]  # where the weights came from (a seed, a checkpoint)
    step_program: dict[str, Any] | None  # step.pt2's entry, for CUDA packages
    trace_steps: list[dict[str, Any]]
    files: dict[str, str]  # sha256 by relative path
    fp8_distance: dict[str, float] | None  # FP8 pages' distance from the unrounded model
    timings_seconds: dict[str, float]
    fields: dict[str, Any]

    @classmethod
    def of(cls, fields: dict[str, Any]) -> Manifest:
        """A manifest whose shape the contract's checks passed (open_artifact)."""
        config = config_from_dict(fields["config"])
        return cls(
            name=fields.get("name") or config.name,
            device=fields.get("device") or config.serving.device,
            runtime_name=fields["runtime_name"],
            config=config,
            signature=fields.get("signature", {}),
            dims=fields["dims"],
            tolerance=fields["tolerance"],
            versions=fields.get("versions", {}),
            required_libraries=tuple(fields["required_libraries"]),
            isa=fields.get("isa", {}),
            weights=fields.get("weights", {"source": "seed", "seed": 0}),
            step_program=fields.get("step_program"),
            trace_steps=fields["trace"][TRACE_KEYS["steps"]],
            files=fields["files"],
            fp8_distance=fields.get("fp8_distance"),
            timings_seconds=fields.get("timings_seconds", {}),
            fields=fields,
        )


@dataclasses.dataclass(frozen=True)
class Artifact:
    """A built artifact directory and its manifest."""

    root: Path
    manifest: Manifest

    @property
    def config(self) -> Config:
        return self.manifest.config

    @property
    def device(self) -> str:
        """The device the package was built for."""
        return self.manifest.device

    @property
    def package(self) -> Path:
        return self.root / PACKAGE

    @property
    def step_package(self) -> Path | None:
        """The step program (docs/design.md 3.9), when the artifact has one."""
        return self.root / STEP_PACKAGE if self.manifest.step_program is not None else None

    @property
    def trace_steps(self) -> list[dict[str, Any]]:
        return self.manifest.trace_steps

    @property
    def tolerance(self) -> dict[str, float]:
        return self.manifest.tolerance

    @property
    def runtime_name(self) -> str:
        return self.manifest.runtime_name

    @property
    def required_libraries(self) -> tuple[str, ...]:
        return self.manifest.required_libraries


def open_artifact(root: str | Path) -> Artifact:
    """Reads OUT/manifest.json; an unusable directory is a UserError (exit 2)."""
    root = Path(root)
    if not root.is_dir():
        raise contract_failure("no_directory", root=root)
    path = root / MANIFEST
    if not path.is_file():
        raise contract_failure("manifest_missing", root=root)
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise contract_failure("manifest_invalid", path=path) from exc
    _check_manifest_shape(manifest, path)
    try:
        return Artifact(root, Manifest.of(manifest))
    except UserError as exc:
        raise UserError(f"{path}: {exc}") from exc


def _check_manifest_shape(manifest: Any, path: Path) -> None:
    """The contract's fields are present, with the types both checkers read them as."""
    missing = [key for key in CONTRACT["manifest_fields"] if not isinstance(manifest, dict) or key not in manifest]
    if missing:
        raise contract_failure("manifest_field_missing", path=path, field=missing[0])
    steps = manifest["trace"].get(TRACE_KEYS["steps"]) if isinstance(manifest["trace"], dict) else None
    if not isinstance(steps, list):
        raise contract_failure("trace_steps_missing", path=path)
    if not same_json(manifest["format_version"], FORMAT_VERSION):
        raise contract_failure("format_version", path=path, found=manifest["format_version"], expected=FORMAT_VERSION)
    files = manifest["files"]
    if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
        raise contract_failure("manifest_field_malformed", path=path, field="files")
    if not all(_is_step(step) for step in steps):
        raise contract_failure("manifest_field_malformed", path=path, field="trace")
    tolerance = manifest["tolerance"]
    if not isinstance(tolerance, dict) or not all(_is_number(tolerance.get(key)) for key in ("atol", "rtol")):
        raise contract_failure("manifest_field_malformed", path=path, field="tolerance")
    libraries = manifest["required_libraries"]
    if not isinstance(libraries, list) or not all(isinstance(name, str) for name in libraries):
        raise contract_failure("manifest_field_malformed", path=path, field="required_libraries")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_step(step: Any) -> bool:
    """A trace step: an object whose contract fields, where present, are strings (file, description required)."""
    required = (TRACE_KEYS["file"], TRACE_KEYS["description"])
    optional = (TRACE_KEYS["reference_file"], TRACE_KEYS["expect_error"])
    return (
        isinstance(step, dict)
        and all(isinstance(step.get(key), str) for key in required)
        and all(isinstance(step.get(key, ""), str) for key in optional)
    )


def present_files(root: Path) -> list[str]:
    """Every file under root the manifest must list: all but the manifest and the unhashed directories."""
    skipped = tuple(f"{d}/" for d in CONTRACT["unhashed_dirs"])
    names = (p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    return sorted(n for n in names if n != MANIFEST and not n.startswith(skipped))


def hash_files(root: Path) -> dict[str, str]:
    """sha256 of every file the manifest must list, by relative path."""
    return {rel: sha256_of(root / rel) for rel in present_files(root)}


def check_files(artifact: Artifact) -> int:
    """Every listed file against its sha256, then the required files, then unlisted files.

    Returns how many files were checked; raises the contract's failure (naming the file) otherwise.
    """
    expected = artifact.manifest.files
    root = artifact.root
    for rel, digest in sorted(expected.items()):
        if not (root / rel).is_file():
            raise contract_failure("listed_file_missing", root=root, file=rel)
        if sha256_of(root / rel) != digest:
            raise contract_failure("file_modified", file=rel)
    for rel in CONTRACT["required_files"]:
        if not (root / rel).is_file():
            raise contract_failure("required_file_missing", root=root, file=rel)
    unlisted = [rel for rel in present_files(root) if rel not in expected]
    if unlisted:
        raise contract_failure("file_unlisted", file=unlisted[0])
    return len(expected)


def trace_digest(steps: list[dict[str, Any]], files: dict[str, str]) -> str:
    """sha256 over one line per trace step, with the contract's columns.

    Stored in the package metadata, so an edited trace list or trace hash in manifest.json is
    caught (the C++ harness computes the same lines from the same contract).
    """

    def cell(step: dict[str, Any], column: str) -> str:
        if column.startswith("sha256:"):
            return files.get(step.get(column.removeprefix("sha256:"), ""), "")
        return step.get(column, "")

    columns = CONTRACT["trace_digest"]["columns"]
    lines = "".join("\t".join(cell(step, c) for c in columns) + "\n" for step in steps)
    return hashlib.sha256(lines.encode()).hexdigest()


def _metadata_value(metadata: dict[str, str], key: str, encoding: str) -> Any:
    """A metadata entry as the contract encodes it; absent (or unreadable JSON) reads as None."""
    if key not in metadata:
        return None
    if encoding == "string":
        return metadata[key]
    try:
        return json.loads(metadata[key])
    except json.JSONDecodeError:
        return None


def same_json(a: Any, b: Any) -> bool:
    """JSON equality as the C++ harness (nlohmann::json) has it: 1 == 1.0, but true != 1."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, dict) or isinstance(b, dict):
        return (
            isinstance(a, dict)
            and isinstance(b, dict)
            and a.keys() == b.keys()
            and all(same_json(a[k], b[k]) for k in a)
        )
    if isinstance(a, list) or isinstance(b, list):
        return isinstance(a, list) and isinstance(b, list) and len(a) == len(b) and all(map(same_json, a, b))
    return a == b


def check_manifest_against_package(artifact: Artifact, metadata: dict[str, str]) -> None:
    """manifest.json must agree with the metadata compiled into model.pt2, field by field as the
    contract pairs them; the first that differs is named (VerificationError)."""
    m = artifact.manifest.fields
    for pair in CONTRACT["package_metadata"]:
        if not same_json(m.get(pair["field"]), _metadata_value(metadata, pair["key"], pair["encoding"])):
            raise contract_failure("metadata_mismatch", field=pair["field"])
    digest = CONTRACT["trace_digest"]
    if trace_digest(artifact.trace_steps, m["files"]) != metadata.get(digest["key"]):
        raise contract_failure("metadata_mismatch", field=digest["field"])
