"""`kvexport serve OUT`: the package behind a Triton Inference Server started through NVIDIA's PyTriton.

Start: the package is loaded (every file checked against the manifest) and warmed up (a batch of
synthetic users, scored cold and again from the cache; the cache is emptied afterwards), kvexport's
metrics port is bound, and only then is tritonserver started, with the model in its model store:
it loads the model before it listens, so /v2/health/ready never answers true before the package
can score. A tritonserver that exits while loading the model is noticed at once and started again.

The model (named after the artifact) has max_batch_size 0: one request is one user, with the flat
tensors of kvexport.serving.signature. It runs as `instances` Triton model instances (Python-backend
stubs); each hands its request to this process (PyTriton's inference callable), where one Batcher
merges the requests in flight into batches of distinct users (kvexport.serving.batcher). A bad
request is refused alone, while the other requests are served.

Stop (Server.stop, on SIGTERM or SIGINT in the CLI): the model is unloaded through Triton's
repository API, so Triton refuses new requests and answers those it has accepted (the batcher
still runs); then tritonserver is stopped, PyTriton removes its workspace, whatever tritonserver
left running is ended, the batcher and the metrics server stop and the package is closed.

tritonserver's Python-backend stub links libpython3.11.so.1.0 by name; the dynamic loader can find
another build of it than this interpreter's (a system one), whose C code then runs this
interpreter's standard library, and the model fails to load (multiprocessing.resource_tracker:
`'_thread.RLock' object has no attribute '_recursion_count'`). So tritonserver, and the stubs it
starts, get this interpreter's own shared libpython preloaded (LD_PRELOAD, set for that process only;
found through sysconfig's LIBDIR and INSTSONAME).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import re
import shutil
import signal
import socket
import sysconfig
import threading
import time
import urllib.request
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from kvexport.errors import RequestFailed, UserError
from kvexport.io import first_line
from kvexport.serving.batcher import Batcher
from kvexport.serving.metrics import MetricsServer, render
from kvexport.serving.signature import ACTION_IDS, CANDIDATE_IDS, CONTEXT_IDS, ITEM_IDS, LOGITS, USER_ID

try:
    import tritonclient.http as triton_http
    from pytriton.client.auth import create_auth_headers
    from pytriton.model_config import ModelConfig, Tensor
    from pytriton.server.triton_server import TritonServer
    from pytriton.triton import Triton, TritonConfig, TritonLifecyclePolicy
    from pytriton.utils.distribution import get_libs_path
except ImportError as missing:  # the serve extra is not installed
    _package = (missing.name or "pytriton").split(".")[0]
    raise UserError(f"kvexport serve needs the serve extra ({_package} is not importable): "
                    "pip install 'kvexport[serve]'") from None

log = logging.getLogger(__name__)
server_log = logging.getLogger("kvexport.serving.tritonserver")

DEFAULT_HTTP_PORT, DEFAULT_GRPC_PORT, DEFAULT_METRICS_PORT = 8000, 8001, 8002  # Triton's own defaults
# The longest a stop waits for the model's unload: the requests in flight, then each instance's
# Python-backend stub shutting down (about 2 s each, one after the other).
DRAIN_TIMEOUT_S = 30
UNLOAD_S_PER_INSTANCE = 3
# After the drain nothing is in flight; tritonserver then waits this long for clients' open
# connections (it would wait its whole exit timeout for idle keep-alive connections).
TRITON_EXIT_TIMEOUT_S = 5
SERVER_LOG_TAIL = 200  # tritonserver lines kept to explain a failed start
MONITOR_S = 1.0  # how often serve() checks that tritonserver is still running
UNLOAD_POLL_S = 0.1
STARTUP_TIMEOUT_S = 120  # tritonserver loading the model (its stubs) until it answers
STARTUP_POLL_S = 0.1
# PyTriton 0.7.0's model instances other than the first fetch its config over a socket within 1 s;
# when the first is slower to start (a busy host), the model fails to load and tritonserver exits.
# A start that ends so is tried again, from a fresh tritonserver.
START_ATTEMPTS = 3
WARMUP_EVENTS = 8


def libpython() -> Path | None:
    """This interpreter's shared libpython (sysconfig's LIBDIR / INSTSONAME, or LIBDIR/MULTIARCH), or
    None when it has none (then the stub's libpython is whatever the dynamic loader finds)."""
    name, libdir = sysconfig.get_config_var("INSTSONAME"), sysconfig.get_config_var("LIBDIR")
    if not sysconfig.get_config_var("Py_ENABLE_SHARED") or not name or not libdir:
        return None
    multiarch = sysconfig.get_config_var("MULTIARCH")
    for directory in (Path(libdir), Path(libdir) / multiarch if multiarch else None):
        if directory is not None and (directory / name).is_file():
            return directory / name
    return None


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


class _TritonServer(TritonServer):
    """PyTriton's tritonserver process, with this interpreter's libpython preloaded and its output
    sent to a logger (kept short, never accumulated)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.tail: collections.deque[str] = collections.deque(maxlen=SERVER_LOG_TAIL)
        self._partial = ""

    def _get_env(self) -> dict:
        env = super()._get_env()
        own = libpython()
        if own is not None:
            env["LD_PRELOAD"] = " ".join(filter(None, [str(own), env.get("LD_PRELOAD", "")]))
        return env

    def _record_logs(self, chunk) -> None:
        """tritonserver's output, as PyTriton's `sh` hands it over (unbuffered: a few characters at a time)."""
        if isinstance(chunk, bytes):
            chunk = chunk.decode("utf-8", errors="replace")
        *lines, self._partial = (self._partial + chunk).split("\n")
        for line in lines:
            self.tail.append(line)
            server_log.debug("%s", line)


def end_leftovers(workspace: Path, shm_prefix: str) -> None:
    """Python-backend stubs outlive a tritonserver that exits without unloading its model (they
    ignore SIGTERM), and keep their shared memory: ends every process still running from this
    start's workspace (its tritonserver, its stubs) and removes the regions named with its prefix."""
    marker = os.fsencode(workspace)
    for process in Path("/proc").glob("[0-9]*"):
        try:
            if marker in (process / "cmdline").read_bytes():
                os.kill(int(process.name), signal.SIGKILL)
                log.warning("ended %s, left running by tritonserver", process.name)
        except (OSError, ValueError):  # gone meanwhile, or not ours to read
            continue
    for region in Path("/dev/shm").glob(f"{shm_prefix}*"):
        with contextlib.suppress(OSError):
            region.unlink()


class _TritonExited(Exception):
    """tritonserver exited before it answered (the model did not load)."""


class _Triton(Triton):
    """PyTriton's Triton, running _TritonServer, and noticing at once when it exits while starting."""

    def _initialize_server(self) -> None:
        super()._initialize_server()
        server = self._triton_server
        self._triton_server = _TritonServer(path=server._server_path, libs_path=get_libs_path(),
                                            config=server._server_config, verbose=False)

    def _wait_for_server(self) -> None:
        """Waits for /v2/health/ready or for tritonserver's exit, then PyTriton's own wait (which,
        alone, would wait its whole timeout for a tritonserver that has exited)."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if not self._triton_server.is_alive():
                with contextlib.suppress(Exception):  # sh hands over the rest of its output (it exited non-zero)
                    self._triton_server._tritonserver_running_cmd.wait(timeout=STARTUP_POLL_S * 50)
                raise _TritonExited(failure_reason(self.server_log_tail()) or "tritonserver exited")
            try:
                with urllib.request.urlopen(f"{self._url}/v2/health/ready", timeout=STARTUP_POLL_S * 10) as ready:
                    if ready.status == 200:
                        break
            except OSError:
                pass
            time.sleep(STARTUP_POLL_S)
        else:
            raise TimeoutError(f"tritonserver did not become ready within {STARTUP_TIMEOUT_S} s")
        super()._wait_for_server()

    def server_log_tail(self) -> list[str]:
        return list(self._triton_server.tail) if isinstance(self._triton_server, _TritonServer) else []

    def forget_server_log(self) -> None:
        """From now on server_log_tail() holds what tritonserver says while serving."""
        self._triton_server.tail.clear()

    @property
    def workspace(self) -> Path:
        return self._workspace.path

    @property
    def shm_prefix(self) -> str:
        """The Python backend's shared-memory regions are named /dev/shm/<prefix>-...."""
        return self._python_backend_config["shm-region-prefix-name"]


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


class Server:
    """One package behind Triton: start() returns once it serves; stop() drains and cleans up."""

    def __init__(self, out: Path, *, address: str = "0.0.0.0", http_port: int = DEFAULT_HTTP_PORT,
                 grpc_port: int = DEFAULT_GRPC_PORT, metrics_port: int = DEFAULT_METRICS_PORT,
                 instances: int | None = None):
        ports = {"--http-port": http_port, "--grpc-port": grpc_port, "--metrics-port": metrics_port}
        if len(set(ports.values())) != len(ports):
            raise UserError(f"the ports must differ, got {', '.join(f'{k} {v}' for k, v in ports.items())}")
        if instances is not None and instances < 1:
            raise UserError(f"--instances must be >= 1, got {instances}")
        self.out = Path(out)
        self.address = address
        self.http_port, self.grpc_port, self.metrics_port = http_port, grpc_port, metrics_port
        self._instances = instances
        self.package = None
        self._batcher: Batcher | None = None
        self._metrics: MetricsServer | None = None
        self._triton: _Triton | None = None
        self._serving = False
        self._stopping = threading.Lock()

    @property
    def model_name(self) -> str:
        return self.package.name

    @property
    def instances(self) -> int:
        return self._instances or self.package.max_batch_size

    def start(self) -> "Server":
        for option, port in (("--http-port", self.http_port), ("--grpc-port", self.grpc_port)):
            _check_port_free(self.address, port, option)
        import kvexport

        try:
            self.package = kvexport.load(self.out)
            warm_up(self.package)
            self._batcher = Batcher(self.package)
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
        for attempt in range(1, START_ATTEMPTS + 1):
            try:
                return self._start_triton_once(triton_metrics_port)
            except _TritonExited as exited:
                self._stop_triton()
                reason = str(exited)[:500]
                if attempt == START_ATTEMPTS:
                    raise UserError(f"Triton did not start serving {self.model_name} ({attempt} attempts): "
                                    f"{reason}") from exited
                log.info("tritonserver exited while loading %s (%s); starting it again", self.model_name,
                         reason[:200])

    def _start_triton_once(self, triton_metrics_port: int) -> None:
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
            self._triton = _Triton(config=config, triton_lifecycle_policy=TritonLifecyclePolicy(
                launch_triton_on_startup=True, local_model_store=True))
            log.debug("PyTriton workspace %s", self._triton.workspace)
            self._triton.bind(
                model_name=self.model_name,
                infer_func=[self._infer] * self.instances,
                inputs=[Tensor(name=USER_ID, dtype=np.int64, shape=(1,)),
                        Tensor(name=ITEM_IDS, dtype=np.int64, shape=(-1,)),
                        Tensor(name=ACTION_IDS, dtype=np.int64, shape=(-1,)),
                        Tensor(name=CONTEXT_IDS, dtype=np.int64, shape=(m.num_contextual_features,)),
                        Tensor(name=CANDIDATE_IDS, dtype=np.int64, shape=(-1,))],
                outputs=[Tensor(name=LOGITS, dtype=np.float32, shape=(-1, m.num_tasks))],
                config=ModelConfig(batching=False),
                strict=True,
            )
            self._triton.run()
        except _TritonExited:
            raise
        except Exception as exc:  # noqa: BLE001 — PyTriton and tritonclient raise many kinds: "did not start"
            reason = (failure_reason(self._triton.server_log_tail()) if self._triton else "") or first_line(exc)
            raise UserError(f"Triton did not start serving {self.model_name}: {reason[:500]}") from exc
        self._triton.forget_server_log()
        self._serving = True

    def _infer(self, requests):
        """PyTriton's inference callable: a list of requests (one with max_batch_size 0), each one user.

        A refusal is raised from here without the frames below: PyTriton answers the request with a
        Triton error whose text is its own traceback ending in `kvexport.errors.<Error>: <reason>`.
        """
        try:
            users = [self._batcher.check(dict(request.items())) for request in requests]
            pending = [self._batcher.submit(user) for user in users]
            return [{LOGITS: np.ascontiguousarray(result.result().cpu().numpy(), dtype=np.float32)}
                    for result in pending]
        except UserError as refused:
            raise refused.with_traceback(None) from None

    def kvexport_metrics(self) -> str:
        """kvexport's Prometheus metrics: the cache runtime's counters and the batcher's."""
        try:
            cache = self.package.stats()
        except UserError:  # closed while stopping
            cache = {}
        return render(self.model_name, cache, self._batcher.counters())

    def alive(self) -> bool:
        """False once tritonserver or one of the model's inference handlers has exited."""
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
        timeout = DRAIN_TIMEOUT_S + UNLOAD_S_PER_INSTANCE * self.instances
        client = triton_http.InferenceServerClient(f"{host}:{self.http_port}", network_timeout=timeout)
        try:
            client.unload_model(self.model_name, headers=headers)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                states = {m["name"]: m.get("state") for m in client.get_model_repository_index(headers=headers)}
                if states.get(self.model_name) != "UNLOADING":
                    return
                time.sleep(UNLOAD_POLL_S)
            log.warning("%s was still unloading after %d s; stopping tritonserver", self.model_name, timeout)
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
        (tritonserver and its stubs, PyTriton's workspace, the ports, the package). Idempotent."""
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
            if self._batcher is not None:
                self._batcher.close()
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
