"""`kvexport triton-repo`: a standard Triton model repository for a built artifact.

    REPO/tritonserver               a launcher: the serve extra's tritonserver on REPO (LAUNCHER_SCRIPT)
    REPO/<name>/config.pbtxt        Python backend; the per-user signature with Triton's batch
                                    dimension; a dynamic batcher with ragged inputs (users with
                                    histories of different lengths merge), batches of up to
                                    CALLS_PER_EXECUTION package calls' worth of users; instances on
                                    the package's device; the model's parameters (below)
    REPO/<name>/1/model.py          kvexport/serving/triton_model.py
    REPO/<name>/1/artifact/         the artifact, copied (checked against its manifest first), unless
                                    the `artifact` parameter names it where it is

With several shards (--instances K on the host, or --gpus N, each GPU a shard: K x N of them) the
clients' model is the router, which holds shard 0 and sends each other user to the shard their id
hashes to (kvexport/serving/triton_router.py), so a user's requests meet their cache:
    REPO/<name>/1/model.py          kvexport/serving/triton_model.py, one instance (on GPU 0 for a
                                    CUDA package), its `shards` parameter naming the other shards
    REPO/<name>/artifact/           the artifact, copied once (a model's non-numeric folder, which
                                    Triton does not read as a version)
    REPO/<name>/route.key           the router's key, which every pack it sends a shard carries: a
                                    shard refuses any other request (clients can call any model)
    REPO/<name>_shard<i>/           i = 1..K-1: one instance (on GPU i mod N for a CUDA package) of
                                    the same model, taking the router's packs of users
                                    (shard_config), its `artifact` parameter the router's copy

The model's parameters (Triton's `parameters`, strings; triton_model.py reads them):
    artifact                the artifact's path (relative: to model.py's folder), when it is not
                            copied beside model.py
    shards                  the router's: the other shards' model names, shards 1..K-1 in order
    routed                  "true" in a shard: it takes the router's packs of users, and only them
    router                  a shard's: its router's name (named in its refusals)
    route_key               the router's key file (relative to model.py's folder), which the router's
                            packs carry and a shard requires (triton_router.ROUTE_KEY_FILE)
    drain_file              a file whose appearance asks the model to unload itself (`kvexport serve`'s
                            stop; needs Triton's explicit model control)
    python_path             site directories for the Python backend's interpreter (os.pathsep)
    threads                 intra-op CPU threads of each instance (torch.set_num_threads)
    remote, remote_write    the shared remote KV tier's URL (never with a password: Triton serves the
                            model config to any client) and its write policy
    remote_password_file    the file that holds the tier's password (a mounted secret), read when
                            the model loads

`tritonserver --model-repository REPO` serves it wherever torch and kvexport are importable by the
Python backend's interpreter (docs/hosting.md). Written into a staging directory renamed into
place: a failure leaves no partial repository.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import shlex
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from kvexport.artifact import Artifact, open_artifact
from kvexport.errors import UserError
from kvexport.options import RepositoryOptions
from kvexport.remote import DEFAULT_WRITE_POLICY, check_write_policy, split_password
from kvexport.serving.signature import LOGITS, serving_signature
from kvexport.serving.triton_router import ERRORS, PACK, ROUTE_KEY_FILE

# REPO/tritonserver: serves the repository with the serve extra's tritonserver, under the Python that
# wrote it (a regular file at the repository's top, which Triton does not read as a model).
LAUNCHER = "tritonserver"
LAUNCHER_SCRIPT = """#!/bin/sh
# Serves this model repository with the tritonserver of kvexport's serve extra, as
# `kvexport triton-repo` wrote it: its Python backend laid out, its libraries and libpython set for
# that process only. Options are tritonserver's, e.g. --http-port 8000 (docs/hosting.md, Serving).
exec {python} -m kvexport.serving.tritonserver "$(dirname "$0")" "$@"
"""
MODEL_FILE = Path(__file__).with_name("triton_model.py")
# One execution of the model (a Triton batch) takes up to this many package calls' worth of users:
# the Python-backend stub's round trip, comparable to a small package call, is then paid once for all
# of them (kvexport.serving.batcher splits the batch into package calls), which raises throughput
# under many clients.
CALLS_PER_EXECUTION = 4


def triton_batch_size(package_batch_size: int, batching: bool = True) -> int:
    """The most requests (users) Triton hands one execution of the model."""
    return package_batch_size * CALLS_PER_EXECUTION if batching else 1


@dataclasses.dataclass(frozen=True)
class Remote:
    """The shared remote KV tier a repository's model attaches after its warm-up."""

    url: str
    write: str = DEFAULT_WRITE_POLICY
    password_file: Path | None = None

    def __post_init__(self) -> None:
        check_write_policy(self.write, "--remote-write")
        if split_password(self.url)[1] is not None:
            raise UserError(
                "--remote: the URL holds a password, which Triton would serve to any client with the "
                "model's config; give it with --remote-password-file"
            )

    def parameters(self) -> dict[str, str]:
        out = {"remote": self.url, "remote_write": self.write}
        if self.password_file is not None:
            out["remote_password_file"] = str(Path(self.password_file).resolve())
        return out


def _quoted(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _tensor_config(spec: dict, is_input: bool) -> str:
    """One tensor of the serving signature (kvexport.serving.signature) as Triton declares it: the
    batch dimension (the signature's leading 1) left out, a per-user length ("h", "T") as -1. An
    input with such a length is ragged: Triton concatenates it when it batches users."""
    dims = [-1 if isinstance(d, str) else d for d in spec["shape"][1:]]
    ragged = is_input and -1 in dims
    return (
        f'  {{ name: "{spec["name"]}" data_type: TYPE_{spec["datatype"]} dims: [ {", ".join(map(str, dims))} ]'
        f"{' allow_ragged_batch: true' if ragged else ''} }}"
    )


def model_config(
    name: str,
    max_batch_size: int,
    context_width: int,
    num_tasks: int,
    device: str,
    instances: int,
    parameters: dict[str, str] | None = None,
    batching: bool = True,
    gpus: Sequence[int] = (0,),
) -> str:
    """config.pbtxt of one of the repository's models (Triton's text protobuf): max_batch_size users
    per model execution, merged by Triton's dynamic batcher; without batching, one (max_batch_size
    1, no dynamic batcher). device "cuda": `instances` on each GPU of `gpus`."""
    signature = serving_signature(name, context_width, num_tasks)
    inputs = ",\n".join(_tensor_config(spec, True) for spec in signature["inputs"])
    lines = [
        f'name: "{name}"',
        'backend: "python"',
        f"max_batch_size: {max_batch_size if batching else 1}",
        f"input [\n{inputs}\n]",
        f"output [\n{_tensor_config(signature['output'], False)}\n]",
        *(["dynamic_batching { }"] if batching else []),
        _instance_group(device, instances, gpus),
        *_parameter_lines(parameters or {}),
    ]
    return "\n".join(lines) + "\n"


def shard_names(name: str, shards: int) -> list[str]:
    """The internal shard models' names of the router `name` (which holds shard 0): shards 1..K-1."""
    return [f"{name}_shard{i}" for i in range(1, shards)]


def _parameter_lines(parameters: dict[str, str]) -> list[str]:
    return [
        f"parameters: {{ key: {_quoted(key)} value: {{ string_value: {_quoted(value)} }} }}"
        for key, value in parameters.items()
    ]


def _instance_group(device: str, instances: int, gpus: Sequence[int]) -> str:
    """`instances` model instances on the package's device: on each GPU of `gpus` for a CUDA one."""
    if device != "cuda":
        return f"instance_group [ {{ kind: KIND_CPU count: {instances} }} ]"
    return f"instance_group [ {{ kind: KIND_GPU count: {instances} gpus: [ {', '.join(map(str, gpus))} ] }} ]"


def shard_config(name: str, num_tasks: int, device: str, parameters: dict[str, str], gpu: int) -> str:
    """config.pbtxt of a shard behind the router: one instance, no batcher of its own (the router's
    waves are its batches, in order), a pack of users in, their logits and refusals out
    (kvexport.serving.triton_router)."""
    lines = [
        f'name: "{name}"',
        'backend: "python"',
        "max_batch_size: 0",
        f'input [\n  {{ name: "{PACK}" data_type: TYPE_INT64 dims: [ -1 ] }}\n]',
        f'output [\n  {{ name: "{LOGITS}" data_type: TYPE_FP32 dims: [ -1, {num_tasks} ] }},\n'
        f'  {{ name: "{ERRORS}" data_type: TYPE_UINT8 dims: [ -1 ] }}\n]',
        _instance_group(device, 1, (gpu,)),
        *_parameter_lines(parameters),
    ]
    return "\n".join(lines) + "\n"


def write_route_key(path: Path) -> None:
    """The router's key (kvexport.serving.triton_router.ROUTE_KEY_FILE): random, created readable by
    its owner only, so that only the server's own processes can prove a pack came from the router."""
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w", encoding="ascii") as file:
        file.write(secrets.token_hex(32) + "\n")


def write_repository(
    out: Path | Artifact,
    repo: Path,
    name: str | None = None,
    options: RepositoryOptions | None = None,
    python_path: Sequence[str] = (),
    remote: Remote | None = None,
    copy_artifact: bool = True,
    drain_file: Path | None = None,
) -> Path:
    """Writes the repository for the artifact OUT (a path or an opened Artifact); returns the
    directory of the model clients call (the router's, with several shards). copy_artifact=False
    names OUT (resolved) in the `artifact` parameter instead of copying it, and leaves the check of
    its files to the model's load (which checks them anyway). options (None: the defaults): threads,
    each instance's intra-op CPU threads; instances x gpus shards, each one instance with its own
    cache (gpus > 1: a CUDA package's, shard i on GPU i mod gpus), behind the router; routing=False:
    one model of `instances` instances on each GPU, Triton handing each request to whichever is free."""
    options = options or RepositoryOptions()
    instances, gpus, routing = options.instances, options.gpus, options.routing
    batching, threads = options.batching, options.threads
    artifact = out if isinstance(out, Artifact) else open_artifact(out)
    if copy_artifact:
        from kvexport.trace.verify import check_integrity  # imports torch: not when the CLI starts

        check_integrity(artifact)
    config = artifact.config
    name = name or config.name
    if not name or not all(c.isalnum() or c in "-_." for c in name):
        raise UserError(f"--name {name!r}: a Triton model name of letters, digits, '-', '_' or '.'")
    if instances < 1:
        raise UserError(f"--instances must be >= 1, got {instances}")
    if threads < 1:
        raise UserError(f"--threads must be >= 1, got {threads}")
    device = artifact.device
    if gpus < 1:
        raise UserError(f"--gpus must be >= 1, got {gpus}")
    if gpus > 1 and device != "cuda":
        raise UserError(f"--gpus {gpus}: the artifact runs on {device}; only a CUDA package spreads over GPUs")
    if repo.exists() and any(repo.iterdir()):
        raise UserError(f"{repo} exists and is not empty: give a new directory")
    for directory in python_path:
        if not Path(directory).is_dir():
            raise UserError(f"--python-path {directory}: no such directory")
    shards = instances * gpus
    if drain_file is not None and shards > 1 and routing:
        raise ValueError("drain_file is a single model's (kvexport serve): a router's shards would unload alone")
    common = {"python_path": os.pathsep.join(str(p) for p in python_path)} if python_path else {}
    parameters = {} if copy_artifact else {"artifact": str(Path(artifact.root).resolve())}
    parameters["threads"] = str(threads)
    parameters.update(common)
    if drain_file is not None:
        parameters["drain_file"] = str(drain_file)
    if remote is not None:
        parameters.update(remote.parameters())
    dims = (config.model.context_width, config.model.num_tasks)
    max_batch_size = config.serving.max_batch_size
    repo.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{repo.name}.", dir=repo.parent))
    try:
        model = staging / name
        (model / "1").mkdir(parents=True)
        if shards == 1 or not routing:
            (model / "config.pbtxt").write_text(
                model_config(
                    name, triton_batch_size(max_batch_size), *dims, device, instances, parameters, batching, range(gpus)
                )
            )
            shutil.copyfile(MODEL_FILE, model / "1" / "model.py")
            if copy_artifact:
                shutil.copytree(artifact.root, model / "1" / "artifact")
        else:
            # The public model holds shard 0 and gathers a wave (one request without batching); the
            # other shards split their packs in package calls.
            names = shard_names(name, shards)
            if copy_artifact:
                shutil.copytree(artifact.root, model / "artifact")
                parameters["artifact"] = os.path.join("..", "artifact")
            write_route_key(model / ROUTE_KEY_FILE)
            public = {**parameters, "shards": ",".join(names), "route_key": os.path.join("..", ROUTE_KEY_FILE)}
            (model / "config.pbtxt").write_text(
                model_config(
                    name,
                    triton_batch_size(max_batch_size) * shards if batching else 1,
                    *dims,
                    device,
                    1,
                    public,
                    True,
                    range(1),
                )
            )
            shutil.copyfile(MODEL_FILE, model / "1" / "model.py")
            parameters.update(
                routed="true",
                router=name,
                artifact=os.path.join("..", "..", name, "artifact") if copy_artifact else parameters["artifact"],
                route_key=os.path.join("..", "..", name, ROUTE_KEY_FILE),
            )
            for i, shard in enumerate(names, start=1):
                (staging / shard / "1").mkdir(parents=True)
                (staging / shard / "config.pbtxt").write_text(
                    shard_config(shard, config.model.num_tasks, device, parameters, gpu=i % gpus)
                )
                shutil.copyfile(MODEL_FILE, staging / shard / "1" / "model.py")
        launcher = staging / LAUNCHER
        launcher.write_text(LAUNCHER_SCRIPT.format(python=shlex.quote(sys.executable)))
        launcher.chmod(0o755)
        if repo.exists():
            repo.rmdir()
        staging.rename(repo)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return repo / name
