"""The tests' redis-server (kvexport.bench.remote.RedisServer, on 127.0.0.1) and its fixtures, a minimal
client, stand-in servers and proxies, the password files the remote tier refuses, and a serving
process that shares the remote tier (remote_worker)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from kvexport.bench.remote import RedisServer
from kvexport.cached import CachedRanker
from kvexport.config import Config
from kvexport.ops import wrappers as kv
from tests.helpers.configs import tiny_config


class Resp:
    """A minimal binary-safe RESP client, so tests need no client package."""

    def __init__(self, port: int):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        self.buffer = b""

    def close(self) -> None:
        self.sock.close()

    def command(self, *args: bytes | str):
        parts = [a.encode() if isinstance(a, str) else a for a in args]
        self.sock.sendall(b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts))
        return self._reply()

    def _line(self) -> bytes:
        while b"\r\n" not in self.buffer:
            self.buffer += self.sock.recv(1 << 16)
        line, self.buffer = self.buffer.split(b"\r\n", 1)
        return line

    def _reply(self):
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"-":
            raise RuntimeError(rest.decode())
        if kind in (b"+", b":"):
            return rest if kind == b"+" else int(rest)
        size = int(rest)
        if kind == b"*":
            return [self._reply() for _ in range(size)]
        if size < 0:
            return None
        while len(self.buffer) < size + 2:
            self.buffer += self.sock.recv(1 << 16)
        value, self.buffer = self.buffer[:size], self.buffer[size + 2 :]
        return value


def need_redis() -> None:
    """Skips the test where the remote tier cannot run: `make setup` names what to install."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (Debian/Ubuntu: apt-get install redis-server libhiredis-dev)")
    try:
        kv.attach_remote("kvexport-probe-no-such-runtime", "redis://127.0.0.1:1", "on_evict")
    except ValueError as exc:
        if "without the remote tier" in str(exc):
            pytest.skip("the op library was built without the remote tier (install libhiredis-dev)")


class LocalServer:
    """A TCP server on a free local port that hands each connection to connected(), until close()."""

    def __init__(self):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self.listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            self.connected(client)

    def connected(self, client: socket.socket) -> None:
        raise NotImplementedError


class GatedProxy(LocalServer):
    """A TCP proxy to a server that holds back MGET commands while its gate is closed.

    Its threads are Python threads: they forward a read only while the thread making it has
    released the GIL.
    """

    def __init__(self, target_port: int):
        self.target_port = target_port
        self.gate = threading.Event()
        self.gate.set()
        self.mget_seen = threading.Event()
        super().__init__()

    def close(self) -> None:
        self.gate.set()
        super().close()

    def connected(self, client: socket.socket) -> None:
        upstream = socket.create_connection(("127.0.0.1", self.target_port))
        threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
        threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, gated: bool) -> None:
        try:
            while data := source.recv(1 << 16):
                if gated and b"MGET" in data:
                    self.mget_seen.set()
                    self.gate.wait()
                sink.sendall(data)
        except OSError:
            pass
        finally:
            source.close()
            sink.close()


# Contents a password file must not have, as bytes (None: no file; "dir": a directory), and the
# message naming each; the C++ harness reads it by the same rules (test_remote_fleet.py).
BAD_PASSWORD_FILES = [
    (b"", "is empty"),
    (b"\n", "is empty"),
    (b"a\nb", "holds more than one line"),
    (b"pw\r", "holds more than one line"),
    (b"a\rb\n", "holds more than one line"),
    (b"\xef\xbb\xbfpw\n", "starts with a byte-order mark: save it without one"),
    (b"p\xffw\n", "is not UTF-8 text"),
    (b"x" * 4097, "is over 4096 bytes: not a password file"),
    (None, "does not exist"),
    ("dir", "is not a regular file"),
    ("fifo", "is not a regular file"),
    ("under a file", "does not exist"),
    ("slash", "does not exist"),
    ("loop", "Too many levels of symbolic links"),
]


def write_password_file(path: Path, content: bytes | str | None) -> str:
    """A password file at path holding content (bytes), or one of the odd paths the tags name; the
    path to give (as a string: "pw/" would lose its '/' as a Path)."""
    if content == "dir":
        path.mkdir()
    elif content == "fifo":
        os.mkfifo(path)
    elif content == "under a file":
        path.write_bytes(b"pw\n")
        return str(path / "pw")
    elif content == "slash":
        path.write_bytes(b"pw\n")
        return f"{path}/"
    elif content == "loop":
        path.symlink_to(path)
    elif content is not None:
        path.write_bytes(content)
    return str(path)


def wait_for(runtime: str, name: str, value: int, timeout_s: float = 10.0) -> dict[str, int]:
    """Polls the runtime's stats until counter `name` reaches `value` (the writer is asynchronous)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = kv.runtime_stats(runtime)
        if stats[name] >= value or time.monotonic() > deadline:
            return stats
        time.sleep(0.01)


def remote_config(name: str) -> Config:
    """hstu-tiny as runtime `name`, every user evicted from the device tier going to the remote tier."""
    return tiny_config(name=name, kv_cache={"host_pages": 0, "remote_read_budget_us": 200_000})


def returning_user(config, num_appended: int):
    """User 7's history (20 events), with `num_appended` more events appended, and 4 candidates."""
    from kvexport.model.batch import Batch, UserRequest, random_user

    first = random_user(config.model, torch.Generator().manual_seed(11), 7, 20, 4)
    later = random_user(config.model, torch.Generator().manual_seed(12), 7, num_appended, 4)
    return Batch.concat(
        [
            UserRequest(
                7,
                torch.cat([first.item_ids, later.item_ids]),
                torch.cat([first.action_ids, later.action_ids]),
                first.context_ids,
                later.candidate_ids if num_appended else first.candidate_ids,
            )
        ]
    )


def remote_worker(spec_json: str) -> None:
    """One serving process: scores user 7 through the eager model with the remote tier attached.

    Run by test_remote_tier.py in a fresh interpreter; prints its runtime stats and outputs as JSON.
    """
    from kvexport.model import build_model
    from kvexport.ops.manager import KVCacheManager

    spec = json.loads(spec_json)
    config = remote_config(spec["runtime"])
    model = build_model(config, seed=1)
    cache = KVCacheManager(config)
    kv.attach_remote(config.name, spec["url"], "on_evict")
    batch = returning_user(config, spec["num_appended"])
    with torch.no_grad():
        cached = CachedRanker(model).run(batch)
        full = model(batch)
    cache.evict_user(7)
    stats = wait_for(config.name, "remote_writes", 1)
    json.dump({"stats": stats, "cached": cached.tolist(), "full": full.tolist()}, sys.stdout)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """One redis-server on a free 127.0.0.1 port for the session (skips where there is none)."""
    need_redis()
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture
def redis(redis_server):
    """A client of the session's redis-server."""
    client = Resp(redis_server.port)
    yield client
    client.close()
