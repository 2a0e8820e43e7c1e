"""`kvexport serve OUT`: the package behind a Triton Inference Server started through NVIDIA's PyTriton.

Start: the package is loaded (every file checked against the manifest) and warmed up (a batch of
synthetic users, scored cold and again from the cache; the cache is emptied afterwards), kvexport's
metrics port is bound, and only then is tritonserver started, with the model in its model store:
it loads the model before it listens, so /v2/health/ready never answers true before the package
can score.

The model (named after the artifact) declares the package's max_batch_size and Triton's dynamic
batcher with ragged inputs: one request is one user (kvexport.serving.signature); Triton merges the
requests waiting for the model into one jagged batch whenever its one instance is free (no queue
delay: under load, requests wait while the previous batch is scored, and the next batch takes them
all). The instance's Python-backend stub hands each batch to this process (PyTriton's inference
callable), where kvexport.serving.batcher scores it in arrival order, distinct users per package
call. One instance, so batches never overlap and a user's requests run in the order they arrived.
Each request is answered with its logits or its own one-line error (a Triton error response,
HTTP 400 / gRPC INVALID_ARGUMENT), while the others of its batch are served.

Stop (Server.stop, on SIGTERM or SIGINT in the CLI): the model is unloaded through Triton's
repository API, so Triton refuses new requests and answers those it has accepted; then tritonserver
is stopped, PyTriton removes its workspace, whatever tritonserver left running is ended, the
metrics server stops and the package is closed.

What PyTriton's public API cannot do (libpython preload, per-request errors, ragged inputs, noticing
a tritonserver that exits while starting) is done in kvexport.serving._pytriton, the one module
that touches PyTriton's private parts.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from kvexport.errors import RequestFailed, UserError
from kvexport.io import first_line
from kvexport.remote import DEFAULT_WRITE_POLICY, check_write_policy
from kvexport.serving.batcher import BatchScorer
from kvexport.serving.metrics import MetricsServer, render
from kvexport.serving.signature import ACTION_IDS, CANDIDATE_IDS, CONTEXT_IDS, ITEM_IDS, LOGITS, USER_ID

try:
    import tritonclient.http as triton_http
    from pytriton.client.auth import create_auth_headers
    from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
    from pytriton.triton import TritonConfig, TritonLifecyclePolicy

    from kvexport.serving._pytriton import KvTriton, TritonExited, refusal
except ImportError as missing:  # the serve extra is not installed
    _package = (missing.name or "pytriton").split(".")[0]
    raise UserError(f"kvexport serve needs the serve extra ({_package} is not importable): "
                    "pip install 'kvexport[serve]'") from None

log = logging.getLogger(__name__)

DEFAULT_HTTP_PORT, DEFAULT_GRPC_PORT, DEFAULT_METRICS_PORT = 8000, 8001, 8002  # Triton's own defaults
# The longest a stop waits for the model's unload: the requests in flight, then the stub's shutdown.
DRAIN_TIMEOUT_S = 30
# After the drain nothing is in flight; tritonserver then waits this long for clients' open
# connections (it would wait its whole exit timeout for idle keep-alive connections).
TRITON_EXIT_TIMEOUT_S = 5
MONITOR_S = 1.0  # how often serve() checks that tritonserver is still running
LEFTOVER_END_TIMEOUT_S = 5  # the longest a stop waits for the processes it killed to end
UNLOAD_POLL_S = 0.05
WARMUP_EVENTS = 8
RAGGED_INPUTS = (ITEM_IDS, ACTION_IDS, CANDIDATE_IDS)
_LOG_PREFIX = re.compile(r'[EWI]\d{4} [\d:.]+ +\d+ [\w.]+:\d+\] "?(.*?)"?$')


def failure_reason(lines: list[str]) -> str:
    """The line of tritonserver's output that says why it failed: a model that failed to load, else
    its fatal error, without Triton's log prefix; "" when there is none (its other error lines, such
    as "CudaDriverHelper has not been initialized." on a host without a GPU, are no reason)."""
    failed = [line for line in lines if line.startswith("E") and "failed to load '" in line]
    fatal = [line for line in lines if line.startswith("error:")]
    for line in reversed(failed or fatal):
        match = _LOG_PREFIX.match(line)
        return match.group(1) if match else line
    return ""


def end_leftovers(workspace: Path, shm_prefix: str) -> None:
    """Python-backend stubs outlive a tritonserver that exits without unloading its model (they
    ignore SIGTERM), and keep their shared memory: ends every process still running from this
    start's workspace (its tritonserver, its stubs), waits until they have ended, and removes the
    regions named with its prefix."""
    marker = os.fsencode(workspace)
    ended = []
    for process in Path("/proc").glob("[0-9]*"):
        try:
            if marker in (process / "cmdline").read_bytes():
                os.kill(int(process.name), signal.SIGKILL)
                log.warning("ended %s, left running by tritonserver", process.name)
                ended.append(process)
        except (OSError, ValueError):  # gone meanwhile, or not ours to read
            continue
    _wait_until_ended(ended, LEFTOVER_END_TIMEOUT_S)
    for region in Path("/dev/shm").glob(f"{shm_prefix}*"):
        with contextlib.suppress(OSError):
            region.unlink()


def _wait_until_ended(processes: list[Path], timeout_s: float) -> None:
    """Waits (at most timeout_s) until each /proc entry is gone or a zombie: a process killed with
    SIGKILL ends a moment later, not when kill() returns."""
    deadline = time.monotonic() + timeout_s
    for process in processes:
        while time.monotonic() < deadline:
            try:
                state = (process / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                break
            if state == "Z":
                break
            time.sleep(0.01)


def _check_port_free(address: str, port: int, option: str) -> None:
    with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((address, port))
        except OSError as exc:
            raise UserError(f"cannot listen on {address}:{port} ({option}): {exc.strerror or exc}") from None


def _free_local_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def warm_up(package) -> None:
    """Scores a batch of synthetic users twice (cold, then grown from the cache), then empties the
    cache runtime and zeroes its counters: the first real request finds the code warm and the cache
    empty. A package whose device tier cannot hold that batch is warmed with one user."""
    from kvexport.model.batch import UserRequest, random_user
    from kvexport.ops import wrappers as kv

    m = package.config.model
    generator = torch.Generator().manual_seed(0)
    events = min(WARMUP_EVENTS, m.max_history_length // 2)
    candidates = min(WARMUP_EVENTS, m.max_num_candidates)
    users = [random_user(m, generator, user_id, events, candidates) for user_id in range(package.max_batch_size)]
    grown = [UserRequest(u.user_id, u.item_ids.repeat(2), u.action_ids.repeat(2), u.context_ids, u.candidate_ids)
             for u in users]
    try:
        package.score_users(users)
        package.score_users(grown)
    except RequestFailed as refused:
        log.debug("warm-up batch refused (%s); warming up with one user", refused)
        package.score_users(users[:1])
        package.score_users(grown[:1])
    kv.reset_runtime(package.runtime_name)


def load_warm(out: Path, remote: str | None = None, remote_write: str = DEFAULT_WRITE_POLICY):
    """kvexport.load(out), warmed up (warm_up), then the remote tier attached: the warm-up's
    synthetic users (ids 0 and up) must neither overwrite real users' shared entries nor read them."""
    import kvexport

    check_write_policy(remote_write)  # before minutes of loading
    package = kvexport.load(out)
    try:
        warm_up(package)
        if remote is not None:
            package.attach_remote(remote, remote_write)
    except BaseException:
        package.close()
        raise
    return package


class Server:
    """One package behind Triton: start() returns once it serves; stop() drains and cleans up.

    batching=False hands the package one request per call (Triton's max_batch_size 1), to measure
    what batching brings. remote, remote_write: a shared remote KV tier, as kvexport.load takes them.
    """

    def __init__(self, out: Path, *, address: str = "0.0.0.0", http_port: int = DEFAULT_HTTP_PORT,
                 grpc_port: int = DEFAULT_GRPC_PORT, metrics_port: int = DEFAULT_METRICS_PORT,
                 batching: bool = True, remote: str | None = None, remote_write: str = DEFAULT_WRITE_POLICY):
        ports = {"--http-port": http_port, "--grpc-port": grpc_port, "--metrics-port": metrics_port}
        if len(set(ports.values())) != len(ports):
            raise UserError(f"the ports must differ, got {', '.join(f'{k} {v}' for k, v in ports.items())}")
        self.out = Path(out)
        self.address = address
        self.http_port, self.grpc_port, self.metrics_port = http_port, grpc_port, metrics_port
        self.batching = batching
        self.remote, self.remote_write = remote, remote_write
        self.package = None
        self._scorer: BatchScorer | None = None
        self._metrics: MetricsServer | None = None
        self._triton: KvTriton | None = None
        self._serving = False
        self._stopping = threading.Lock()

    @property
    def model_name(self) -> str:
        return self.package.name

    @property
    def max_batch_size(self) -> int:
        """Users per batch: the package's max_batch_size, 1 without batching."""
        return self.package.max_batch_size if self.batching else 1

    def start(self) -> "Server":
        for option, port in (("--http-port", self.http_port), ("--grpc-port", self.grpc_port)):
            _check_port_free(self.address, port, option)
        try:
            self.package = load_warm(self.out, self.remote, self.remote_write)
            self._scorer = BatchScorer(self.package, self.max_batch_size)
            triton_metrics_port = _free_local_port()
            try:
                self._metrics = MetricsServer(self.address, self.metrics_port,
                                              f"http://127.0.0.1:{triton_metrics_port}", self.kvexport_metrics)
            except OSError as exc:
                raise UserError(f"cannot listen on {self.address}:{self.metrics_port} (--metrics-port): "
                                f"{exc.strerror or exc}") from None
            self._metrics.start()
            self._start_triton(triton_metrics_port)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_triton(self, triton_metrics_port: int) -> None:
        config = TritonConfig(
            http_address=self.address, http_port=self.http_port, grpc_address=self.address, grpc_port=self.grpc_port,
            allow_metrics=True, metrics_address="127.0.0.1", metrics_port=triton_metrics_port,
            allow_gpu_metrics=self.package.device.type == "cuda", exit_timeout_secs=TRITON_EXIT_TIMEOUT_S,
            strict_readiness=True, log_verbose=0)
        m = self.package.config.model
        try:
            # The model goes into the model store before tritonserver starts, which loads it before it
            # listens: /v2/health/ready never answers true without the model (PyTriton's default
            # loads it through the running server, which is ready, with no model, in between).
            self._triton = KvTriton(config=config, failure_reason=failure_reason,
                                    triton_lifecycle_policy=TritonLifecyclePolicy(
                                        launch_triton_on_startup=True, local_model_store=True))
            log.debug("PyTriton workspace %s", self._triton.workspace)
            self._triton.bind(
                model_name=self.model_name,
                infer_func=self._infer,
                inputs=[Tensor(name=USER_ID, dtype=np.int64, shape=(1,)),
                        Tensor(name=ITEM_IDS, dtype=np.int64, shape=(-1,)),
                        Tensor(name=ACTION_IDS, dtype=np.int64, shape=(-1,)),
                        Tensor(name=CONTEXT_IDS, dtype=np.int64, shape=(m.num_contextual_features,)),
                        Tensor(name=CANDIDATE_IDS, dtype=np.int64, shape=(-1,))],
                outputs=[Tensor(name=LOGITS, dtype=np.float32, shape=(-1, m.num_tasks))],
                config=ModelConfig(batching=True, max_batch_size=self.max_batch_size,
                                   batcher=DynamicBatcher(max_queue_delay_microseconds=0)),
                strict=False,  # a refusal is a response PyTriton's model config does not declare
            )
            self._triton.adapt_model(self.model_name, RAGGED_INPUTS)
            self._triton.run()
        except TritonExited as exited:
            raise UserError(f"Triton did not start serving {self.model_name}: {str(exited)[:500]}") from None
        except Exception as exc:  # noqa: BLE001 — PyTriton and tritonclient raise many kinds: "did not start"
            reason = (failure_reason(self._triton.server_log_tail()) if self._triton else "") or first_line(exc)
            raise UserError(f"Triton did not start serving {self.model_name}: {reason[:500]}") from exc
        self._triton.forget_server_log()
        self._serving = True

    def _infer(self, requests) -> list[dict[str, np.ndarray]]:
        """PyTriton's inference callable: one Triton batch, each request one user, oldest first."""
        return [refusal(first_line(result)) if isinstance(result, RequestFailed)
                else {LOGITS: np.ascontiguousarray(result.cpu().numpy()[None], dtype=np.float32)}
                for result in self._scorer.score([request.data for request in requests])]

    def kvexport_metrics(self) -> str:
        """kvexport's Prometheus metrics: the cache runtime's counters and the scorer's."""
        try:
            cache = self.package.stats()
        except UserError:  # closed while stopping
            cache = {}
        return render(self.model_name, cache, self._scorer.counters())

    def alive(self) -> bool:
        """False once tritonserver or the model's inference handler has exited."""
        return self._triton is not None and self._triton.is_alive()

    def server_log_tail(self) -> list[str]:
        return self._triton.server_log_tail() if self._triton else []

    def _drain(self) -> None:
        """Unloads the model through Triton's repository API and waits until it is unloaded: from
        then on Triton refuses new requests for it (and /v2/health/ready is false) while the requests
        it has accepted are answered. (Stopping tritonserver alone keeps taking requests until
        its exit timeout while any are in flight, then drops them.)"""
        local = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(self.address, self.address)
        host = f"[{local}]" if ":" in local else local
        headers = create_auth_headers(self._triton.get_access_token(), "http")
        client = triton_http.InferenceServerClient(f"{host}:{self.http_port}", network_timeout=DRAIN_TIMEOUT_S)
        try:
            client.unload_model(self.model_name, headers=headers)
            deadline = time.monotonic() + DRAIN_TIMEOUT_S
            while time.monotonic() < deadline:
                states = {m["name"]: m.get("state") for m in client.get_model_repository_index(headers=headers)}
                if states.get(self.model_name) != "UNLOADING":
                    return
                time.sleep(UNLOAD_POLL_S)
            log.warning("%s was still unloading after %d s; stopping tritonserver", self.model_name, DRAIN_TIMEOUT_S)
        finally:
            client.close()

    def _stop_triton(self) -> None:
        """Stops tritonserver (PyTriton: SIGINT, then SIGKILL after 30 s), removes PyTriton's workspace,
        then ends whatever it left running."""
        triton, self._triton = self._triton, None
        workspace, shm_prefix = triton.workspace, triton.shm_prefix
        triton.stop()
        end_leftovers(workspace, shm_prefix)
        shutil.rmtree(workspace, ignore_errors=True)  # PyTriton keeps it when tritonserver never started

    def stop(self) -> None:
        """Drains and stops: requests in flight are answered, then everything started is released
        (tritonserver and its stub, PyTriton's workspace, the ports, the package). Idempotent."""
        with self._stopping:
            if self._serving and self.alive():
                try:
                    self._drain()
                except Exception as exc:  # noqa: BLE001 — stopping goes on: tritonserver waits for what is in flight
                    log.warning("could not unload %s before stopping tritonserver: %s", self.model_name,
                                first_line(exc))
            self._serving = False
            if self._triton is not None:
                self._stop_triton()
            if self._metrics is not None:
                self._metrics.close()
                self._metrics = None
            if self.package is not None:
                self.package.close()

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()


def serve(out: Path, ready: Callable[[Server], None], **options) -> None:
    """Runs a Server (options as Server's) until SIGTERM or SIGINT, then drains it and returns.

    ready(server) is called once it serves. Raises UserError when it cannot start or when
    tritonserver exits on its own. Must run in the main thread (it handles the signals).
    """
    stop = threading.Event()
    previous = {signum: signal.signal(signum, lambda *_: stop.set()) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        with Server(out, **options) as server:
            ready(server)
            while not stop.wait(MONITOR_S):
                if not server.alive():
                    reason = failure_reason(server.server_log_tail())
                    raise UserError(f"tritonserver exited while serving {server.model_name}"
                                    + (f": {reason[:500]}" if reason else ""))
            log.debug("stopping: draining requests in flight")
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
