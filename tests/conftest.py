"""Shared fixtures. Expensive artifacts (op library, AOTI package, C++ harness) are session-scoped.
Helpers shared by test modules live in tests/helpers/; the serving and redis fixtures there are
loaded as plugins."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvexport.model import build_model
from tests.helpers.configs import TINY
from tests.helpers.configs import tiny_config as load_tiny_config

pytest_plugins = ("tests.helpers.remote", "tests.helpers.serving")


@pytest.fixture(scope="session")
def tiny_config():
    return load_tiny_config()


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


@pytest.fixture(scope="session")
def cuda_artifact(tmp_path_factory, tiny_checkpoint) -> Path:
    """The tiny package built for CUDA (only tests that skip without a CUDA device ask for it)."""
    from kvexport.export.build import build_artifact

    return build_artifact(
        TINY, tmp_path_factory.mktemp("cuda") / "hstu-tiny", checkpoint=tiny_checkpoint, device="cuda"
    )


@pytest.fixture(scope="session")
def host_corpus(tiny_config, tiny_checkpoint, tmp_path_factory) -> Path:
    """Hostile requests plus valid ones with their eager full-recompute logits (no cache), for
    tests.helpers.hostile.run_plain_host."""
    from tests.helpers.hostile import write_host_corpus

    model = build_model(tiny_config, checkpoint=tiny_checkpoint)
    return write_host_corpus(tiny_config, model, tmp_path_factory.mktemp("corpus") / "corpus.pt")
