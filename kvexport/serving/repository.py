"""`kvexport triton-repo`: a standard Triton model repository for a built artifact.

    REPO/<name>/config.pbtxt        Python backend; the per-user signature with Triton's batch
                                    dimension; a dynamic batcher with ragged inputs (users with
                                    histories of different lengths merge); instances on the
                                    package's device
    REPO/<name>/1/model.py          kvexport/serving/triton_model.py
    REPO/<name>/1/artifact/         the artifact, copied (checked against its manifest first)

`tritonserver --model-repository REPO` serves it wherever torch and kvexport are importable by the
Python backend's interpreter (docs/hosting.md). Written into a staging directory renamed into
place: a failure leaves no partial repository.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Sequence

from kvexport.artifact import open_artifact
from kvexport.trace.verify import check_integrity
from kvexport.errors import UserError
from kvexport.serving.signature import CANDIDATE_IDS, CONTEXT_IDS, INPUT_NAMES, ITEM_IDS, LOGITS, USER_ID

MODEL_FILE = Path(__file__).with_name("triton_model.py")
# The inputs whose length differs between users: Triton concatenates them when it batches.
RAGGED = (ITEM_IDS, "action_ids", CANDIDATE_IDS)


def model_config(name: str, max_batch_size: int, num_contextual_features: int, num_tasks: int, device: str,
                 instances: int, python_path: Sequence[str] = (), batching: bool = True) -> str:
    """config.pbtxt of the repository's model (Triton's text protobuf); without batching, one user
    per model execution (max_batch_size 1, no dynamic batcher)."""
    dims = {USER_ID: "[ 1 ]", CONTEXT_IDS: f"[ {num_contextual_features} ]"}
    inputs = ",\n".join(
        f'  {{ name: "{n}" data_type: TYPE_INT64 dims: {dims.get(n, "[ -1 ]")}'
        f'{" allow_ragged_batch: true" if n in RAGGED else ""} }}' for n in INPUT_NAMES)
    kind = "KIND_GPU" if device == "cuda" else "KIND_CPU"
    lines = [
        f'name: "{name}"',
        'backend: "python"',
        f"max_batch_size: {max_batch_size if batching else 1}",
        f"input [\n{inputs}\n]",
        f'output [\n  {{ name: "{LOGITS}" data_type: TYPE_FP32 dims: [ -1, {num_tasks} ] }}\n]',
        *(["dynamic_batching { }"] if batching else []),
        f"instance_group [ {{ kind: {kind} count: {instances} }} ]",
    ]
    if python_path:
        value = os.pathsep.join(str(p) for p in python_path)
        lines.append(f'parameters: {{ key: "python_path" value: {{ string_value: "{value}" }} }}')
    return "\n".join(lines) + "\n"


def write_repository(out: Path, repo: Path, name: str | None = None, instances: int = 1,
                     python_path: Sequence[str] = (), batching: bool = True) -> Path:
    """Writes the repository for the artifact OUT; returns the model's directory."""
    artifact = open_artifact(out)
    check_integrity(artifact)
    config = artifact.config
    name = name or config.name
    if not name or not all(c.isalnum() or c in "-_." for c in name):
        raise UserError(f"--name {name!r}: a Triton model name of letters, digits, '-', '_' or '.'")
    if instances < 1:
        raise UserError(f"--instances must be >= 1, got {instances}")
    if repo.exists() and any(repo.iterdir()):
        raise UserError(f"{repo} exists and is not empty: give a new directory")
    for directory in python_path:
        if not Path(directory).is_dir():
            raise UserError(f"--python-path {directory}: no such directory")
    repo.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{repo.name}.", dir=repo.parent))
    try:
        model = staging / name
        (model / "1").mkdir(parents=True)
        device = artifact.manifest.get("device", config.serving.device)
        (model / "config.pbtxt").write_text(model_config(
            name, config.serving.max_batch_size, config.model.num_contextual_features, config.model.num_tasks,
            device, instances, python_path, batching))
        shutil.copyfile(MODEL_FILE, model / "1" / "model.py")
        shutil.copytree(artifact.root, model / "1" / "artifact")
        if repo.exists():
            repo.rmdir()
        staging.rename(repo)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return repo / name
