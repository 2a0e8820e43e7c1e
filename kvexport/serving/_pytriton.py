"""Every use of PyTriton's private parts, in one place, for the one version they were written against.

PyTriton's public API (Triton, bind, ModelConfig, Tensor) cannot do four things `kvexport serve`
needs; each is done here, against nvidia-pytriton 0.7.0 (checked at import: another version is a
one-line error, since any of these may have moved):

- Preload this interpreter's libpython into tritonserver and its Python-backend stubs: the stub
  links libpython3.11.so.1.0 by name, the dynamic loader can find another build of it (a system
  one), whose C code then runs this interpreter's standard library, and the model fails to load
  (`'_thread.RLock' object has no attribute '_recursion_count'`). TritonServer._get_env is the only
  place that sets tritonserver's environment (set for that process only).
- Keep tritonserver's output (TritonServer._record_logs) to say why a start failed, and notice at
  once a tritonserver that exits while loading the model (Triton._wait_for_server would wait 120 s).
- Answer one request of a batch with its own error. PyTriton's stub answers an exception from the
  inference callable by failing every request of the batch with a Python traceback (HTTP 500). The
  model store gets a small stub entry point (STUB_ENTRY, made the model's file through
  `default_model_filename`) that turns a response holding REFUSAL into a Triton error response
  carrying only its one-line message (INVALID_ARG: HTTP 400, gRPC INVALID_ARGUMENT). It wraps the
  stub's `_wrap_response`; a stub without it fails to load the model, so a drift cannot go unseen.
- Hand over requests holding an empty tensor (a user with no history yet): PyTriton's stub copies
  each tensor into shared memory through `memoryview.cast`, which refuses a view with a zero in its
  shape, and the whole batch fails. The stub entry point gives TensorStore._copy_frames such
  tensors as empty bytes (same bytes, no view to cast).
- Mark the variable-length inputs `allow_ragged_batch` (PyTriton's Tensor has no such field), so
  Triton's dynamic batcher merges users whose histories differ in length.
"""

from __future__ import annotations

import collections
import contextlib
import importlib.metadata
import logging
import sysconfig
import time
import urllib.request
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
from google.protobuf import text_format
from pytriton.server.triton_server import TritonServer
from pytriton.triton import Triton
from pytriton.utils.distribution import get_libs_path
from tritonclient.grpc import model_config_pb2

from kvexport.errors import UserError

PYTRITON_VERSION = "0.7.0"
_installed = importlib.metadata.version("nvidia-pytriton")
if _installed != PYTRITON_VERSION:
    raise UserError(f"kvexport serve is written against nvidia-pytriton {PYTRITON_VERSION}, found {_installed}: "
                    f"pip install 'nvidia-pytriton=={PYTRITON_VERSION}'")

server_log = logging.getLogger("kvexport.serving.tritonserver")

SERVER_LOG_TAIL = 200  # tritonserver lines kept to explain a failed start
STARTUP_TIMEOUT_S = 120  # tritonserver loading the model (its stub) until it answers
STARTUP_POLL_S = 0.1

REFUSAL = "kvexport_refusal"  # a response holding this (UTF-8 bytes as uint8) is that request's error
STUB_ENTRY_FILE = "kvexport_model.py"
STUB_ENTRY = f'''"""kvexport's entry point of PyTriton's Python-backend stub (written by kvexport.serving._pytriton)."""

import triton_python_backend_utils as pb_utils

from . import data as pytriton_data
from . import model as pytriton_model

_wrap_response = pytriton_model._wrap_response
_copy_frames = pytriton_data.TensorStore._copy_frames


def _refusal_or_response(response, requested_output_names, model_outputs):
    """A response holding {REFUSAL!r} is its request's error, its one line; others are PyTriton's."""
    if response.data is not None and {REFUSAL!r} in response.data:
        message = response.data[{REFUSAL!r}].tobytes().decode("utf-8", errors="replace")
        return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, pb_utils.TritonError.INVALID_ARG))
    return _wrap_response(response, requested_output_names, model_outputs)


def _copy_frames_empty_as_bytes(self, frames, shm, offset):
    """PyTriton's copy, with an empty frame given as b"" (its memoryview of shape [1, 0] cannot be cast)."""
    return _copy_frames(self, [b"" if memoryview(frame).nbytes == 0 else frame for frame in frames], shm, offset)


pytriton_model._wrap_response = _refusal_or_response
pytriton_data.TensorStore._copy_frames = _copy_frames_empty_as_bytes
TritonPythonModel = pytriton_model.TritonPythonModel
'''


def refusal(message: str) -> dict[str, np.ndarray]:
    """The response that answers its request with the Triton error `message` (one line)."""
    return {REFUSAL: np.frombuffer(message.encode("utf-8"), dtype=np.uint8)}


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


class TritonExited(Exception):
    """tritonserver exited before it answered (the model did not load); the message is its reason."""


class KvTriton(Triton):
    """PyTriton's Triton, running _TritonServer, and noticing at once when it exits while starting.

    failure_reason(lines) turns tritonserver's last lines into the reason a start failed."""

    def __init__(self, *args, failure_reason: Callable[[list[str]], str], **kwargs):
        super().__init__(*args, **kwargs)
        self._failure_reason = failure_reason

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
                raise TritonExited(self._failure_reason(self.server_log_tail()) or "tritonserver exited")
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

    def adapt_model(self, model_name: str, ragged_inputs: Iterable[str]) -> None:
        """After bind(), before run(): the bound model (in the local model store) gets kvexport's stub
        entry point and its ragged inputs."""
        model_dir = self._workspace.model_store_path / model_name
        config_path = model_dir / "config.pbtxt"
        config = text_format.Parse(config_path.read_text(), model_config_pb2.ModelConfig())
        ragged = set(ragged_inputs)
        for spec in config.input:
            spec.allow_ragged_batch = spec.name in ragged
        config.default_model_filename = STUB_ENTRY_FILE
        versions = [path for path in model_dir.iterdir() if path.is_dir()]
        if len(versions) != 1 or not (versions[0] / "model.py").is_file():
            raise RuntimeError(f"bug: PyTriton's model store {model_dir} does not hold one version with model.py")
        (versions[0] / STUB_ENTRY_FILE).write_text(STUB_ENTRY)
        config_path.write_text(text_format.MessageToString(config))
