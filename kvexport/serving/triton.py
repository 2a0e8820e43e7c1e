"""`kvexport serve OUT`: the artifact's Triton model repository under the serve extra's tritonserver.

Start: the ports are checked, then a private workspace gets a model repository
(kvexport.serving.repository) whose model names the artifact where it is, this Python's
site-packages and the remote tier (a password given in the URL goes to a file in the workspace,
never into the model's config, which Triton serves to any client). tritonserver starts on it with
the model loaded explicitly at startup, before it listens: the model's `initialize` loads the
package (every file checked), warms it up, then attaches the remote tier
(kvexport.serving.triton_model), so /v2/health/ready never answers true before the package can
score.

The model has one instance, so batches never overlap and a user's requests run in the order they
arrived; Triton's dynamic batcher with ragged inputs merges waiting users into one jagged batch.
kvexport's counters are published on Triton's own metrics port. Triton's endpoints that change or
reveal the server (model repository, statistics, trace, logging, shared memory) answer no client:
they are restricted to a header value no HTTP or gRPC request can carry (it holds a line break), so
nothing on tritonserver's command line, which any local user can read, opens them. The server
needs none of them: the model unloads itself when asked to drain.

While it serves, the model's Python-backend stub is watched: Triton neither restarts a stub that
died nor stops reporting ready, so a dead stub ends the command (non-zero, one line), as a dead
tritonserver does.

Stop (Server.stop, on SIGTERM or SIGINT in the CLI): kvexport creates the drain file in its private
workspace, whose path the model's `drain_file` parameter names; the model's watcher sees it and
unloads the model through the Python backend's model-loading API (Triton's C API, in-process: no
endpoint, no token), so Triton refuses new requests, reports not ready and answers the requests it
has accepted; once the model's stub has ended (its finalize done), tritonserver
is stopped, whatever it left running from the workspace (Python-backend stubs ignore SIGTERM) is
ended, their shared memory and the workspace are removed. tritonserver runs in its own process
group: a Ctrl-C in the terminal reaches kvexport, which drains, not the server.

No PyTriton Python API: the serve extra is used for the tritonserver binary and its Python backend
(kvexport.serving.tritonserver).
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
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from kvexport.errors import UserError
from kvexport.options import RepositoryOptions, ServeOptions
from kvexport.remote import check_write_policy, split_password
from kvexport.serving import tritonserver

log = logging.getLogger(__name__)
server_log = logging.getLogger("kvexport.serving.tritonserver")

STARTUP_TIMEOUT_S = 600  # tritonserver loading the model: the package checked, loaded and warmed up
STARTUP_POLL_S = 0.05
# The longest a stop waits for the model's unload: the requests in flight, then the stub's shutdown.
DRAIN_TIMEOUT_S = 30
UNLOAD_POLL_S = 0.02
DRAIN_FILE = "drain"  # in the workspace: its existence asks the model to unload itself (triton_model.py)
# After the drain nothing is in flight; tritonserver would still wait this long for clients' idle
# keep-alive connections before it exits (at 1 s: a whole second added to every stop).
TRITON_EXIT_TIMEOUT_S = 0
TRITON_EXIT_WAIT_S = 15  # then it is killed
# How often tritonserver samples its CPU (and GPU) metrics; its sampling thread sleeps up to 1 s at
# its default, and tritonserver's exit waits for that sleep: a shorter interval shortens every stop.
METRICS_INTERVAL_MS = 200
MONITOR_S = 0.5  # how often serve() checks that tritonserver is still running
LEFTOVER_END_TIMEOUT_S = 5  # the longest a stop waits for the processes it killed to end
SERVER_LOG_TAIL = 200  # tritonserver lines kept to say why a start failed
# Triton's endpoints that change or reveal the server (loading and unloading models, statistics,
# tracing, logging, shared memory) answer only requests carrying this header with this value, which
# no request can carry: an HTTP header value and a gRPC metadata value may not hold a line break.
# Nothing secret: the command line shows it, and it opens nothing.
RESTRICTED_APIS = "model-repository,statistics,trace,logging,shared-memory"
CLOSED = "kvexport-closed=\n"
_LOG_PREFIX = re.compile(r'[EWI]\d{4} [\d:.]+ +\d+ [\w.]+:\d+\] "?(.*?)"?$')


def failure_reason(lines: list[str]) -> str:
    """The line of tritonserver's output that says why it failed: a model that failed to load, else
    its fatal error, without Triton's log prefix or the traceback the Python backend appends; "" when
    there is none (its other error lines, such
    as "CudaDriverHelper has not been initialized." on a host without a GPU, are no reason)."""
    failed = [line for line in lines if line.startswith("E") and "failed to load '" in line]
    fatal = [line for line in lines if line.startswith("error:") or ": unrecognized option " in line]
    for line in reversed(failed or fatal):
        match = _LOG_PREFIX.match(line)
        # The Python backend appends the model's traceback, its newlines escaped: the reason is before it.
        return (match.group(1) if match else line).split("\\n", 1)[0]
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


class Server:
    """One artifact behind tritonserver: start() returns once it serves; stop() drains and cleans up.

    options (None: the defaults): batching=False hands the package one request per call (Triton's
    max_batch_size 1), to measure what batching brings; threads: the model instance's intra-op CPU
    threads; remote, remote_write: a shared remote KV tier, as kvexport.load takes them.
    """

    def __init__(self, out: Path, options: ServeOptions | None = None):
        o = options or ServeOptions()
        ports = {"--http-port": o.http_port, "--grpc-port": o.grpc_port, "--metrics-port": o.metrics_port}
        if len(set(ports.values())) != len(ports):
            raise UserError(f"the ports must differ, got {', '.join(f'{k} {v}' for k, v in ports.items())}")
        self.out = Path(out)
        self.address = o.address
        self.http_port, self.grpc_port, self.metrics_port = o.http_port, o.grpc_port, o.metrics_port
        self.batching, self.threads = o.batching, o.threads
        self.remote, self.remote_write = o.remote, check_write_policy(o.remote_write, "--remote-write")
        self.model_name = ""
        self.max_batch_size = 0  # users per Triton batch (one execution of the model)
        self.package_batch_size = 0  # users per package call
        self._device = "cpu"
        self.workspace: Path | None = None
        self._shm_prefix = f"kvexport{os.getpid()}-{id(self):x}-"
        self._server: tritonserver.Supervisor | None = None
        self._reader: threading.Thread | None = None
        self._tail: collections.deque[str] = collections.deque(maxlen=SERVER_LOG_TAIL)
        self._serving = False
        self._stopping = threading.Lock()
        self._stubs: list[tritonserver.Stub] = []  # the model's stub processes once it serves

    # -- start -----------------------------------------------------------------------------------

    def start(self) -> Server:
        tritonserver.distribution()  # the serve extra, before anything else
        for option, port in (
            ("--http-port", self.http_port),
            ("--grpc-port", self.grpc_port),
            ("--metrics-port", self.metrics_port),
        ):
            _check_port_free(self.address, port, option)
        try:
            self.workspace = Path(tempfile.mkdtemp(prefix="kvexport-serve-"))
            log.debug("workspace %s", self.workspace)
            model = self._write_repository()
            self._launch(model)
            self._wait_until_ready()
        except BaseException:
            self.stop()
            raise
        self._tail.clear()  # from now on: what tritonserver says while serving
        self._stubs = self._server.watch.find()
        if not self._stubs:  # the drain and the watch both wait on them
            self.stop()
            raise RuntimeError(f"kvexport bug: no Python-backend stub of {self.model_name} found once it was ready")
        self._serving = True
        return self

    def _write_repository(self) -> Path:
        """The workspace's repository: the artifact where it is, this Python, the remote tier."""
        from kvexport.artifact import open_artifact
        from kvexport.serving.repository import Remote, triton_batch_size, write_repository

        remote = None
        if self.remote is not None:
            url, password = split_password(self.remote)
            password_file = None
            if password is not None:
                password_file = self.workspace / "remote-password"
                fd = os.open(password_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "w") as file:
                    file.write(password)
            remote = Remote(url, self.remote_write, password_file)
        artifact = open_artifact(self.out)
        model = write_repository(
            artifact,
            self.workspace / "repository",
            options=RepositoryOptions(batching=self.batching, threads=self.threads),
            remote=remote,
            python_path=tritonserver.site_packages(),
            copy_artifact=False,
            drain_file=self.workspace / DRAIN_FILE,
        )
        self.model_name = model.name
        self.max_batch_size = triton_batch_size(artifact.config.serving.max_batch_size, self.batching)
        self.package_batch_size = artifact.config.serving.max_batch_size if self.batching else 1
        self._device = artifact.device
        return model

    def _launch(self, model: Path) -> None:
        arguments = [
            "--model-control-mode",
            "explicit",
            "--load-model",
            model.name,
            "--strict-readiness",
            "true",
            "--exit-timeout-secs",
            str(TRITON_EXIT_TIMEOUT_S),
            "--http-address",
            self.address,
            "--http-port",
            str(self.http_port),
            "--grpc-address",
            self.address,
            "--grpc-port",
            str(self.grpc_port),
            "--allow-metrics",
            "true",
            "--metrics-address",
            self.address,
            "--metrics-port",
            str(self.metrics_port),
            "--allow-gpu-metrics",
            "true" if self._device == "cuda" else "false",
            "--metrics-interval-ms",
            str(METRICS_INTERVAL_MS),
            "--http-restricted-api",
            f"{RESTRICTED_APIS}:{CLOSED}",
            "--grpc-restricted-protocol",
            f"{RESTRICTED_APIS}:{CLOSED}",
            "--backend-config",
            f"python,shm-region-prefix-name={self._shm_prefix}",
            "--log-verbose",
            "0",
        ]
        self._server = tritonserver.Supervisor(
            self.workspace,
            model.parent,
            arguments,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        self._reader = threading.Thread(target=self._read_output, name="tritonserver-output", daemon=True)
        self._reader.start()

    def _read_output(self) -> None:
        for raw in self._server.process.stdout:
            line = raw.decode("utf-8", errors="replace").rstrip("\n")
            self._tail.append(line)
            server_log.debug("%s", line)

    def _wait_until_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        url = f"http://{self._local_host()}:{self.http_port}/v2/health/ready"
        while time.monotonic() < deadline:
            if not self._server.alive():
                self._reader.join(timeout=5)  # the rest of its output
                reason = failure_reason(list(self._tail)) or f"tritonserver exited {self._server.process.returncode}"
                raise UserError(f"Triton did not start serving {self.model_name}: {reason[:500]}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(url, timeout=1) as ready:
                    if ready.status == 200:
                        return
            time.sleep(STARTUP_POLL_S)
        raise UserError(f"Triton did not start serving {self.model_name} within {STARTUP_TIMEOUT_S} s")

    def _local_host(self) -> str:
        local = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(self.address, self.address)
        return f"[{local}]" if ":" in local else local

    # -- while serving ---------------------------------------------------------------------------

    def alive(self) -> bool:
        """False once tritonserver has exited."""
        return self._server is not None and self._server.alive()

    def dead_stub(self) -> int | None:
        """The pid of a stub of the model that has died while serving (tritonserver.StubWatch),
        else None. Triton does not restart it: its /v2/health/ready stays true while every request
        fails."""
        dead = self._server.dead_stub() if self._server is not None else None
        return dead.pid if dead is not None else None

    def server_log_tail(self) -> list[str]:
        return list(self._tail)

    # -- stop ------------------------------------------------------------------------------------

    def _drain(self) -> None:
        """Asks the model to unload itself (the drain file) and waits until its stubs have ended:
        from the unload on, Triton refuses new requests for it (and /v2/health/ready is false) while
        the requests it has accepted are answered. (Stopping tritonserver alone leaves requests on
        clients' open connections unanswered until its exit timeout.)"""
        (self.workspace / DRAIN_FILE).touch()
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while time.monotonic() < deadline:
            if all(not stub.running() for stub in self._stubs):
                return
            time.sleep(UNLOAD_POLL_S)
        log.warning("%s was still unloading after %d s; stopping tritonserver", self.model_name, DRAIN_TIMEOUT_S)

    def _stop_triton(self) -> None:
        server, self._server = self._server, None
        server.stop(TRITON_EXIT_TIMEOUT_S + TRITON_EXIT_WAIT_S)
        if self._reader is not None:
            self._reader.join(timeout=5)
        server.process.stdout.close()

    def stop(self) -> None:
        """Drains and stops: requests in flight are answered, then everything started is released
        (tritonserver and its stub, the workspace, the ports). Idempotent."""
        with self._stopping:
            if (
                self._serving and self.alive() and all(stub.running() for stub in self._stubs)
            ):  # a dead one cannot drain
                try:
                    self._drain()
                except OSError as exc:  # stopping goes on: tritonserver waits for what is in flight
                    log.warning("could not ask %s to unload before stopping tritonserver: %s", self.model_name, exc)
            self._serving = False
            if self._server is not None:
                self._stop_triton()
            if self.workspace is not None:
                end_leftovers(self.workspace, self._shm_prefix)
                shutil.rmtree(self.workspace, ignore_errors=True)
                self.workspace = None

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()


def serve(out: Path, ready: Callable[[Server], None], options: ServeOptions) -> None:
    """Runs a Server (options as Server's) until SIGTERM or SIGINT, then drains it and returns.

    ready(server) is called once it serves. Raises UserError when it cannot start or when
    tritonserver exits on its own. Must run in the main thread (it handles the signals).
    """
    stop = threading.Event()
    previous = {signum: signal.signal(signum, lambda *_: stop.set()) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        with Server(out, options) as server:
            ready(server)
            while not stop.wait(MONITOR_S):
                if not server.alive():
                    reason = failure_reason(server.server_log_tail())
                    raise UserError(
                        f"tritonserver exited while serving {server.model_name}"
                        + (f": {reason[:500]}" if reason else "")
                    )
                stub = server.dead_stub()
                if stub is not None:
                    raise UserError(
                        f"the Python-backend stub running {server.model_name} (pid {stub}) died; "
                        "Triton would keep reporting ready while failing every request"
                    )
            log.debug("stopping: draining requests in flight")
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def serve_command(out: Path, options: ServeOptions, *flags: str, verbose: bool = False) -> list[str]:
    """The `kvexport serve OUT` command line, run by this Python, at the options' address and ports
    (then `flags`): for a process that runs a server of its own outside this one."""
    return [
        sys.executable,
        "-m",
        "kvexport",
        *(["-v"] if verbose else []),
        "serve",
        str(out),
        "--address",
        options.address,
        "--http-port",
        str(options.http_port),
        "--grpc-port",
        str(options.grpc_port),
        "--metrics-port",
        str(options.metrics_port),
        *flags,
    ]
