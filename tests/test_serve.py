"""`kvexport serve`: the artifact's model repository under a real tritonserver (the serve extra's), on 127.0.0.1.

Every output is compared with the trace's recorded expectations or with the eager model's full
recompute (the build's checkpoint), never with the server's or the package's own output.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import kvexport
from kvexport.commands.cli import main
from kvexport.errors import RequestError
from kvexport.model.batch import UserRequest, random_user
from kvexport.serving.batcher import BatchScorer, take_batch
from kvexport.serving.triton import serve_command
from kvexport.serving.tritonserver import STUB
from tests.helpers.serving import (
    ATOL,
    REQUEST_TIMEOUT_S,
    Client,
    Ports,
    http_get,
    metric,
    needs_pytriton,
    returning_users_plan,
    run_clients,
    scrape_when,
    server_ports,
    settled_scrape,
    split_batch,
    user_arrays,
)

README_EXAMPLE = re.compile(r"<!-- example: tests/test_serve\.py[^>]*-->\n```python\n(.*?)```", re.S)
README_URL = '"127.0.0.1:8000"'
START_TIMEOUT_S = 60
STOP_TIMEOUT_S = 120


class Served:
    """A `kvexport serve` process in its own session, its output in files."""

    def __init__(self, artifact: Path, ports: Ports, logs: Path, *extra: str, verbose: bool = False):
        self.ports = ports
        self.stdout, self.stderr = logs / "serve.out", logs / "serve.err"
        with open(self.stdout, "w") as out, open(self.stderr, "w") as err:
            self.process = subprocess.Popen(
                serve_command(artifact, ports.options(), *extra, verbose=verbose),
                stdout=out,
                stderr=err,
                start_new_session=True,
            )

    def output(self) -> str:
        return f"stdout: {self.stdout.read_text()}\nstderr: {self.stderr.read_text()[-3000:]}"

    def wait_ready(self) -> None:
        """Until Triton is ready and the command has said that it serves."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"kvexport serve exited {self.process.returncode}\n{self.output()}"
            with contextlib.suppress(OSError):
                if http_get(self.ports.http, "/v2/health/ready")[0] == 200 and self.stdout.read_text().startswith(
                    "serving "
                ):
                    return
            time.sleep(0.2)
        raise AssertionError(f"kvexport serve not ready after {START_TIMEOUT_S} s\n{self.output()}")

    def terminate(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
            raise AssertionError(f"kvexport serve did not stop within {STOP_TIMEOUT_S} s\n{self.output()}") from None

    def stub(self) -> int:
        """The pid of the model's Python-backend stub (the server has one model instance)."""
        stubs = [
            int(pid)
            for pid in self.session_processes()
            if Path(os.fsdecode(Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0])).name == STUB
        ]
        assert len(stubs) == 1, f"stubs {stubs}"
        return stubs[0]

    def session_processes(self) -> list[str]:
        """Processes still running in the server's session (it is the session leader); a zombie
        has ended and only waits for its parent to collect it."""
        left = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            with contextlib.suppress(OSError):
                fields = stat.read_text().rsplit(")", 1)[1].split()
                # fields 3 and 6 of stat: the state and the session id
                if fields[0] != "Z" and int(fields[3]) == self.process.pid:
                    left.append(stat.parent.name)
        return left


def ports_free(ports: Ports) -> bool:
    for port in (ports.http, ports.grpc, ports.metrics):
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                return False
    return True


# -- fixtures --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_artifact, tmp_path_factory):
    """One server for the module (4 instances, the tiny package's max_batch_size)."""
    served = Served(tiny_artifact, server_ports(), tmp_path_factory.mktemp("serve"))
    try:
        served.wait_ready()
        yield served
    finally:
        code = served.terminate()
    assert code == 0, served.output()


# -- the batcher, in this process ------------------------------------------------------------------


def test_take_batch_keeps_each_users_order_and_distinct_users():
    queue_ = [("a", 1), ("b", 2), ("c", 1), ("d", 3), ("e", 2), ("f", 4), ("g", 5), ("h", 1)]
    batch, rest = take_batch(queue_, 3, lambda entry: entry[1])
    assert [e[0] for e in batch] == ["a", "b", "d"]
    assert [e[0] for e in rest] == ["c", "e", "f", "g", "h"]
    batch, rest = take_batch(rest, 3, lambda entry: entry[1])
    assert [e[0] for e in batch] == ["c", "e", "f"] and [e[0] for e in rest] == ["g", "h"]
    batch, rest = take_batch(rest, 3, lambda entry: entry[1])
    assert [e[0] for e in batch] == ["g", "h"] and rest == []
    assert take_batch([], 4, lambda entry: entry) == ([], [])


class _RecordingPackage:
    """A Package that records each score_users call's users and the cache hits it found."""

    def __init__(self, package):
        self.package, self.calls = package, []
        self.max_batch_size, self.config = package.max_batch_size, package.config

    def score_users(self, users):
        before = self.package.stats()["hit_tokens"]
        try:
            return self.package.score_users(users)
        finally:
            self.calls.append(([u.user_id for u in users], self.package.stats()["hit_tokens"] - before))


def _batched(user: UserRequest) -> dict[str, np.ndarray]:
    """A user's request as the inference callable receives it (each array a batch of one)."""
    return {name: array[None] for name, array in user_arrays(user).items()}


@pytest.mark.slow
def test_scorer_splits_a_triton_batch_into_distinct_users_in_arrival_order(tiny_artifact, tiny_config, eager):
    m = tiny_config.model
    generator = torch.Generator().manual_seed(11)
    first, other = (random_user(m, generator, uid, 20, 3) for uid in (900, 901))
    grown = UserRequest(
        900,
        torch.cat([first.item_ids, first.item_ids[:5]]),
        torch.cat([first.action_ids, first.action_ids[:5]]),
        first.context_ids,
        first.candidate_ids,
    )
    bad = _batched(other)
    bad["candidate_ids"] = np.array([[m.item_vocab_size]], dtype=np.int64)
    with kvexport.load(tiny_artifact) as package:
        recording = _RecordingPackage(package)
        scorer = BatchScorer(recording)
        results = scorer.score([_batched(first), bad, _batched(grown), _batched(other)])
    # The bad request is refused by the package's one check, in the first merged call; each of its
    # users is then checked alone, the bad one refused and the other scored again. User 900's second
    # request waits for its first: it runs in the next merged call.
    assert [users for users, _ in recording.calls] == [[900, 901], [900], [900, 901]]
    tokens = m.num_contextual_features + 2 * len(first.item_ids)
    assert recording.calls[2][1] == tokens  # the second request of user 900 reused all of the first's tokens
    assert isinstance(results[1], RequestError)
    assert (
        str(results[1])
        == f"candidate_ids has {m.item_vocab_size}, outside the item vocabulary [0, {m.item_vocab_size - 1}]"
    )
    for got, want in zip([results[0], results[2], results[3]], eager([first, grown, other])):
        np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=ATOL)
    counters = scorer.counters()
    assert (
        counters.batches,
        counters.batch_users,
        counters.requests_ok,
        counters.requests_refused,
        counters.split_batches,
    ) == (2, 3, 3, 1, 0)


@pytest.mark.slow
def test_scorer_scores_a_triton_batch_of_several_package_calls_in_order(tiny_artifact, tiny_config, eager):
    """Triton hands the model up to four package calls' worth of users at once: they are scored in
    calls of at most the package's max_batch_size, oldest first."""
    m = tiny_config.model
    generator = torch.Generator().manual_seed(13)
    users = [random_user(m, generator, 920 + i, 10 + i, 2) for i in range(2 * tiny_config.serving.max_batch_size + 2)]
    with kvexport.load(tiny_artifact) as package:
        recording = _RecordingPackage(package)
        results = BatchScorer(recording).score([_batched(u) for u in users])
    ids = [u.user_id for u in users]
    size = tiny_config.serving.max_batch_size
    assert [called for called, _ in recording.calls] == [ids[:size], ids[size : 2 * size], ids[2 * size :]]
    for got, want in zip(results, eager(users)):
        np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=ATOL)


@pytest.mark.slow
def test_scorer_splits_a_batch_the_cache_cannot_hold(tiny_artifact, tiny_config, eager):
    m = tiny_config.model
    generator = torch.Generator().manual_seed(12)
    big = [random_user(m, generator, 910 + i, m.max_history_length, 2) for i in range(3)]
    with kvexport.load(tiny_artifact) as package:
        recording = _RecordingPackage(package)
        scorer = BatchScorer(recording)
        results = scorer.score([_batched(u) for u in big])
    assert [users for users, _ in recording.calls] == [[910, 911, 912], [910], [911], [912]]
    for got, want in zip(results, eager(big)):
        np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=ATOL)
    counters = scorer.counters()
    assert (counters.split_batches, counters.batches, counters.requests_ok, counters.requests_refused) == (1, 3, 3, 0)


def test_warm_up_never_reaches_the_shared_remote_tier(tiny_artifact, tiny_config, redis_server, redis):
    """The server warms its package up with synthetic users 0..3 before it attaches the remote tier:
    with after_batch writes they would otherwise overwrite those users' shared entries."""
    from kvexport.serving.warmup import load_warm

    redis.command("FLUSHDB")
    package = load_warm(tiny_artifact, remote=redis_server.url, remote_write="after_batch")
    try:
        assert package.remote == redis_server.url
        assert redis.command("DBSIZE") == 0, "the warm-up wrote to the shared tier"
        generator = torch.Generator().manual_seed(3)
        package.score_users([random_user(tiny_config.model, generator, 7, 6, 3)])
    finally:
        package.close()  # flushes the queued writes
    keys = redis.command("KEYS", "*")
    assert keys == [f"kvexport:{package.runtime_name}:7".encode()], keys  # the real user, and only it


def test_a_request_is_one_user():
    from kvexport.config import load_config
    from kvexport.serving.batcher import parse_request
    from tests.helpers.configs import TINY

    config = load_config(TINY)
    user = _batched(random_user(config.model, torch.Generator().manual_seed(1), 5, 4, 2))
    assert parse_request(user).user_id == 5
    for name, value, message in (
        (
            "item_ids",
            np.zeros((2, 4), dtype=np.int64),
            "item_ids must have shape [1, n] (one request is one user), got [2, 4]",
        ),
        ("user_id", np.array([[5, 6]], dtype=np.int64), "user_id must hold one id, got shape [1, 2]"),
        ("context_ids", np.zeros((1, 3), dtype=np.int32), "context_ids must be INT64, got int32"),
    ):
        with pytest.raises(RequestError) as refused:
            parse_request({**user, name: value})
        assert str(refused.value) == message


# -- the CLI ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_inspect_prints_the_serving_signature(tiny_artifact):
    result = CliRunner().invoke(main, ["inspect", str(tiny_artifact)])
    assert result.exit_code == 0, result.output
    for line in (
        "serving: Triton model hstu-tiny, one user per request (kvexport serve)",
        "serving inputs: user_id          INT64    [1, 1]",
        "item_ids         INT64    [1, h]",
        "action_ids       INT64    [1, h]",
        "context_ids      INT64    [1, 3]",
        "candidate_ids    INT64    [1, T]",
        "serving output: logits           FP32     [1, T, 3]",
    ):
        assert line in result.output
    result = CliRunner().invoke(main, ["inspect", "--json", str(tiny_artifact)])
    serving = json.loads(result.output)["serving_signature"]
    assert serving["model"] == "hstu-tiny"
    assert [(i["name"], i["datatype"]) for i in serving["inputs"]] == [
        ("user_id", "INT64"),
        ("item_ids", "INT64"),
        ("action_ids", "INT64"),
        ("context_ids", "INT64"),
        ("candidate_ids", "INT64"),
    ]
    assert serving["output"] == {"name": "logits", "datatype": "FP32", "shape": [1, "T", 3]}


@needs_pytriton
def test_serve_refuses_clashing_or_busy_ports(tmp_path):
    ports = server_ports()
    base = ["serve", str(tmp_path), "--address", "127.0.0.1", "--metrics-port", str(ports.metrics)]
    for option, value, bounds in (("--http-port", "0", "in 1..65535"), ("--grpc-port", "70000", "in 1..65535")):
        result = CliRunner().invoke(main, [*base, option, value])
        assert (result.exit_code, result.output) == (2, f"error: {option} must be an integer {bounds}, got {value}\n")
    result = CliRunner().invoke(main, [*base, "--http-port", "9100", "--grpc-port", "9100"])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        f"error: the ports must differ, got --http-port 9100, --grpc-port 9100, --metrics-port {ports.metrics}"
    ]
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", ports.http))
        busy.listen()
        result = CliRunner().invoke(main, [*base, "--http-port", str(ports.http), "--grpc-port", str(ports.grpc)])
    assert result.exit_code == 2
    assert re.fullmatch(rf"error: cannot listen on 127\.0\.0\.1:{ports.http} \(--http-port\): .+\n", result.output)


def test_serve_without_the_extra_is_one_line(tmp_path):
    code = (
        "import sys; sys.modules['pytriton'] = None\n"
        "from kvexport.commands.cli import main\n"
        f"main(['serve', {str(tmp_path)!r}], prog_name='kvexport')"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=REQUEST_TIMEOUT_S)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "error: kvexport serve needs the serve extra (nvidia-pytriton's tritonserver is not installed): "
        "pip install 'kvexport[serve]'"
    ]


@needs_pytriton
def test_libpython_is_this_interpreters():
    import sysconfig

    from kvexport.serving.tritonserver import libpython

    if not sysconfig.get_config_var("Py_ENABLE_SHARED"):
        pytest.skip("this Python has no shared libpython")
    path = libpython()
    assert path.name == sysconfig.get_config_var("INSTSONAME")
    mapped = {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines() if "/" in line}
    assert str(path.resolve()) in {str(Path(p).resolve()) for p in mapped}


# -- the server ------------------------------------------------------------------------------------


@needs_pytriton
@pytest.mark.slow
def test_a_model_that_does_not_load_is_reported_at_once(tiny_artifact, monkeypatch, caplog):
    """tritonserver exits when its model fails to load: noticed at once, then one line."""
    import logging

    from kvexport.errors import UserError
    from kvexport.options import ServeOptions
    from kvexport.serving import triton, tritonserver

    own_prepare = tritonserver.prepare

    def without_stub(workdir):  # the serve extra's tritonserver, less the Python backend's stub
        command, env = own_prepare(workdir)
        (workdir / "backends" / "python" / "triton_python_backend_stub").unlink()
        return command, env

    monkeypatch.setattr(tritonserver, "prepare", without_stub)
    ports = server_ports()
    options = ServeOptions(address="127.0.0.1", http_port=ports.http, grpc_port=ports.grpc, metrics_port=ports.metrics)
    server = triton.Server(tiny_artifact, options)
    started = time.monotonic()
    with caplog.at_level(logging.DEBUG, logger="kvexport"), pytest.raises(UserError) as failed:
        server.start()
    assert time.monotonic() - started < 60
    assert str(failed.value).startswith(
        "Triton did not start serving hstu-tiny: "
        "failed to load 'hstu-tiny' version 1: Not found: triton_python_backend_stub"
    )
    assert "\n" not in str(failed.value)
    workspaces = re.findall(r"workspace (\S+)", caplog.text)
    assert len(workspaces) == 1
    assert not Path(workspaces[0]).exists()
    assert ports_free(ports)


@needs_pytriton
@pytest.mark.slow
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_trace_through_the_server_matches_its_expected_outputs(server, tiny_artifact, eager, protocol):
    from kvexport.artifact import open_artifact
    from kvexport.trace.record import load_trace_step
    from kvexport.trace.verify import load_reference

    artifact = open_artifact(tiny_artifact)
    atol = artifact.tolerance["atol"]
    steps = artifact.trace_steps
    client = Client(protocol, server.ports, "hstu-tiny", concurrency=artifact.config.serving.max_batch_size)
    try:
        for step in steps:
            expect_error = step.get("expect_error")
            request, cached, full = load_trace_step(tiny_artifact / step["file"], not expect_error)
            users = split_batch(request)
            got = np.concatenate(client.infer_at_once([user_arrays(u) for u in users]))  # batched by the server
            if expect_error:  # users that together exceed the cache are scored apart: each must be right
                expected = [np.concatenate(eager(users))]
            else:
                expected = [cached.numpy(), full.numpy(), load_reference(artifact, step).numpy()]
            for want in expected:
                np.testing.assert_allclose(got, want, rtol=0, atol=atol, err_msg=f"step {step['file']}")
    finally:
        client.close()
    assert any(s.get("expect_error") for s in steps)  # the capacity step went through the server too


@needs_pytriton
@pytest.mark.slow
def test_a_client_cannot_unload_the_model_or_read_the_servers_statistics(server):
    """Triton's model repository and statistics endpoints answer no client."""
    unload = urllib.request.Request(
        f"http://127.0.0.1:{server.ports.http}/v2/repository/models/hstu-tiny/unload", data=b"{}", method="POST"
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(unload, timeout=10)
    assert refused.value.code == 403
    assert http_get(server.ports.http, "/v2/models/hstu-tiny/stats")[0] == 403
    assert http_get(server.ports.http, "/v2/health/ready")[0] == 200


@needs_pytriton
@pytest.mark.slow
def test_nothing_on_a_command_line_opens_the_restricted_endpoints(server):
    """Any local user reads the command lines of the server's processes (tritonserver, the stub):
    every key=value found there, sent as a header, still gets 403 and cannot unload the model."""
    pairs = set()
    for pid in server.session_processes():
        for argument in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0"):
            for part in re.split(r"[:,]", os.fsdecode(argument)):
                key, sep, value = part.partition("=")
                if sep and re.fullmatch(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+", key):  # an HTTP header's name
                    pairs.add((key, value.strip()))
    assert ("kvexport-closed", "") in pairs  # the restricted endpoints' flags, read as a client would
    base = f"http://127.0.0.1:{server.ports.http}"
    for key, value in sorted(pairs):
        for request in (
            urllib.request.Request(
                f"{base}/v2/repository/models/hstu-tiny/unload", data=b"{}", method="POST", headers={key: value}
            ),
            urllib.request.Request(f"{base}/v2/models/hstu-tiny/stats", headers={key: value}),
        ):
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(request, timeout=10)
            assert refused.value.code == 403, (key, value, request.full_url)
    assert http_get(server.ports.http, "/v2/models/hstu-tiny/ready")[0] == 200


@needs_pytriton
@pytest.mark.slow
def test_serve_attaches_a_locked_remote_tier_and_never_serves_its_password(tiny_artifact, tiny_config, tmp_path, eager):
    """--remote with a password in the URL: the tier is attached (a scored user reaches it, with the
    password), and neither the model's config nor the workspace's repository holds the password."""
    from tests.helpers.remote import RedisServer, Resp, need_redis

    need_redis()
    password = "serve:pw@odd/%chars"
    (tmp_path / "redis").mkdir()
    redis_server = RedisServer(tmp_path / "redis", extra=("--requirepass", password)).start()
    served = None
    try:
        from urllib.parse import quote

        url = f"redis://:{quote(password, safe='')}@127.0.0.1:{redis_server.port}/0"
        served = Served(
            tiny_artifact, server_ports(), tmp_path, "--remote", url, "--remote-write", "after_batch", verbose=True
        )
        served.wait_ready()
        user = random_user(tiny_config.model, torch.Generator().manual_seed(4), 777, 6, 3)
        client = Client("http", served.ports, "hstu-tiny")
        try:
            np.testing.assert_allclose(client.infer(user_arrays(user)), eager([user])[0], rtol=0, atol=ATOL)
        finally:
            client.close()
        status, config = http_get(served.ports.http, "/v2/models/hstu-tiny/config")
        assert status == 200 and f"127.0.0.1:{redis_server.port}" in config
        assert password not in config and quote(password, safe="") not in config
        workspace = Path(re.search(r"workspace (\S+)", served.stderr.read_text()).group(1))
        pbtxt = (workspace / "repository" / "hstu-tiny" / "config.pbtxt").read_text()
        assert password not in pbtxt and quote(password, safe="") not in pbtxt
        assert password not in served.stderr.read_text()
        redis = Resp(redis_server.port)
        try:
            redis.command("AUTH", password)
            deadline = time.monotonic() + 10
            while redis.command("DBSIZE") == 0 and time.monotonic() < deadline:  # the writes are asynchronous
                time.sleep(0.05)
            assert redis.command("DBSIZE") == 1  # user 777, not the warm-up's users
        finally:
            redis.close()
        assert served.terminate() == 0, served.output()
        assert not workspace.exists()
    finally:
        if served is not None and served.process.poll() is None:
            served.terminate()
        redis_server.stop()


@needs_pytriton
@pytest.mark.slow
def test_a_tampered_artifact_is_refused_in_one_line_and_nothing_is_left(tiny_artifact, tmp_path):
    """The model's load checks every file: a changed trace file ends the command, exit 2, one line."""
    import shutil

    artifact = tmp_path / "tampered"
    shutil.copytree(tiny_artifact, artifact)
    step = artifact / "trace" / "step_0001.pt"
    data = bytearray(step.read_bytes())
    data[100] ^= 1
    step.write_bytes(bytes(data))
    ports = server_ports()
    before = set(Path(tempfile.gettempdir()).glob("kvexport-serve-*"))
    result = subprocess.run(
        serve_command(artifact, ports.options()),
        capture_output=True,
        text=True,
        timeout=START_TIMEOUT_S,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        "error: Triton did not start serving hstu-tiny: failed to load 'hstu-tiny' version 1: Internal: "
        "VerificationError: trace/step_0001.pt does not match its sha256 in the manifest (modified or corrupted)"
    ]
    assert set(Path(tempfile.gettempdir()).glob("kvexport-serve-*")) == before
    assert ports_free(ports)


@needs_pytriton
@pytest.mark.slow
def test_readme_serving_example_runs(server, eager):
    from tests.helpers import ROOT

    blocks = README_EXAMPLE.findall((ROOT / "docs" / "serving.md").read_text())
    assert len(blocks) == 1, "docs/serving.md has no (or several) serving example blocks"
    assert blocks[0].count(README_URL) == 1, f"the example must connect to {README_URL}"
    namespace: dict = {"__name__": "readme_serving_example"}
    code = blocks[0].replace(README_URL, f'"127.0.0.1:{server.ports.http}"')
    exec(compile(code, "docs/serving.md", "exec"), namespace)
    user = namespace["user"]
    request = UserRequest(
        user["user_id"][0], *(torch.tensor(user[k]) for k in ("item_ids", "action_ids", "context_ids", "candidate_ids"))
    )
    np.testing.assert_allclose(namespace["logits"], eager([request])[0], rtol=0, atol=ATOL)
    namespace["client"].close()


@needs_pytriton
@pytest.mark.slow
def test_a_dead_tritonserver_ends_the_command_and_nothing_is_left(tiny_artifact, tmp_path):
    served = Served(tiny_artifact, server_ports(), tmp_path)
    try:
        served.wait_ready()
        tritonserver = [
            pid
            for pid in served.session_processes()
            if Path(os.fsdecode(Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0])).name == "tritonserver"
        ]
        assert len(tritonserver) == 1
        os.kill(int(tritonserver[0]), signal.SIGKILL)  # its stubs are orphaned
        code = served.process.wait(timeout=STOP_TIMEOUT_S)
    finally:
        if served.process.poll() is None:
            served.terminate()
    assert code == 2, served.output()
    assert served.stderr.read_text().splitlines()[-1] == "error: tritonserver exited while serving hstu-tiny"
    assert served.session_processes() == [], "the stubs outlived the command"
    assert ports_free(served.ports)


@needs_pytriton
@pytest.mark.slow
def test_concurrent_clients_with_returning_users_are_batched_and_correct(server, tiny_config, eager):
    plans = returning_users_plan(tiny_config, clients=16, per_client=50, users=24, seed=5)
    expected = eager([r for plan in plans for r in plan])
    before = settled_scrape(server.ports.metrics)
    got = run_clients(server.ports, plans)
    assert len(got) == len(expected) == 800
    worst = max(float(np.abs(g - w).max()) for g, w in zip(got, expected))
    assert worst <= ATOL

    def delta(name: str, after: str, **labels: str) -> float:
        return metric(after, name, model="hstu-tiny", **labels) - metric(before, name, model="hstu-tiny", **labels)

    after = scrape_when(server.ports.metrics, lambda text: delta("kvexport_requests_total", text, result="ok") >= 800)

    assert delta("kvexport_requests_total", after, result="ok") == 800
    assert delta("kvexport_batch_users_total", after) == 800
    mean_batch = delta("kvexport_batch_users_total", after) / delta("kvexport_batches_total", after)
    assert mean_batch > 1, f"no batching: mean batch size {mean_batch}"
    # Triton's statistics: its model executions (batches) took more than one request each.
    executions = metric(after, "nv_inference_exec_count", model="hstu-tiny", version="1") - metric(
        before, "nv_inference_exec_count", model="hstu-tiny", version="1"
    )
    assert 800 / executions > 1, f"Triton's mean batch size {800 / executions}"
    assert delta("kvexport_cache_hit_tokens_total", after) > 0  # returning users came from the cache
    assert delta("kvexport_cache_prefix_truncations_total", after) > 0  # rewritten histories were recomputed
    # Triton's own metrics are in the same scrape.
    assert metric(after, "nv_inference_request_success", model="hstu-tiny", version="1") >= 800


def _hostile_requests(config) -> list[tuple[dict[str, np.ndarray], dict[str, str] | None, str, bool]]:
    """(arrays, datatypes, error, exact): kvexport's refusals are exactly their one-line reason; Triton's
    own (names, datatypes, shapes) contain `error`."""
    m = config.model
    good = user_arrays(random_user(m, torch.Generator().manual_seed(3), 7000, 5, 2))
    items, contexts = f"[0, {m.item_vocab_size - 1}]", f"[0, {m.context_vocab_size - 1}]"

    def edit(**changes):
        return {**good, **changes}

    return [
        (
            edit(candidate_ids=np.array([m.item_vocab_size], dtype=np.int64)),
            None,
            f"candidate_ids has {m.item_vocab_size}, outside the item vocabulary {items}",
            True,
        ),
        (
            edit(item_ids=np.full(5, -(2**40), dtype=np.int64)),
            None,
            f"item_ids has {-(2**40)}, outside the item vocabulary {items}",
            True,
        ),
        (
            edit(action_ids=good["action_ids"][:4]),
            None,
            "item_ids has 5 events but action_ids has 4; each event is one item and one action",
            True,
        ),
        (
            edit(action_ids=np.full(5, m.action_vocab_size, dtype=np.int64)),
            None,
            f"action_ids has {m.action_vocab_size}, outside the action vocabulary [0, {m.action_vocab_size - 1}]",
            True,
        ),
        (
            edit(context_ids=np.array([-1, 0, 0], dtype=np.int64)),
            None,
            f"context_ids has -1, outside the context vocabulary {contexts}",
            True,
        ),
        (
            edit(
                item_ids=np.zeros(m.max_history_length + 1, dtype=np.int64),
                action_ids=np.zeros(m.max_history_length + 1, dtype=np.int64),
            ),
            None,
            f"item_ids has {m.max_history_length + 1} events, outside [0, {m.max_history_length}]",
            True,
        ),
        (
            edit(candidate_ids=np.zeros(m.max_num_candidates + 1, dtype=np.int64)),
            None,
            f"candidate_ids has {m.max_num_candidates + 1} candidates, outside [1, {m.max_num_candidates}]",
            True,
        ),
        (
            edit(candidate_ids=np.zeros(0, dtype=np.int64)),
            None,
            f"candidate_ids has 0 candidates, outside [1, {m.max_num_candidates}]",
            True,
        ),
        # Refused by Triton itself, from the model's signature.
        (edit(context_ids=good["context_ids"][:2]), None, "unexpected shape for input 'context_ids'", False),
        (edit(user_id=np.array([1, 2], dtype=np.int64)), None, "unexpected shape for input 'user_id'", False),
        (edit(item_ids=good["item_ids"].astype(np.int32)), {"item_ids": "INT32"}, "item_ids", False),
        ({k: v for k, v in good.items() if k != "candidate_ids"}, None, "candidate_ids", False),
    ]


@needs_pytriton
@pytest.mark.slow
def test_hostile_requests_are_refused_while_a_valid_stream_stays_correct(server, tiny_config, eager):
    """Hostile requests from two clients (HTTP and gRPC) beside a valid stream: they share Triton's
    batches, and each is answered alone, a kvexport refusal with exactly its one-line reason."""
    generator = torch.Generator().manual_seed(8)
    stream = [random_user(tiny_config.model, generator, 8000 + i % 3, 3 + 2 * i, 4) for i in range(40)]
    stream[1::8] = [random_user(tiny_config.model, generator, 8100 + i, 0, 2) for i in range(5)]  # no history yet
    expected = eager(stream)
    stream_out: list = []
    stream_errors: list[BaseException] = []
    hostile = _hostile_requests(tiny_config)
    refused: dict[str, list[tuple[str, str]]] = {"http": [], "grpc": []}
    invalid = {"http": "400", "grpc": "StatusCode.INVALID_ARGUMENT"}

    def valid() -> None:
        client = Client("grpc", server.ports, "hstu-tiny")
        try:
            for request in stream:
                stream_out.append(client.infer(user_arrays(request)))
        except BaseException as exc:  # noqa: BLE001 — reported below
            stream_errors.append(exc)
        finally:
            client.close()

    def attack(protocol: str) -> None:
        from tritonclient.utils import InferenceServerException

        client = Client(protocol, server.ports, "hstu-tiny")
        try:
            for _ in range(2):
                for arrays, datatypes, _, _ in hostile:
                    try:
                        client.infer(arrays, datatypes)
                        refused[protocol].append(("<answered>", ""))
                    except InferenceServerException as exc:
                        refused[protocol].append((exc.message(), str(exc.status())))
        finally:
            client.close()

    threads = [
        threading.Thread(target=valid),
        threading.Thread(target=attack, args=("http",)),
        threading.Thread(target=attack, args=("grpc",)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert [str(e) for e in stream_errors] == []
    for got, want in zip(stream_out, expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=ATOL)
    for protocol, answers in refused.items():
        assert len(answers) == 2 * len(hostile), protocol
        for (message, status), (_, _, error, exact) in zip(answers, hostile * 2):
            if exact:
                assert (message, status) == (error, invalid[protocol]), protocol
            else:
                assert error in message, f"{protocol}: {error!r} not in {message!r}"
    assert http_get(server.ports.http, "/v2/health/ready")[0] == 200


@needs_pytriton
@pytest.mark.slow
def test_sigterm_drains_and_start_stop_start_leaves_nothing_behind(tiny_artifact, tiny_config, eager, tmp_path):
    """SIGTERM while Triton holds accepted requests: every one is answered, then exit 0.

    Deterministic: the model's Python-backend stub is stopped (SIGSTOP) while the requests are sent,
    so none can be answered; SIGTERM is sent once Triton reports them pending, and the stub continues
    once kvexport has asked the model to drain (its drain file exists): the model unloads itself with
    every request still pending."""
    m = tiny_config.model
    generator = torch.Generator().manual_seed(9)
    requests = [random_user(m, generator, 9000 + i % 6, m.max_history_length - i, 4) for i in range(24)]
    expected = eager(requests)
    ports = server_ports()

    for run in range(2):  # the second start finds the ports, and everything else, free again
        (tmp_path / f"run{run}").mkdir()
        served = Served(tiny_artifact, ports, tmp_path / f"run{run}", verbose=True)
        client = None
        try:
            served.wait_ready()
            workspace = Path(re.search(r"workspace (\S+)", served.stderr.read_text()).group(1))
            assert workspace.is_dir()
            answers: queue.Queue = queue.Queue()
            client = Client("grpc", ports, "hstu-tiny")
            stub = served.stub()
            os.kill(stub, signal.SIGSTOP)
            try:
                for k, request in enumerate(requests):
                    client.client.async_infer(
                        "hstu-tiny",
                        client.inputs(user_arrays(request)),
                        client_timeout=REQUEST_TIMEOUT_S,
                        callback=lambda result, error, k=k, answers=answers: answers.put((k, result, error)),
                    )
                deadline = time.monotonic() + START_TIMEOUT_S
                # All but the batch handed over: four package calls' worth of users (the tiny package's 4 each).
                queued = len(requests) - 4 * tiny_config.serving.max_batch_size
                pending = 0.0
                while pending < queued and time.monotonic() < deadline:
                    pending = metric(
                        http_get(ports.metrics, "/metrics")[1],
                        "nv_inference_pending_request_count",
                        model="hstu-tiny",
                        version="1",
                    )
                    time.sleep(0.05)
                assert pending >= queued, f"Triton holds {pending} requests, not {queued}"
                assert answers.empty()
                served.process.send_signal(signal.SIGTERM)
                while not (workspace / "drain").exists() and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert answers.empty()
            finally:
                os.kill(stub, signal.SIGCONT)
            code = served.terminate()
            assert code == 0, served.output()
            assert served.stdout.read_text().splitlines()[-1] == "stopped"
            done = sorted((answers.get(timeout=REQUEST_TIMEOUT_S) for _ in requests), key=lambda answer: answer[0])
            for k, result, error in done:
                assert error is None, f"request {k} accepted before SIGTERM was not answered: {error}"
                np.testing.assert_allclose(result.as_numpy("logits")[0], expected[k], rtol=0, atol=ATOL)
        finally:
            if client is not None:
                client.close()
            if served.process.poll() is None:
                served.terminate()
        deadline = time.monotonic() + 30
        while served.session_processes() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert served.session_processes() == [], "processes of the server are still running"
        assert ports_free(ports), "a port is still bound"
        assert not workspace.exists(), f"the workspace {workspace} was left behind"
        regions = [name for name in os.listdir("/dev/shm") if name.startswith(f"kvexport{served.process.pid}-")]
        assert regions == [], "the Python backend's shared memory was left behind"


@needs_pytriton
def test_a_stop_waits_until_the_processes_it_killed_have_ended():
    """end_leftovers' wait: a killed process is done once it is a zombie (here: until this test, its
    parent, collects it); one still running is waited for no longer than the timeout."""
    from kvexport.serving.triton import _wait_until_ended

    killed = subprocess.Popen(["sleep", "60"])
    running = subprocess.Popen(["sleep", "60"])
    try:
        killed.kill()
        started = time.monotonic()
        _wait_until_ended([Path(f"/proc/{killed.pid}")], timeout_s=10)
        assert time.monotonic() - started < 5
        state = (Path(f"/proc/{killed.pid}") / "stat").read_text().rsplit(")", 1)[1].split()[0]
        assert state == "Z"
        started = time.monotonic()
        _wait_until_ended([Path(f"/proc/{running.pid}")], timeout_s=0.3)
        assert 0.3 <= time.monotonic() - started < 5 and running.poll() is None
    finally:
        running.kill()
        killed.wait()
        running.wait()


@needs_pytriton
@pytest.mark.slow
def test_a_dead_stub_ends_the_command_and_nothing_is_left(tiny_artifact, tmp_path):
    """Triton neither restarts a killed Python-backend stub nor stops reporting ready: the command
    notices, says so in one line, exits 2 and leaves no process, port or workspace behind."""
    served = Served(tiny_artifact, server_ports(), tmp_path)
    try:
        served.wait_ready()
        stub = served.stub()
        workspace = Path(os.fsdecode(Path(f"/proc/{stub}/cmdline").read_bytes().split(b"\0")[0])).parents[2]
        os.kill(stub, signal.SIGKILL)  # its program: WORKSPACE/backends/python/triton_python_backend_stub
        code = served.process.wait(timeout=STOP_TIMEOUT_S)
    finally:
        if served.process.poll() is None:
            served.terminate()
    assert code == 2, served.output()
    assert served.stderr.read_text().splitlines()[-1] == (
        f"error: the Python-backend stub running hstu-tiny (pid {stub}) died; Triton would keep reporting "
        "ready while failing every request"
    )
    assert served.session_processes() == [], "tritonserver outlived the command"
    assert ports_free(served.ports)
    assert workspace.name.startswith("kvexport-serve-") and not workspace.exists()


@needs_pytriton
@pytest.mark.slow
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_the_routing_header_must_name_the_requests_user(server, tiny_config, eager, protocol):
    """A load balancer hashes on the kvexport-user-id header (no body parsing): the server checks
    it against the body's user_id, a match is scored, a mismatch refused alone (400)."""
    from tritonclient.utils import InferenceServerException

    user = random_user(tiny_config.model, torch.Generator().manual_seed(21), 8100, 12, 3)
    before = settled_scrape(server.ports.metrics)
    client = Client(protocol, server.ports, "hstu-tiny")
    try:
        inputs = client.inputs(user_arrays(user))
        got = client.client.infer("hstu-tiny", inputs, headers={"kvexport-user-id": str(user.user_id)})
        np.testing.assert_allclose(got.as_numpy("logits")[0], eager([user])[0], rtol=0, atol=ATOL)
        with pytest.raises(InferenceServerException) as refused:
            client.client.infer("hstu-tiny", inputs, headers={"kvexport-user-id": "8101"})
    finally:
        client.close()
    assert refused.value.status() in ("400", "StatusCode.INVALID_ARGUMENT")
    assert refused.value.message().endswith("the kvexport-user-id header says '8101', the request's user_id is 8100")

    def refused_since(text: str) -> float:  # counted with the scorer's own refusals
        return metric(text, "kvexport_requests_total", model="hstu-tiny", result="refused") - metric(
            before, "kvexport_requests_total", model="hstu-tiny", result="refused"
        )

    assert refused_since(scrape_when(server.ports.metrics, lambda text: refused_since(text) >= 1)) == 1
