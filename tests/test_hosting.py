"""The example hosts of docs/hosting.md on the shared tiny package, in their own processes.

docs/examples/host.py (torch only) and docs/examples/host.cpp (libtorch only, built here with
docs/examples/CMakeLists.txt), each built and run by the commands of docs/hosting.md's blocks as
written, score the first request of the artifact's trace, then a bad request, read the runtime's
last_error, and score the first request again. Each prints one line per stage:

    good shape [N, T] max_abs_err E
    bad refused | bad accepted
    last_error CODE: MESSAGE
    again shape [N, T] max_abs_err E
"""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvexport.artifact import MANIFEST
from kvexport.trace.replay import library_flags
from tests.helpers import ROOT

pytestmark = pytest.mark.slow

EXAMPLES = ROOT / "docs" / "examples"
HOSTS = ("python", "cpp")
SCORE_LINE = re.compile(r"^(good|again) shape \[(\d+), (\d+)\] max_abs_err (\S+)$")
DOC_BLOCK = re.compile(r"<!-- example: tests/test_hosting\.py[^>]*-->\n```sh\n(.*?)```", re.S)


def doc_commands(host: str, artifact: Path, build: Path) -> list[str]:
    """The commands of docs/hosting.md's block for `host` (python, or cpp: build, then run), one a
    line, with the tiny package for artifacts/hstu-tiny and `build` for /tmp/host-build."""
    blocks = DOC_BLOCK.findall((ROOT / "docs" / "hosting.md").read_text())
    assert len(blocks) == len(HOSTS), "docs/hosting.md has no (or other) example host blocks"
    text = blocks[HOSTS.index(host)].replace("\\\n", " ")
    text = text.replace("artifacts/hstu-tiny", str(artifact)).replace("/tmp/host-build", str(build))
    return text.splitlines()


def _run(command: str, temp: Path) -> subprocess.CompletedProcess:
    """A command run by a shell from the repository, this interpreter's `python` first on PATH."""
    temp.mkdir(exist_ok=True)
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    return subprocess.run(
        ["bash", "-c", command],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PATH": path, "TMPDIR": str(temp)},
    )


@pytest.fixture(scope="session")
def host_binary(tmp_path_factory, tiny_artifact) -> Path:
    """docs/examples/host.cpp built with its CMakeLists.txt against this environment's torch, by
    the block's commands but its last."""
    if shutil.which("cmake") is None:
        pytest.skip("cmake is not installed")
    build = tmp_path_factory.mktemp("host-build")
    for command in doc_commands("cpp", tiny_artifact, build)[:-1]:
        result = _run(command, build / "tmp")
        assert result.returncode == 0, f"{command} failed:\n{result.stdout[-3000:]}{result.stderr[-3000:]}"
    return build / "host"


@pytest.fixture(scope="session")
def python_host_run(tiny_artifact, tmp_path_factory) -> subprocess.CompletedProcess:
    temp = tmp_path_factory.mktemp("python-host") / "tmp"
    (command,) = doc_commands("python", tiny_artifact, temp)
    return _run(command, temp)


@pytest.fixture(scope="session")
def cpp_host_run(host_binary, tiny_artifact, tmp_path_factory) -> subprocess.CompletedProcess:
    manifest = json.loads((tiny_artifact / MANIFEST).read_text())
    extra = library_flags(manifest["required_libraries"])[1::2]  # paths of libraries lib/ does not carry
    temp = tmp_path_factory.mktemp("cpp-host") / "tmp"
    command = doc_commands("cpp", tiny_artifact, host_binary.parent)[-1].split("#")[0]
    return _run(" ".join([command, *map(shlex.quote, extra)]), temp)


@pytest.fixture(params=HOSTS)
def host_run(request) -> subprocess.CompletedProcess:
    return request.getfixturevalue(f"{request.param}_host_run")


@pytest.fixture(scope="session")
def expected(tiny_artifact):
    """The first trace step's full-recompute logits and the manifest's tolerance."""
    manifest = json.loads((tiny_artifact / MANIFEST).read_text())
    step = torch.load(tiny_artifact / manifest["trace"]["steps"][0]["file"], weights_only=True)
    return step["expected_full"], manifest["tolerance"]


def _lines(run: subprocess.CompletedProcess) -> dict[str, str]:
    return {line.split(" ", 1)[0]: line for line in run.stdout.splitlines() if line}


def _check_score(run: subprocess.CompletedProcess, tag: str, expected) -> None:
    logits, tolerance = expected
    line = _lines(run).get(tag)
    assert line is not None, f"no '{tag}' line\nstdout:\n{run.stdout}\nstderr:\n{run.stderr[-3000:]}"
    match = SCORE_LINE.match(line)
    assert match, line
    assert [int(match[2]), int(match[3])] == list(logits.shape)
    # max |out - expected| <= atol implies |out - expected| <= atol + rtol * |expected| everywhere.
    assert float(match[4]) <= tolerance["atol"], line


def test_host_scores_a_trace_request(host_run, expected):
    _check_score(host_run, "good", expected)


def test_host_refuses_a_bad_request(host_run):
    assert _lines(host_run).get("bad") == "bad refused", host_run.stdout + host_run.stderr[-3000:]


def test_host_learns_why_from_last_error(host_run):
    line = _lines(host_run).get("last_error")
    assert line is not None, host_run.stdout + host_run.stderr[-3000:]
    code, _, message = line.removeprefix("last_error ").partition(": ")
    assert code == "invalid_request", line
    assert message.strip(), line


def test_host_serves_the_next_request(host_run, expected):
    _check_score(host_run, "again", expected)
    assert host_run.returncode == 0, host_run.stderr[-3000:]


def test_python_host_imports_only_torch():
    tree = ast.parse((EXAMPLES / "host.py").read_text())
    imported = {
        alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names
    }
    imported |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    # fbgemm_gpu only for a package that lists fbgemm_gpu_py in required_libraries.
    assert imported <= {"json", "sys", "pathlib", "torch", "fbgemm_gpu"}, imported


def test_cpp_host_links_no_python(host_binary):
    if shutil.which("readelf") is None:
        pytest.skip("readelf is not installed")
    needed = subprocess.run(["readelf", "-d", str(host_binary)], capture_output=True, text=True, check=True).stdout
    assert "libtorch.so" in needed  # kept by --no-as-needed for op libraries loaded later
    assert "libtorch_python" not in needed and "libpython" not in needed
