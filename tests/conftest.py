"""Shared fixtures. Expensive artifacts (op library, AOTI package, C++ harness) are session-scoped."""

from __future__ import annotations

import contextlib
import itertools
from pathlib import Path

import pytest

from kvexport.config import load_config
from kvexport.model import build_model

ROOT = Path(__file__).resolve().parent.parent
_runtime_names = itertools.count()


def scratch_runtime_name() -> str:
    """A runtime name no other test uses."""
    return f"test-runtime-{next(_runtime_names)}"


def host_placement():
    """begin_batch's placement for a runtime on the CPU: any host tensor."""
    import torch

    return torch.empty(0)


@contextlib.contextmanager
def scratch_runtime(config_json: str):
    """A fresh cache runtime with the given config, dropped afterwards."""
    from kvexport.ops import wrappers as kv

    name = scratch_runtime_name()
    kv.create_runtime(name, config_json)
    try:
        yield name
    finally:
        kv.drop_runtime(name)
TINY = ROOT / "configs" / "hstu-tiny.yaml"


@pytest.fixture(scope="session")
def tiny_config():
    return load_config(TINY)


@pytest.fixture(scope="session")
def tiny_model(tiny_config):
    return build_model(tiny_config, seed=0)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory, tiny_config) -> Path:
    """A checkpoint that differs from the seeded default, so a build that ignored it would show."""
    from kvexport.model.checkpoint import save_checkpoint

    path = tmp_path_factory.mktemp("checkpoint") / "tiny-seed3.pt"
    save_checkpoint(build_model(tiny_config, seed=3), path)
    return path


@pytest.fixture(scope="session")
def tiny_artifact(tmp_path_factory, tiny_checkpoint) -> Path:
    """One tiny package for the whole session (export + AOTI compile is the suite's costliest step)."""
    from kvexport.export.build import build_artifact

    out = tmp_path_factory.mktemp("artifacts") / "hstu-tiny"
    return build_artifact(TINY, out, checkpoint=tiny_checkpoint)


@pytest.fixture(scope="session")
def step_artifact(tmp_path_factory, tiny_checkpoint) -> Path:
    """The tiny package with its step program (step.pt2), built for the CPU."""
    from kvexport.export.build import build_artifact

    out = tmp_path_factory.mktemp("step") / "hstu-tiny"
    return build_artifact(TINY, out, checkpoint=tiny_checkpoint, step_program=True)


@pytest.fixture
def artifact_copy(tiny_artifact, tmp_path) -> Path:
    """A private copy of the shared artifact, for tests that damage it."""
    import shutil

    return Path(shutil.copytree(tiny_artifact, tmp_path / "hstu-tiny"))


@pytest.fixture(scope="session")
def mismatched_artifact(tmp_path_factory) -> Path:
    """A consistent artifact (hashes, digest) whose trace was recorded from other weights than
    the package's: every comparison must fail, in Python and in C++."""
    import kvexport.export.build as build
    from kvexport.trace.record import record_trace

    def record_with_other_weights(config, model, trace_dir):
        return record_trace(config, build_model(config, seed=5), trace_dir)

    out = tmp_path_factory.mktemp("mismatched") / "hstu-tiny"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(build, "record_trace", record_with_other_weights)
        # The build's self-test refuses such a package (test_build.py shows it); this one must exist.
        patch.setattr(build, "run_self_test", lambda *args: None)
        return build.build_artifact(TINY, out)


def edit_manifest(artifact: Path, edit) -> None:
    """Applies edit(manifest dict) and writes manifest.json back, as a hand edit would."""
    import json

    from kvexport.artifact import MANIFEST

    manifest = json.loads((artifact / MANIFEST).read_text())
    edit(manifest)
    (artifact / MANIFEST).write_text(json.dumps(manifest, indent=2))


def rehash(artifact: Path, rel: str) -> None:
    """Records a changed file's sha256 in the artifact's manifest, as a tamperer would."""
    from kvexport.artifact import sha256_of

    edit_manifest(artifact, lambda manifest: manifest["files"].update({rel: sha256_of(artifact / rel)}))


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """One redis-server on a free 127.0.0.1 port for the session (skips where there is none)."""
    from tests.redis_server import RedisServer, need_redis

    need_redis()
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture
def redis(redis_server):
    """A client of the session's redis-server."""
    from tests.redis_server import Resp

    client = Resp(redis_server.port)
    yield client
    client.close()


def assert_verifies_and_replays(package: Path, tmp_path: Path) -> None:
    """A GPU package passes verify, and the C++ replay through model.pt2 and through CUDA graphs."""
    import subprocess

    from kvexport.trace.replay import replay_command
    from kvexport.trace.verify import verify_artifact

    report = verify_artifact(package)
    assert report.passed, [s for s in report.steps if not s.passed]
    for route in ("model", "graphs"):
        result = subprocess.run(replay_command(package, tmp_path / f"{route}.json", route=route),
                                capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
