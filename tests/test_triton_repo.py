"""`kvexport triton-repo`: a Triton model repository, served by a plain `tritonserver
--model-repository REPO` started as a user would (free ports, 127.0.0.1). Outputs are compared with
the trace's recorded expectations and the eager model, never with the server's own."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from kvexport.commands.cli import main
from kvexport.model.batch import UserRequest
from kvexport.serving.tritonserver import WATCH_S
from tests.helpers.artifacts import edit_manifest
from tests.helpers.serving import (
    ATOL,
    START_TIMEOUT_S,
    Client,
    metric,
    needs_pytriton,
    plain_tritonserver,
    returning_users_plan,
    run_clients,
    scrape_when,
    server_ports,
    settled_scrape,
    split_batch,
    triton_ready,
    user_arrays,
    write_repo,
)


def test_the_repository_is_a_triton_model_config_and_the_artifact(tiny_artifact, tmp_path):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    repo = tmp_path / "repo"
    write_repo(tiny_artifact, repo)
    model = repo / "hstu-tiny"
    config = text_format.Parse((model / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    # Four package calls' worth of users a Triton batch: the tiny package takes 4 a call.
    assert (config.name, config.backend, config.max_batch_size) == ("hstu-tiny", "python", 16)
    ragged = {i.name for i in config.input if i.allow_ragged_batch}
    assert ragged == {"item_ids", "action_ids", "candidate_ids"}
    assert {i.name: list(i.dims) for i in config.input}["context_ids"] == [3]
    assert list(config.output[0].dims) == [-1, 3] and config.instance_group[0].count == 1
    assert config.HasField("dynamic_batching") and "python_path" not in config.parameters
    assert (model / "1" / "model.py").is_file()
    assert (model / "1" / "artifact" / "manifest.json").read_bytes() == (tiny_artifact / "manifest.json").read_bytes()


def test_without_batching_the_model_takes_one_user_per_execution(tiny_artifact, tmp_path):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    write_repo(tiny_artifact, tmp_path / "repo", "--no-batching", "--python-path", str(tmp_path))
    text = (tmp_path / "repo" / "hstu-tiny" / "config.pbtxt").read_text()
    config = text_format.Parse(text, model_config_pb2.ModelConfig())
    assert config.max_batch_size == 1 and not config.HasField("dynamic_batching")
    assert config.parameters["python_path"].string_value == str(tmp_path)


def test_the_remote_tier_and_threads_go_into_the_models_parameters_a_password_only_as_a_file(tiny_artifact, tmp_path):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    secret = tmp_path / "secret"
    write_repo(
        tiny_artifact,
        tmp_path / "repo",
        "--remote",
        "redis://cache.internal:6379/1",
        "--remote-write",
        "after_batch",
        "--remote-password-file",
        str(secret),
        "--threads",
        "3",
    )
    text = (tmp_path / "repo" / "hstu-tiny" / "config.pbtxt").read_text()
    parameters = text_format.Parse(text, model_config_pb2.ModelConfig()).parameters
    assert {key: value.string_value for key, value in parameters.items()} == {
        "remote": "redis://cache.internal:6379/1",
        "remote_write": "after_batch",
        "remote_password_file": str(secret.resolve()),
        "threads": "3",
    }


@pytest.mark.parametrize(
    "case", ["not_empty", "bad_name", "missing_python_path", "password_in_url", "password_file_alone"]
)
def test_a_repository_that_cannot_be_written_is_refused_in_one_line(tiny_artifact, tmp_path, case):
    repo = tmp_path / "repo"
    extra, message = {
        "not_empty": ([], f"{repo} exists and is not empty: give a new directory"),
        "bad_name": (["--name", "a/b"], "--name 'a/b': a Triton model name of letters, digits, '-', '_' or '.'"),
        "missing_python_path": (
            ["--python-path", str(tmp_path / "nowhere")],
            f"--python-path {tmp_path / 'nowhere'}: no such directory",
        ),
        "password_in_url": (
            ["--remote", "redis://:secret@cache:6379"],
            "--remote: the URL holds a password, which Triton would serve to any client with the "
            "model's config; give it with --remote-password-file",
        ),
        "password_file_alone": (
            ["--remote-password-file", str(tmp_path / "secret")],
            "--remote-password-file needs --remote URL",
        ),
    }[case]
    if case == "not_empty":
        repo.mkdir()
        (repo / "keep").write_text("x")
    before = sorted(p.name for p in tmp_path.iterdir())
    result = CliRunner().invoke(main, ["triton-repo", str(tiny_artifact), "-o", str(repo), *extra])
    assert result.exit_code == 2 and result.output.strip().splitlines() == [f"error: {message}"], result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def _metrics_open(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:
            return "kvexport_cache_lookups_total" in response.read().decode()
    except (urllib.error.URLError, ConnectionError, OSError):
        return False


# Appended to a repository's model.py by one test: user 4242's requests make the scorer raise.
FAILING_USER = 4242
RAISING_MODEL = f"""

_initialize = TritonPythonModel.initialize


def _initialize_with_a_failing_user(self, args):
    _initialize(self, args)
    score = self.scorer.score

    def score_or_raise(inputs):
        if any(int(one["user_id"].flat[0]) == {FAILING_USER} for one in inputs):
            raise RuntimeError("a bug for user {FAILING_USER}")
        return score(inputs)

    self.scorer.score = score_or_raise


TritonPythonModel.initialize = _initialize_with_a_failing_user
"""


@pytest.fixture(scope="module")
def served_repo(tiny_artifact, tmp_path_factory):
    with plain_tritonserver(tiny_artifact, tmp_path_factory.mktemp("triton-repo")) as server:
        yield server.ports


@needs_pytriton
@pytest.mark.slow
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_the_trace_through_a_plain_tritonserver(served_repo, tiny_artifact, protocol):
    from kvexport.artifact import open_artifact
    from kvexport.trace.record import load_trace_step

    artifact = open_artifact(tiny_artifact)
    client = Client(protocol, served_repo, "hstu-tiny", concurrency=artifact.config.serving.max_batch_size)
    try:
        for step in artifact.trace_steps:
            if step.get("expect_error"):
                continue  # its users together exceed the cache: scored apart, checked in test_serve
            request, cached, _ = load_trace_step(tiny_artifact / step["file"], True)
            got = np.concatenate(client.infer_at_once([user_arrays(u) for u in split_batch(request)]))
            np.testing.assert_allclose(
                got, cached.numpy(), rtol=0, atol=artifact.tolerance["atol"], err_msg=f"step {step['file']}"
            )
    finally:
        client.close()


@needs_pytriton
@pytest.mark.slow
def test_a_refused_request_gets_its_own_400_and_the_next_is_served(served_repo, tiny_artifact):
    """Runs after the trace (same server): the trace's first user again, its cache warm, is exact."""
    from tritonclient.utils import InferenceServerException

    from kvexport.artifact import open_artifact
    from kvexport.trace.record import load_trace_step

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
        np.testing.assert_allclose(
            client.infer(user_arrays(users[0])),
            cached.numpy()[: len(users[0].candidate_ids)],
            rtol=0,
            atol=artifact.tolerance["atol"],
        )
    finally:
        client.close()


@needs_pytriton
@pytest.mark.slow
def test_kvexport_metrics_on_tritons_own_metrics_port(served_repo, tiny_artifact):
    """The cache's and the requests' counters, on Triton's metrics port, after a refused request and
    a user scored twice (the second time from its cache)."""
    from tritonclient.utils import InferenceServerException

    from kvexport.artifact import open_artifact
    from kvexport.trace.record import load_trace_step

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

    def refused(text: str) -> float:
        return metric(text, "kvexport_requests_total", model="hstu-tiny", result="refused")

    text = scrape_when(served_repo.metrics, lambda text: "kvexport_requests_total" in text and refused(text) >= 1)
    # Every sample names the model and the Triton model instance that published it.
    instance = {"model": "hstu-tiny", "instance": "hstu-tiny_0_0"}
    assert metric(text, "kvexport_requests_total", **instance, result="refused") >= 1
    assert metric(text, "kvexport_requests_total", **instance, result="ok") >= 1
    assert metric(text, "kvexport_cache_hit_tokens_total", **instance) > 0
    assert metric(text, "kvexport_batches_total", **instance) >= 1
    assert "# TYPE kvexport_cache_device_pages_used gauge" in text

    # Triton counts a request the model answers with its own error response as a success: its failure
    # counter does not move, so alerts read kvexport_requests_total{result="refused"} (docs/serving.md, Metrics).
    def triton_total(name: str) -> float:
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(name + "{") and 'model="hstu-tiny"' in line
        )

    assert triton_total("nv_inference_request_failure") == 0
    assert triton_total("nv_inference_request_success") >= 3


@needs_pytriton
@pytest.mark.slow
def test_concurrent_clients_with_returning_users_match_the_eager_recompute(served_repo, tiny_config, eager):
    """16 clients (HTTP and gRPC) sharing returning users: every answer equals the eager full
    recompute; Triton merged requests into batches and returning users came from the cache."""
    plans = returning_users_plan(tiny_config, clients=16, per_client=15, users=24, seed=7)
    expected = eager([r for plan in plans for r in plan])
    before = settled_scrape(served_repo.metrics)
    got = run_clients(served_repo, plans)
    assert len(got) == len(expected) == 240
    assert max(float(np.abs(g - w).max()) for g, w in zip(got, expected)) <= ATOL
    after = scrape_when(
        served_repo.metrics,
        lambda text: (
            (
                metric(text, "kvexport_requests_total", model="hstu-tiny", result="ok")
                - metric(before, "kvexport_requests_total", model="hstu-tiny", result="ok")
            )
            >= 240
        ),
    )
    executions = metric(after, "nv_inference_exec_count", model="hstu-tiny", version="1") - metric(
        before, "nv_inference_exec_count", model="hstu-tiny", version="1"
    )
    assert 240 / executions > 1, f"Triton's mean batch size {240 / executions}"
    hits = metric(after, "kvexport_cache_hit_tokens_total", model="hstu-tiny") - metric(
        before, "kvexport_cache_hit_tokens_total", model="hstu-tiny"
    )
    assert hits > 0


@needs_pytriton
@pytest.mark.slow
def test_a_request_that_makes_the_model_raise_fails_alone(tiny_artifact, tmp_path, eager):
    """Sent at once with two good users: the failing request gets an INTERNAL error (HTTP 500)
    with one line, its batch-mates their logits, and the server logs the traceback once."""
    from tritonclient.utils import InferenceServerException

    from kvexport.config import load_config
    from kvexport.model.batch import random_user
    from tests.helpers.configs import TINY

    m = load_config(TINY).model
    generator = torch.Generator().manual_seed(3)
    good = [random_user(m, generator, uid, 6, 3) for uid in (1, 2)]
    failing = random_user(m, generator, FAILING_USER, 6, 3)
    with plain_tritonserver(tiny_artifact, tmp_path, RAISING_MODEL) as (ports, server_log, _):
        import tritonclient.http as http

        client = http.InferenceServerClient(f"127.0.0.1:{ports.http}", concurrency=3)
        sender = Client("http", ports, "hstu-tiny")
        try:
            pending = [
                client.async_infer("hstu-tiny", sender.inputs(user_arrays(u))) for u in (good[0], failing, good[1])
            ]
            results = []
            for p in pending:
                try:
                    results.append(p.get_result(timeout=60).as_numpy("logits")[0])
                except InferenceServerException as exc:
                    results.append(exc)
        finally:
            sender.close()
            client.close()
        log_text = server_log.read_text()
    assert isinstance(results[1], InferenceServerException) and results[1].status() == "500"
    assert results[1].message().endswith(f"internal error: RuntimeError: a bug for user {FAILING_USER}")
    expected = eager(good)
    for got, want in zip((results[0], results[2]), expected):
        np.testing.assert_allclose(got, want, rtol=0, atol=ATOL)
    assert log_text.count(f"RuntimeError: a bug for user {FAILING_USER}") == 1
    assert log_text.count("kvexport: a request failed unexpectedly") == 1


def test_with_several_shards_the_router_holds_shard_0_and_one_instance_per_other_shard_and_the_artifact_is_copied_once(
    tiny_artifact, tmp_path
):
    repo = tmp_path / "repo"
    write_repo(tiny_artifact, repo, "--instances", "3", "--python-path", str(tmp_path))
    assert sorted(p.name for p in repo.iterdir()) == [
        "hstu-tiny",
        "hstu-tiny_shard1",
        "hstu-tiny_shard2",
        "tritonserver",
    ]
    router = (repo / "hstu-tiny" / "config.pbtxt").read_text()
    assert 'parameters: { key: "shards" value: { string_value: "hstu-tiny_shard1,hstu-tiny_shard2" } }' in router
    assert 'key: "artifact" value: { string_value: "../artifact" }' in router
    assert 'key: "route_key" value: { string_value: "../route.key" }' in router and "routed" not in router
    assert "instance_group [ { kind: KIND_CPU count: 1 } ]" in router
    assert (repo / "hstu-tiny" / "1" / "model.py").read_text().startswith('"""kvexport\'s model for Triton')
    assert (repo / "hstu-tiny" / "artifact" / "manifest.json").is_file()
    assert (repo / "hstu-tiny" / "1" / "../artifact").resolve() == (repo / "hstu-tiny" / "artifact").resolve()
    for i in (1, 2):
        shard = repo / f"hstu-tiny_shard{i}"
        config = (shard / "config.pbtxt").read_text()
        assert "instance_group [ { kind: KIND_CPU count: 1 } ]" in config
        assert 'key: "artifact" value: { string_value: "../../hstu-tiny/artifact" }' in config
        assert 'key: "routed" value: { string_value: "true" }' in config and 'key: "shards"' not in config
        assert not (shard / "1" / "artifact").exists()
        # The parameter is relative to model.py's folder, as the model reads it.
        assert (shard / "1" / "../../hstu-tiny/artifact").resolve() == (repo / "hstu-tiny" / "artifact").resolve()
        assert (shard / "1" / "../../hstu-tiny/route.key").resolve() == (repo / "hstu-tiny" / "route.key").resolve()
    # The router's key: random, its owner's only, in no config (Triton serves configs to any client).
    key = (repo / "hstu-tiny" / "route.key").read_text().strip()
    assert re.fullmatch(r"[0-9a-f]{64}", key) and (repo / "hstu-tiny" / "route.key").stat().st_mode & 0o777 == 0o600
    assert all(key not in config.read_text() for config in repo.glob("*/config.pbtxt"))
    other = tmp_path / "other"
    write_repo(tiny_artifact, other, "--instances", "2")
    assert (other / "hstu-tiny" / "route.key").read_text().strip() != key


def test_a_cuda_package_spreads_its_shards_over_the_gpus_the_routers_own_on_gpu_0(tiny_artifact, tmp_path):
    """--instances 2 --gpus 2: four shards, shard i on GPU i mod 2 (the router holds shard 0)."""
    from kvexport.options import RepositoryOptions
    from kvexport.serving.repository import write_repository

    cuda = Path(shutil.copytree(tiny_artifact, tmp_path / "cuda"))
    edit_manifest(cuda, lambda manifest: manifest.update(device="cuda"))
    repo = tmp_path / "repo"
    write_repository(cuda, repo, options=RepositoryOptions(instances=2, gpus=2), copy_artifact=False)
    names = ["hstu-tiny", "hstu-tiny_shard1", "hstu-tiny_shard2", "hstu-tiny_shard3"]
    assert sorted(p.name for p in repo.iterdir()) == [*names, "tritonserver"]
    for shard, name in enumerate(names):
        config = (repo / name / "config.pbtxt").read_text()
        assert f"instance_group [ {{ kind: KIND_GPU count: 1 gpus: [ {shard % 2} ] }} ]" in config, name


def test_without_routing_k_instances_share_one_model(tiny_artifact, tmp_path):
    repo = tmp_path / "repo"
    write_repo(tiny_artifact, repo, "--instances", "3", "--no-routing")
    assert sorted(p.name for p in repo.iterdir()) == ["hstu-tiny", "tritonserver"]
    config = (repo / "hstu-tiny" / "config.pbtxt").read_text()
    assert "instance_group [ { kind: KIND_CPU count: 3 } ]" in config and "routed" not in config
    assert (repo / "hstu-tiny" / "1" / "model.py").read_text().startswith('"""kvexport\'s model for Triton')


def test_gpus_are_refused_for_a_cpu_package_in_one_line(tiny_artifact, tmp_path):
    result = CliRunner().invoke(main, ["triton-repo", str(tiny_artifact), "-o", str(tmp_path / "repo"), "--gpus", "2"])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        "error: --gpus 2: the artifact runs on cpu; only a CUDA package spreads over GPUs"
    ]
    assert not (tmp_path / "repo").exists()


def test_shard_of_is_the_documented_hash_and_spreads_users_evenly():
    from kvexport.serving.triton_router import shard_of

    for shards in (2, 3, 4):
        for ids in (range(0, 12_000), range(0, 12_000 * 64, 64), range(-6_000, 6_000)):
            counts = np.bincount([shard_of(u, shards) for u in ids], minlength=shards)
            assert counts.size == shards and counts.min() > 0.9 * len(ids) / shards, (shards, counts)
    # The rule the docs state (splitmix64's finaliser of the id as unsigned 64 bits, modulo the
    # shards), computed here with numpy's wrapping uint64 arithmetic.
    ids = np.array([0, 5, 2**62, -1, -(2**63), 123456789], dtype=np.int64).view(np.uint64)
    with np.errstate(over="ignore"):
        z = ids + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    for shards in (1, 2, 3, 4, 7):
        assert [shard_of(int(u), shards) for u in ids.view(np.int64)] == (z % np.uint64(shards)).tolist()


def test_a_pack_of_users_unpacks_to_the_same_users_in_the_same_order(tiny_config):
    """The router packs a shard's users into the package's batch format; the shard unpacks them."""
    from kvexport.model.batch import random_user
    from kvexport.serving.triton_router import pack, unpack

    generator = torch.Generator().manual_seed(5)
    users = [
        user_arrays(random_user(tiny_config.model, generator, uid, length, candidates))
        for uid, length, candidates in ((7, 5, 2), (3, 0, 1), (7, 9, 4))
    ]  # one user twice, one empty history
    packed = pack(torch, [{name: torch.from_numpy(a).reshape(1, -1) for name, a in u.items()} for u in users])
    assert packed.dtype == torch.int64 and packed.dim() == 1
    unpacked = unpack(np, packed.numpy())
    with pytest.raises(ValueError, match="a pack of"):
        unpack(np, packed.numpy()[:-1])
    assert len(unpacked) == 3
    for got, want in zip(unpacked, users):
        assert sorted(got) == sorted(want)
        for name in want:
            np.testing.assert_array_equal(got[name].reshape(-1), want[name].reshape(-1))
            assert got[name].shape[0] == 1


@pytest.mark.parametrize(
    "header",
    [[], [0, 3], [-1, 3], [10**12, 3], [2, -4], [1, 3, 7, -1, 1, 1, 2, 3]],
    ids=["empty", "no-users", "negative-users", "huge-users", "negative-width", "negative-length"],
)
def test_a_pack_that_its_header_does_not_describe_is_refused_in_one_line(header):
    from kvexport.serving.triton_router import unpack

    with pytest.raises(ValueError) as refused:
        unpack(np, np.array(header, dtype=np.int64))
    assert len(str(refused.value).splitlines()) == 1


def test_a_pack_of_another_context_width_is_refused(tiny_config):
    from kvexport.model.batch import random_user
    from kvexport.serving.triton_router import pack, unpack

    user = user_arrays(random_user(tiny_config.model, torch.Generator().manual_seed(1), 3, 4, 2))
    packed = pack(torch, [{name: torch.from_numpy(a).reshape(1, -1) for name, a in user.items()}]).numpy()
    assert len(unpack(np, packed, tiny_config.model.context_width)) == 1
    with pytest.raises(ValueError, match="context width"):
        unpack(np, packed, tiny_config.model.context_width + 1)


def test_a_message_for_a_client_is_one_line_without_the_servers_files():
    from kvexport.serving.triton_router import client_line

    assert client_line("ValueError: bad\nTraceback (most recent call last):") == "ValueError: bad"
    assert client_line("At: /srv/repo/hstu-tiny/1/model.py(86): unpack") == "At: <server file>(86): unpack"
    assert client_line("failed at register.cpp:123 in ../csrc/ops") == "failed at <server file> in <server file>"
    assert client_line("item_ids has 10000, outside the item vocabulary [0, 9999]") == (
        "item_ids has 10000, outside the item vocabulary [0, 9999]"
    )


@needs_pytriton
@pytest.mark.slow
def test_no_shard_answers_a_client_and_the_public_model_still_answers_exactly(
    tiny_artifact, tiny_config, tmp_path, eager
):
    """Every model of a repository answers any client: a shard called directly as a client would (an
    empty pack, negative and huge user counts, a valid-looking pack of 64 users, one with a made-up
    key), over HTTP and gRPC, is refused with one line naming the tensor sent and no server file, a
    400 / INVALID_ARGUMENT; nothing reaches its cache; the public model then answers exactly."""
    from tritonclient.utils import InferenceServerException

    from kvexport.model.batch import random_user
    from kvexport.serving.triton_router import PACK, ROUTE_KEY_PARAMETER, pack

    generator = torch.Generator().manual_seed(48)
    users = [random_user(tiny_config.model, generator, uid, 5, 2) for uid in range(64)]
    valid = pack(torch, [{n: torch.from_numpy(a).reshape(1, -1) for n, a in user_arrays(u).items()} for u in users])
    crafted = {
        "empty": np.zeros(0, dtype=np.int64),
        "negative": np.array([-5, 3, 1, 2, 3], dtype=np.int64),
        "huge": np.array([10**12, 3, 1, 2, 3], dtype=np.int64),
        "64 users": valid.numpy(),
    }
    expected = "pack: this model takes packs from the model hstu-tiny only; send each user's request to hstu-tiny"
    with plain_tritonserver(tiny_artifact, tmp_path, options=("--instances", "2")) as (ports, server_log, _):
        for protocol in ("http", "grpc"):
            client = Client(protocol, ports, "hstu-tiny_shard1")
            try:
                for name, array in crafted.items():
                    for parameters in (None, {ROUTE_KEY_PARAMETER: "0" * 64}):
                        tensor = client.module.InferInput(PACK, list(array.shape), "INT64")
                        tensor.set_data_from_numpy(array)
                        with pytest.raises(InferenceServerException) as refused:
                            client.client.infer("hstu-tiny_shard1", [tensor], parameters=parameters)
                        message = refused.value.message()
                        assert message.endswith(expected), (protocol, name, message)
                        assert len(message.splitlines()) == 1 and ".py" not in message and "/" not in message
                        assert refused.value.status() in ("400", "StatusCode.INVALID_ARGUMENT"), (protocol, name)
            finally:
                client.close()
        requests = [users[0], users[1], users[0]]
        client = Client("grpc", ports, "hstu-tiny")
        try:
            got = [client.infer(user_arrays(u)) for u in requests]
        finally:
            client.close()
        scrape = settled_scrape(ports.metrics)
    assert max(float(np.abs(g - w).max()) for g, w in zip(got, eager(requests))) <= ATOL
    served = [
        metric(scrape, "kvexport_requests_total", instance=instance, result="ok")
        for instance in shard_instances("hstu-tiny", 2)
    ]
    assert sum(served) == 3
    assert "Traceback" not in server_log.read_text()


def shard_instances(model: str, shards: int) -> list[str]:
    """The Triton instance names of shards 0..K-1: the router's one instance, then each shard model's."""
    return [f"{model}_0_0", *(f"{model}_shard{i}_0_0" for i in range(1, shards))]


@needs_pytriton
@pytest.mark.slow
def test_a_sharded_repository_keeps_each_user_on_one_shard_and_matches_the_eager_recompute(
    tiny_artifact, tiny_config, tmp_path, eager
):
    """16 clients, 24 returning users, 3 shards (the router's own and two behind it): every answer equals the eager
    full recompute, each shard scored exactly the requests of the users that hash to it (its
    instance's kvexport counters), and a refusal is still the client's 400, alone."""
    from tritonclient.utils import InferenceServerException

    from kvexport.serving.triton_router import shard_of

    plans = returning_users_plan(tiny_config, clients=16, per_client=10, users=24, seed=11)
    requests = [r for plan in plans for r in plan]
    expected = eager(requests)
    with plain_tritonserver(tiny_artifact, tmp_path, options=("--instances", "3")) as (ports, _, _):
        got = run_clients(ports, plans)
        assert max(float(np.abs(g - w).max()) for g, w in zip(got, expected)) <= ATOL
        want = np.bincount([shard_of(r.user_id, 3) for r in requests], minlength=3)
        assert (want > 0).all()

        def served(text: str) -> list[float]:  # the requests each shard's one instance scored
            return [
                metric(text, "kvexport_requests_total", instance=instance, result="ok")
                for instance in shard_instances("hstu-tiny", 3)
            ]

        after = scrape_when(ports.metrics, lambda text: "kvexport_requests_total" in text and sum(served(text)) >= 160)
        assert served(after) == want.tolist()
        hostile = user_arrays(requests[0])
        hostile["item_ids"] = hostile["item_ids"].copy()
        hostile["item_ids"][-1] = tiny_config.model.item_vocab_size
        # Requests no pack can hold, from a user of each shard: refused alone with one line, whichever
        # shard the user's id hashes to (Triton's own shape check, or the router's before it packs).
        by_shard = {shard_of(r.user_id, 3): r for r in requests}
        unpackable = []
        for request in by_shard.values():
            extra_action = user_arrays(request)
            extra_action["action_ids"] = np.concatenate([extra_action["action_ids"], [1]])
            short_context = user_arrays(request)
            short_context["context_ids"] = short_context["context_ids"][:-1]
            events = len(request.item_ids)
            unpackable.append((extra_action, f"item_ids has {events} events but action_ids has {events + 1}; "))
            unpackable.append((short_context, "context_ids"))
        client = Client("http", ports, "hstu-tiny")
        try:
            with pytest.raises(InferenceServerException) as refused:
                client.infer(hostile)
            for request, message in unpackable:
                with pytest.raises(InferenceServerException) as bad:
                    client.infer(request)
                assert bad.value.status() == "400" and message in bad.value.message(), bad.value.message()
                assert len(bad.value.message().splitlines()) == 1 and ".py" not in bad.value.message()
            again = [client.infer(user_arrays(r)) for r in by_shard.values()]
        finally:
            client.close()

        def refused_total(text: str) -> float:  # Triton refuses the short contexts itself: 1 + 3 are kvexport's
            instances = shard_instances("hstu-tiny", 3)
            return sum(metric(text, "kvexport_requests_total", instance=i, result="refused") for i in instances)

        assert refused_total(scrape_when(ports.metrics, lambda text: refused_total(text) >= 4)) == 4
    assert refused.value.status() == "400"
    assert refused.value.message() == (
        f"item_ids has {tiny_config.model.item_vocab_size}, outside the item "
        f"vocabulary [0, {tiny_config.model.item_vocab_size - 1}]"
    )
    assert len(by_shard) == 3
    # The refusals touched no cache: each shard's user is scored exactly again.
    expected_again = eager(list(by_shard.values()))
    assert max(float(np.abs(g - w).max()) for g, w in zip(again, expected_again)) <= ATOL


@needs_pytriton
@pytest.mark.slow
def test_a_refusal_names_the_tensors_the_client_sent(served_repo, tiny_config):
    """Too long a history, too many candidates: the 400 names item_ids and candidate_ids (what a
    Triton client sends), not the batch format's history_lengths and num_candidates."""
    from tritonclient.utils import InferenceServerException

    from kvexport.model.batch import random_user

    m = tiny_config.model
    generator = torch.Generator().manual_seed(9)
    long_history = user_arrays(random_user(m, generator, 71, m.max_history_length + 1, 2))
    many_candidates = user_arrays(random_user(m, generator, 72, 4, m.max_num_candidates + 1))
    client = Client("http", served_repo, "hstu-tiny")
    messages = []
    try:
        for request in (long_history, many_candidates):
            with pytest.raises(InferenceServerException) as refused:
                client.infer(request)
            assert refused.value.status() == "400"
            messages.append(refused.value.message())
    finally:
        client.close()
    assert messages == [
        f"item_ids has {m.max_history_length + 1} events, outside [0, {m.max_history_length}]",
        f"candidate_ids has {m.max_num_candidates + 1} candidates, outside [1, {m.max_num_candidates}]",
    ]


def test_this_python_names_only_site_directories_that_exist(tiny_artifact, tmp_path, monkeypatch):
    """A virtual environment made from a Debian-style Python: site.getsitepackages() also names
    .../local/lib/python3.X/dist-packages, which it lacks (seen on the GPU host). --this-python names
    the ones that exist and writes the repository."""
    import site

    real = [d for d in site.getsitepackages() if Path(d).is_dir()]
    missing = tmp_path / "venv" / "local" / "lib" / "python3" / "dist-packages"
    monkeypatch.setattr(site, "getsitepackages", lambda: [str(missing), *real])
    repo = tmp_path / "repo"
    write_repo(tiny_artifact, repo, "--this-python")
    config = (repo / "hstu-tiny" / "config.pbtxt").read_text()
    assert f'key: "python_path" value: {{ string_value: "{os.pathsep.join(real)}" }}' in config


@needs_pytriton
@pytest.mark.slow
def test_a_users_requests_in_flight_together_run_in_arrival_order_on_their_shard(
    tiny_artifact, tiny_config, tmp_path, eager
):
    """Eight users, each sending six requests of a growing history without waiting for answers
    (rounds 3 ms apart, so all are in flight together), through the router to 2 shards: every
    answer equals the eager recompute, and no shard ever met a user's history shorter than what it
    had cached (a request run before an earlier one of its user would be a prefix truncation).
    The requests travel on one gRPC stream, so they reach the server in the order sent: separate
    calls may overtake each other on a busy machine before the server has them (seen once in a
    31-minute suite), and the router orders what it receives, not what clients meant to send."""
    import queue

    from kvexport.model.batch import random_user

    m = tiny_config.model
    generator = torch.Generator().manual_seed(13)
    users = [random_user(m, generator, 6000 + u, 40, 3) for u in range(8)]
    rounds = [
        [
            UserRequest(u.user_id, u.item_ids[: 10 + 5 * r], u.action_ids[: 10 + 5 * r], u.context_ids, u.candidate_ids)
            for u in users
        ]
        for r in range(6)
    ]
    expected = eager([request for requests in rounds for request in requests])

    def truncations_and_lookups(text: str) -> tuple[float, float]:
        return tuple(
            sum(metric(text, f"kvexport_cache_{name}_total", instance=i) for i in shard_instances("hstu-tiny", 2))
            for name in ("prefix_truncations", "lookups")
        )

    with plain_tritonserver(tiny_artifact, tmp_path, options=("--instances", "2")) as (ports, _, _):
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _metrics_open(ports.metrics):  # Triton opens its metrics port a moment after it is ready
            assert time.monotonic() < deadline, "the metrics port did not open"
            time.sleep(0.2)
        before = truncations_and_lookups(settled_scrape(ports.metrics))
        client = Client("grpc", ports, "hstu-tiny")
        answers: queue.Queue = queue.Queue()
        client.client.start_stream(callback=lambda result, error: answers.put((result, error)))
        try:
            for r, requests in enumerate(rounds):
                for u, request in enumerate(requests):
                    client.client.async_stream_infer(
                        "hstu-tiny", client.inputs(user_arrays(request)), request_id=str(r * 8 + u)
                    )
                time.sleep(0.003)
            done = sorted(
                (
                    (int(result.get_response().id) if error is None else -1, result, error)
                    for result, error in (answers.get(timeout=60) for _ in range(48))
                ),
                key=lambda answer: answer[0],
            )
        finally:
            client.client.stop_stream()
            client.close()
        after = scrape_when(ports.metrics, lambda text: truncations_and_lookups(text)[1] - before[1] >= 48)
    for k, result, error in done:
        assert error is None, f"request {k}: {error}"
        np.testing.assert_allclose(result.as_numpy("logits")[0], expected[k], rtol=0, atol=ATOL)
    truncations, lookups = (a - b for a, b in zip(truncations_and_lookups(after), before))
    assert (truncations, lookups) == (0, 48)


README_REPO_BLOCK = re.compile(r"```sh\n(kvexport triton-repo artifacts/hstu-tiny .*?)```", re.S)


@needs_pytriton
@pytest.mark.slow
def test_the_readme_repository_block_runs_as_written(tiny_artifact, tmp_path, eager):
    """docs/serving.md's two lines, run by a shell from a directory holding artifacts/hstu-tiny, this venv's
    bin first on PATH (an activated venv), /tmp/model-repo and the three ports swapped for private
    ones: the repository's launcher serves the trace's first user exactly, SIGTERM stops it (exit 0)
    and its backend directory is gone."""
    import glob
    import signal

    from tritonclient.utils import InferenceServerException

    from kvexport.artifact import open_artifact
    from kvexport.trace.record import load_trace_step
    from tests.helpers import ROOT

    blocks = README_REPO_BLOCK.findall((ROOT / "docs" / "serving.md").read_text())
    assert len(blocks) == 1, "docs/serving.md has no (or several) triton-repo blocks"
    lines = blocks[0].strip().splitlines()
    assert len(lines) == 2 and lines[1].startswith("/tmp/model-repo/tritonserver "), lines
    (tmp_path / "artifacts").mkdir()
    (tmp_path / "artifacts" / "hstu-tiny").symlink_to(tiny_artifact)
    ports = server_ports()
    swap = {
        "/tmp/model-repo": str(tmp_path / "model-repo"),
        "--http-port 8000": f"--http-port {ports.http}",
        "--grpc-port 8001": f"--grpc-port {ports.grpc}",
        "--metrics-port 8002": f"--metrics-port {ports.metrics}",
    }
    for old, new in swap.items():
        assert sum(line.count(old) for line in lines) >= 1, old
        lines = [line.replace(old, new) for line in lines]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    subprocess.run(["sh", "-c", lines[0]], cwd=tmp_path, env=env, check=True, capture_output=True, timeout=300)
    backends_before = set(glob.glob(os.path.join(tempfile.gettempdir(), "kvexport-tritonserver-*")))
    log = (tmp_path / "server.log").open("w")
    server = subprocess.Popen(
        ["sh", "-c", f"exec {lines[1]}"], cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT
    )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not triton_ready(ports.http):
            assert server.poll() is None and time.monotonic() < deadline, (tmp_path / "server.log").read_text()[-3000:]
            time.sleep(0.2)
        step = open_artifact(tiny_artifact).trace_steps[0]
        user = split_batch(load_trace_step(tiny_artifact / step["file"], True)[0])[0]
        client = Client("http", ports, "hstu-tiny")
        try:
            np.testing.assert_allclose(client.infer(user_arrays(user)), eager([user])[0], rtol=0, atol=ATOL)
            # The launcher forwards the routing header, so the model checks it.
            with pytest.raises(InferenceServerException) as refused:
                client.client.infer(
                    "hstu-tiny", client.inputs(user_arrays(user)), headers={"kvexport-user-id": str(user.user_id + 1)}
                )
            assert refused.value.status() == "400"
        finally:
            client.close()
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=120) == 0, (tmp_path / "server.log").read_text()[-3000:]
    finally:
        if server.poll() is None:
            server.kill()
        log.close()
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "kvexport-tritonserver-*"))) <= backends_before


@needs_pytriton
@pytest.mark.slow
def test_a_killed_stub_stops_the_repositorys_launcher_and_nothing_is_left(tiny_artifact, tmp_path):
    """Triton neither restarts a killed Python-backend stub nor stops reporting ready; the
    repository's launcher sees the stub gone with its shared memory left behind, stops tritonserver
    and exits 2 with one line: readiness no longer answers, no stub and no region remain. A model
    unloaded and loaded again through Triton's repository API (explicit model control) ends its
    stub the regular way first: the launcher keeps serving through that."""
    import signal

    repo = tmp_path / "repo"
    subprocess.run(
        [sys.executable, "-m", "kvexport", "triton-repo", str(tiny_artifact), "-o", str(repo), "--this-python"],
        check=True,
        capture_output=True,
        timeout=300,
    )
    ports = server_ports()
    server = subprocess.Popen(
        [
            str(repo / "tritonserver"),
            "--http-port",
            str(ports.http),
            "--grpc-port",
            str(ports.grpc),
            "--metrics-port",
            str(ports.metrics),
            "--model-control-mode",
            "explicit",
            "--load-model",
            "hstu-tiny",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    model = os.fsencode(repo / "hstu-tiny" / "1" / "model.py")

    def model_stubs() -> list[tuple[int, list[bytes]]]:
        found = []
        for process in Path("/proc").glob("[0-9]*"):
            with contextlib.suppress(OSError):  # gone meanwhile
                argv = process.joinpath("cmdline").read_bytes().split(b"\0")
                if argv[1:2] == [model]:
                    found.append((int(process.name), argv))
        return found

    def wait_for(condition, what: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not condition():
            assert server.poll() is None, f"the launcher exited {server.returncode} waiting for {what}"
            assert time.monotonic() < deadline, f"no {what} in {START_TIMEOUT_S} s"
            time.sleep(0.2)

    def model_ready() -> bool:
        return triton_ready(ports.http, "models/hstu-tiny/ready")

    def repository(action: str) -> None:
        request = urllib.request.Request(
            f"http://127.0.0.1:{ports.http}/v2/repository/models/hstu-tiny/{action}", data=b"", method="POST"
        )
        with urllib.request.urlopen(request, timeout=START_TIMEOUT_S) as response:
            assert response.status == 200

    try:
        wait_for(lambda: triton_ready(ports.http) and model_ready(), "ready model")
        ((first, argv),) = model_stubs()
        first_region = Path("/dev/shm") / os.fsdecode(argv[2])
        repository("unload")
        wait_for(lambda: not model_stubs() and not first_region.exists(), "end of the unloaded model's stub")
        time.sleep(3 * WATCH_S)  # looks enough for the watch to have judged the stub
        assert server.poll() is None, server.stderr.read()[-3000:]
        repository("load")
        wait_for(model_ready, "model loaded again")
        stubs = model_stubs()
        assert len(stubs) == 1 and stubs[0][0] != first, stubs
        pid, argv = stubs[0]
        region = Path("/dev/shm") / os.fsdecode(argv[2])
        assert region.exists()
        os.kill(pid, signal.SIGKILL)
        assert server.wait(timeout=60) == 2
        lines = server.stderr.read().strip().splitlines()
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    assert [line for line in lines if line.startswith("error:")] == [
        f"error: the Python-backend stub of {repo / 'hstu-tiny' / '1' / 'model.py'} (pid {pid}) died; Triton would "
        "keep reporting ready while its requests fail: stopping tritonserver"
    ]
    assert not triton_ready(ports.http)
    assert not region.exists()


def _serve_perf(*args: str) -> subprocess.CompletedProcess:
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "serve_perf.py"
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=300)


def test_perf_analyzers_input_data_is_users_in_the_request_format(tiny_artifact, tiny_config, tmp_path):
    """benchmarks/serve_perf.py --input-data: one entry a request, each tensor of the serving signature
    with its content and its shape without Triton's batch dimension; users return with longer histories."""
    done = _serve_perf(str(tiny_artifact), "--input-data", str(tmp_path / "users.json"))
    assert done.returncode == 0, done.stderr
    entries = json.loads((tmp_path / "users.json").read_text())["data"]
    assert len(entries) == 24 * 7
    for entry in entries:
        assert sorted(entry) == sorted(["user_id", "item_ids", "action_ids", "context_ids", "candidate_ids"])
        assert all(tensor["shape"] == [len(tensor["content"])] for tensor in entry.values())
        assert entry["user_id"]["shape"] == [1] and entry["context_ids"]["shape"] == [tiny_config.model.context_width]
        assert entry["item_ids"]["shape"] == entry["action_ids"]["shape"]
    first, again = entries[0], entries[24]
    assert first["user_id"] == again["user_id"]
    assert again["item_ids"]["content"][: len(first["item_ids"]["content"])] == first["item_ids"]["content"]
    assert len(again["item_ids"]["content"]) == len(first["item_ids"]["content"]) + 4


@needs_pytriton
@pytest.mark.slow
@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_perf_analyzer_drives_the_repository_without_an_error(served_repo, tiny_artifact, tmp_path, protocol):
    """Triton's perf_analyzer (make perf-analyzer), its libraries from the serve extra on its loader
    path only, sends the users of serve_perf.py's --input-data to the served repository: every
    request answered."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    try:
        import serve_perf
    finally:
        sys.path.pop(0)
    if not serve_perf.PERF_ANALYZER.is_file():
        pytest.skip("perf_analyzer is not installed (make perf-analyzer)")
    from kvexport.artifact import open_artifact

    data = serve_perf.write_input_data(open_artifact(tiny_artifact).config, tmp_path / "users.json")
    port = served_repo.grpc if protocol == "grpc" else served_repo.http
    result = serve_perf.perf_analyzer(
        serve_perf.PERF_ANALYZER, serve_perf.loader_path(tmp_path), "hstu-tiny", f"127.0.0.1:{port}", protocol, 2, data
    )
    assert "error" not in result, result
    assert result["throughput_rps"] > 0 and result["p50_ms"] > 0
