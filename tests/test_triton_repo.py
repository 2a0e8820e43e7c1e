"""`kvexport triton-repo`: a Triton model repository, served by a plain `tritonserver
--model-repository REPO` started as a user would (free ports, 127.0.0.1). Outputs are compared with
the trace's recorded expectations and the eager model, never with the server's own."""

from __future__ import annotations

import subprocess
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
from click.testing import CliRunner

from kvexport.cli import main
from tests.test_serve import Client, free_ports, needs_pytriton, split_batch, user_arrays

START_TIMEOUT_S = 90


def write_repo(artifact, repo, *extra):
    result = CliRunner().invoke(main, ["triton-repo", str(artifact), "-o", str(repo), *extra])
    assert result.exit_code == 0, result.output
    return result


def test_the_repository_is_a_triton_model_config_and_the_artifact(tiny_artifact, tmp_path):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    repo = tmp_path / "repo"
    write_repo(tiny_artifact, repo, "--instances", "2")
    model = repo / "hstu-tiny"
    config = text_format.Parse((model / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    assert (config.name, config.backend, config.max_batch_size) == ("hstu-tiny", "python", 4)
    ragged = {i.name for i in config.input if i.allow_ragged_batch}
    assert ragged == {"item_ids", "action_ids", "candidate_ids"}
    assert {i.name: list(i.dims) for i in config.input}["context_ids"] == [3]
    assert list(config.output[0].dims) == [-1, 3] and config.instance_group[0].count == 2
    assert config.HasField("dynamic_batching") and "python_path" not in config.parameters
    assert (model / "1" / "model.py").is_file()
    assert (model / "1" / "artifact" / "manifest.json").read_bytes() == (tiny_artifact / "manifest.json").read_bytes()


@pytest.mark.parametrize("case", ["not_empty", "bad_name", "missing_python_path"])
def test_a_repository_that_cannot_be_written_is_refused_in_one_line(tiny_artifact, tmp_path, case):
    repo = tmp_path / "repo"
    extra, message = {
        "not_empty": ([], f"{repo} exists and is not empty: give a new directory"),
        "bad_name": (["--name", "a/b"], "--name 'a/b': a Triton model name of letters, digits, '-', '_' or '.'"),
        "missing_python_path": (["--python-path", str(tmp_path / "nowhere")],
                                f"--python-path {tmp_path / 'nowhere'}: no such directory"),
    }[case]
    if case == "not_empty":
        repo.mkdir()
        (repo / "keep").write_text("x")
    before = sorted(p.name for p in tmp_path.iterdir())
    result = CliRunner().invoke(main, ["triton-repo", str(tiny_artifact), "-o", str(repo), *extra])
    assert result.exit_code == 2 and result.output.strip().splitlines() == [f"error: {message}"], result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def _ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready", timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, OSError):
        return False


@pytest.fixture(scope="module")
def served_repo(tiny_artifact, tmp_path_factory):
    """tritonserver --model-repository REPO on the tiny artifact's repository, this venv's Python."""
    from kvexport.serving import tritonserver

    work = tmp_path_factory.mktemp("triton-repo")
    repo = work / "repo"
    write_repo(tiny_artifact, repo, "--this-python")
    command, env = tritonserver.prepare(work)
    ports = free_ports()
    log = (work / "server.log").open("w")
    process = subprocess.Popen([*command, "--model-repository", str(repo), "--http-address", "127.0.0.1",
                                "--grpc-address", "127.0.0.1", "--http-port", str(ports.http),
                                "--grpc-port", str(ports.grpc), "--metrics-port", str(ports.metrics)],
                               env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + START_TIMEOUT_S
    while not _ready(ports.http):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"tritonserver did not come up:\n{(work / 'server.log').read_text()[-3000:]}")
        time.sleep(0.2)
    yield ports
    process.terminate()
    process.wait(timeout=60)
    log.close()


@needs_pytriton
@pytest.mark.slow
def test_the_trace_through_a_plain_tritonserver(served_repo, tiny_artifact):
    from kvexport.artifact import open_artifact
    from kvexport.runner import load_trace_step

    artifact = open_artifact(tiny_artifact)
    client = Client("http", served_repo, "hstu-tiny", concurrency=artifact.config.serving.max_batch_size)
    try:
        for step in artifact.trace_steps:
            if step.get("expect_error"):
                continue  # its users together exceed the cache: scored apart, checked in test_serve
            request, cached, _ = load_trace_step(tiny_artifact / step["file"], True)
            got = np.concatenate(client.infer_at_once([user_arrays(u) for u in split_batch(request)]))
            np.testing.assert_allclose(got, cached.numpy(), rtol=0, atol=artifact.tolerance["atol"],
                                       err_msg=f"step {step['file']}")
    finally:
        client.close()


@needs_pytriton
@pytest.mark.slow
def test_a_refused_request_gets_its_own_400_and_the_next_is_served(served_repo, tiny_artifact):
    """Runs after the trace (same server): the trace's first user again, its cache warm, is exact."""
    from tritonclient.utils import InferenceServerException

    from kvexport.artifact import open_artifact
    from kvexport.runner import load_trace_step

    artifact = open_artifact(tiny_artifact)
    step = artifact.trace_steps[0]
    request, cached, _ = load_trace_step(tiny_artifact / step["file"], True)
    users = split_batch(request)
    bad = user_arrays(users[0])
    bad["item_ids"] = bad["item_ids"].copy()
    bad["item_ids"][0] = -1
    client = Client("http", served_repo, "hstu-tiny")
    try:
        with pytest.raises(InferenceServerException) as refused:
            client.infer(bad)
        assert refused.value.status() == "400"
        assert "item_ids has -1, outside the item vocabulary [0, 9999]" in refused.value.message()
        assert "Traceback" not in refused.value.message()
        np.testing.assert_allclose(client.infer(user_arrays(users[0])), cached.numpy()[:len(users[0].candidate_ids)],
                                   rtol=0, atol=artifact.tolerance["atol"])
    finally:
        client.close()


@needs_pytriton
@pytest.mark.slow
def test_kvexport_metrics_on_tritons_own_metrics_port(served_repo, tiny_artifact):
    """The cache's and the requests' counters, on Triton's metrics port, after a refused request and
    a user scored twice (the second time from its cache)."""
    from tritonclient.utils import InferenceServerException

    from kvexport.artifact import open_artifact
    from kvexport.runner import load_trace_step

    step = open_artifact(tiny_artifact).trace_steps[0]
    user = split_batch(load_trace_step(tiny_artifact / step["file"], True)[0])[0]
    good = user_arrays(user)
    bad = {**good, "candidate_ids": np.array([-5], dtype=np.int64)}
    client = Client("http", served_repo, "hstu-tiny")
    try:
        client.infer(good)
        client.infer(good)
        with pytest.raises(InferenceServerException):
            client.infer(bad)
    finally:
        client.close()
    with urllib.request.urlopen(f"http://127.0.0.1:{served_repo.metrics}/metrics", timeout=10) as response:
        text = response.read().decode()
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line.startswith("kvexport_")}
    assert values['kvexport_requests_total{model="hstu-tiny",result="refused"}'] >= 1
    assert values['kvexport_requests_total{model="hstu-tiny",result="ok"}'] >= 1
    assert values['kvexport_cache_hit_tokens_total{model="hstu-tiny"}'] > 0
    assert values['kvexport_batches_total{model="hstu-tiny"}'] >= 1
    assert "# TYPE kvexport_cache_device_pages_used gauge" in text
