"""Serving tests' helpers: Triton clients, scrapes of the metrics port, plain tritonservers on a
`kvexport triton-repo` repository, concurrent client plans, and the `eager` fixture (the eager
model's full recompute every served answer is compared with)."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import queue
import re
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from kvexport.commands.cli import main
from kvexport.model import Batch, build_model
from kvexport.model.batch import UserRequest, random_user
from kvexport.options import ServeOptions
from tests.helpers.network import free_ports

ATOL = 1e-5  # served vs eager full recompute in float32: far above float32 rounding, far below a wrong result
START_TIMEOUT_S = 90
REQUEST_TIMEOUT_S = 60

needs_pytriton = pytest.mark.skipif(
    importlib.util.find_spec("pytriton") is None, reason="nvidia-pytriton is not installed (pip install -e '.[serve]')"
)


@dataclasses.dataclass
class Ports:
    """A Triton server's ports."""

    http: int
    grpc: int
    metrics: int

    def options(self) -> ServeOptions:
        """`kvexport serve`'s options on loopback at these ports."""
        return ServeOptions(address="127.0.0.1", http_port=self.http, grpc_port=self.grpc, metrics_port=self.metrics)


def server_ports() -> Ports:
    """Three distinct free ports for a server's HTTP, gRPC and metrics endpoints."""
    return Ports(*free_ports(3))


def user_arrays(user: UserRequest) -> dict[str, np.ndarray]:
    return {
        "user_id": np.array([user.user_id], dtype=np.int64),
        "item_ids": user.item_ids.numpy(),
        "action_ids": user.action_ids.numpy(),
        "context_ids": user.context_ids.numpy(),
        "candidate_ids": user.candidate_ids.numpy(),
    }


def split_batch(batch: dict[str, torch.Tensor]) -> list[UserRequest]:
    """A recorded batch (the package's seven tensors) as one request per user."""
    return Batch(**batch).users()


class Client:
    """tritonclient over HTTP or gRPC, sending one user per request (used by the thread that made it)."""

    def __init__(self, protocol: str, ports: Ports, model: str, concurrency: int = 1):
        if protocol == "http":
            import tritonclient.http as module

            self.client = module.InferenceServerClient(
                f"127.0.0.1:{ports.http}",
                concurrency=concurrency,
                network_timeout=REQUEST_TIMEOUT_S,
                connection_timeout=REQUEST_TIMEOUT_S,
            )
        else:
            import tritonclient.grpc as module

            self.client = module.InferenceServerClient(f"127.0.0.1:{ports.grpc}")
        self.module, self.protocol, self.model = module, protocol, model

    def inputs(self, arrays: dict[str, np.ndarray], datatypes: dict[str, str] | None = None):
        """Each array sent as a batch of one (Triton's batch dimension first)."""
        inputs = []
        for name, array in arrays.items():
            datatype = (datatypes or {}).get(name, "INT64")
            tensor = self.module.InferInput(name, [1, *array.shape], datatype)
            tensor.set_data_from_numpy(array[None])
            inputs.append(tensor)
        return inputs

    def infer(self, arrays: dict[str, np.ndarray], datatypes: dict[str, str] | None = None) -> np.ndarray:
        """The user's logits [T, num_tasks] (the response is a batch of one)."""
        kwargs = {"client_timeout": REQUEST_TIMEOUT_S} if self.protocol == "grpc" else {}
        logits = self.client.infer(self.model, self.inputs(arrays, datatypes), **kwargs).as_numpy("logits")
        assert logits.shape[0] == 1, logits.shape
        return logits[0]

    def infer_at_once(self, requests: list[dict[str, np.ndarray]]) -> list[np.ndarray]:
        """Sends every request before waiting for any answer."""
        if self.protocol == "http":
            pending = [self.client.async_infer(self.model, self.inputs(arrays)) for arrays in requests]
            return [p.get_result(timeout=REQUEST_TIMEOUT_S).as_numpy("logits")[0] for p in pending]
        answers: list[queue.Queue] = [queue.Queue() for _ in requests]
        for arrays, answer in zip(requests, answers):
            self.client.async_infer(
                self.model,
                self.inputs(arrays),
                client_timeout=REQUEST_TIMEOUT_S,
                callback=lambda result, error, a=answer: a.put((result, error)),
            )
        results = [answer.get(timeout=REQUEST_TIMEOUT_S) for answer in answers]
        for _, error in results:
            if error is not None:
                raise error
        return [result.as_numpy("logits")[0] for result, _ in results]

    def close(self) -> None:
        self.client.close()


def http_get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def metric(text: str, name: str, **labels: str) -> float:
    """One sample of a Prometheus text scrape."""
    wanted = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        match = re.fullmatch(rf"{re.escape(name)}\{{([^}}]*)\}} (\S+)", line)
        if match and all(part in match.group(1).split(",") for part in wanted.split(",") if part):
            return float(match.group(2))
    raise AssertionError(f"no sample {name}{{{wanted}}} in the scrape")


def scrape_when(port: int, ready: Callable[[str], bool], timeout_s: float = 10.0) -> str:
    """The metrics port's scrape once ready(scrape) holds: the model publishes its counters from a
    thread, a moment after each batch (failing when they do not arrive within timeout_s)."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = http_get(port, "/metrics")[1]
        if ready(text) or time.monotonic() > deadline:
            assert ready(text), f"the metrics did not arrive within {timeout_s} s"
            return text
        time.sleep(0.05)


def settled_scrape(port: int, timeout_s: float = 10.0) -> str:
    """A scrape once kvexport's counters have stopped moving (earlier batches all published)."""

    def counters(text: str) -> list[str]:
        return [line for line in text.splitlines() if line.startswith("kvexport_")]

    deadline = time.monotonic() + timeout_s
    previous = http_get(port, "/metrics")[1]
    while True:
        time.sleep(0.2)
        text = http_get(port, "/metrics")[1]
        if counters(text) == counters(previous) or time.monotonic() > deadline:
            return text
        previous = text


def returning_users_plan(config, clients: int, per_client: int, users: int, seed: int):
    """Each client's requests: users shared by all clients, histories growing, about 10% rewritten."""
    m = config.model
    generator = torch.Generator().manual_seed(seed)
    longest = 96
    base = {uid: random_user(m, generator, uid, longest, 1) for uid in range(5000, 5000 + users)}
    plans = []
    for _ in range(clients):
        seen: dict[int, int] = {}
        plan = []
        for _ in range(per_client):
            uid = 5000 + int(torch.randint(users, (1,), generator=generator))
            seen[uid] = seen.get(uid, 0) + 1
            events = min(longest, 4 * seen[uid] + int(torch.randint(8, (1,), generator=generator)))
            items, actions = base[uid].item_ids[:events].clone(), base[uid].action_ids[:events].clone()
            if events > 2 and torch.rand((), generator=generator) < 0.1:  # a rewritten history
                at = int(torch.randint(events - 1, (1,), generator=generator))
                items[at] = (items[at] + 1) % m.item_vocab_size
            candidates = torch.randint(
                m.item_vocab_size, (1 + int(torch.randint(8, (1,), generator=generator)),), generator=generator
            )
            plan.append(UserRequest(uid, items, actions, base[uid].context_ids, candidates))
        plans.append(plan)
    return plans


def run_clients(ports: Ports, plans: list[list[UserRequest]]) -> list[np.ndarray]:
    """One client thread per plan (odd ones over HTTP, even ones over gRPC), each sending its
    requests one at a time; every answer, plan after plan. Fails on any client's error."""
    outputs: list[list] = [[] for _ in plans]
    errors: list[BaseException] = []

    def run(index: int) -> None:
        client = Client("http" if index % 2 else "grpc", ports, "hstu-tiny")
        try:
            for request in plans[index]:
                outputs[index].append(client.infer(user_arrays(request)))
        except BaseException as exc:  # noqa: BLE001 — reported below
            errors.append(exc)
        finally:
            client.close()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(plans))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not any(t.is_alive() for t in threads), "clients did not finish"
    assert errors == []
    return [o for output in outputs for o in output]


@pytest.fixture(scope="module")
def eager(tiny_config, tiny_checkpoint):
    """The eager model with the build's weights; recompute(users) is each user's full recompute."""
    model = build_model(tiny_config, checkpoint=tiny_checkpoint)

    def recompute(users: list[UserRequest]) -> list[np.ndarray]:
        out: list[np.ndarray | None] = [None] * len(users)
        remaining = list(range(len(users)))
        while remaining:  # batches of distinct users, each request recomputed from scratch
            index_of: dict[int, int] = {}
            for i in remaining:
                index_of.setdefault(users[i].user_id, i)
            chosen = list(index_of.values())
            with torch.no_grad():
                logits = model(Batch.concat([users[i] for i in chosen]))
            for i, part in zip(chosen, logits.split([len(users[i].candidate_ids) for i in chosen])):
                out[i] = part.numpy()
            remaining = [i for i in remaining if i not in set(chosen)]
        return out

    return recompute


def write_repo(artifact: Path, repo: Path, *extra: str):
    """`kvexport triton-repo ARTIFACT -o REPO EXTRA...`, which must succeed; its CliRunner result."""
    result = CliRunner().invoke(main, ["triton-repo", str(artifact), "-o", str(repo), *extra])
    assert result.exit_code == 0, result.output
    return result


def triton_ready(port: int, path: str = "health/ready") -> bool:
    """Whether the server's HTTP port answers 200 at v2/PATH (by default: the server is ready)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/{path}", timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, OSError):
        return False


@contextlib.contextmanager
def started(command: list[str], log: Path, port: int, env=None):
    """A server process, until /v2/health/ready answers on port; stopped (SIGTERM) on exit."""
    with open(log, "w") as out:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not triton_ready(port):
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"{command[0]} did not come up:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)
        yield process
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()


class PlainServer(NamedTuple):
    """A running plain tritonserver: its ports, its log and its process."""

    ports: Ports
    log: Path
    process: subprocess.Popen


@contextlib.contextmanager
def plain_tritonserver(
    artifact: Path, work: Path, patch: str = "", options: tuple[str, ...] = (), server_options: tuple[str, ...] = ()
):
    """tritonserver --model-repository WORK/repo (127.0.0.1, free ports, this venv's Python) on the
    artifact's repository (`triton-repo --this-python` and options, `patch` appended to its model.py),
    with tritonserver's own `server_options`; yields a PlainServer."""
    from kvexport.serving import tritonserver

    repo = work / "repo"
    write_repo(artifact, repo, "--this-python", *options)
    if patch:
        model = repo / "hstu-tiny" / "1" / "model.py"
        model.write_text(model.read_text() + patch)
    command, env = tritonserver.prepare(work)
    ports = server_ports()
    command += [
        "--model-repository",
        str(repo),
        "--http-address",
        "127.0.0.1",
        "--grpc-address",
        "127.0.0.1",
        "--http-port",
        str(ports.http),
        "--grpc-port",
        str(ports.grpc),
        "--metrics-port",
        str(ports.metrics),
        *server_options,
    ]
    with started(command, work / "server.log", ports.http, env) as process:
        yield PlainServer(ports, work / "server.log", process)
