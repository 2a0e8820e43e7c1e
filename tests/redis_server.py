"""A redis-server of a test's own on 127.0.0.1 (Debian's redis-server), and a minimal client."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from kvexport.ops import wrappers as kv


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
        value, self.buffer = self.buffer[:size], self.buffer[size + 2:]
        return value


class RedisServer:
    """A redis-server of the test's own on 127.0.0.1, with no persistence."""

    def __init__(self, directory: Path, port: int | None = None, extra: tuple[str, ...] = ()):
        self.directory = directory
        self.port = port or free_port()
        self.extra = extra  # more redis-server options, e.g. ("--maxmemory", "4mb")
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "RedisServer":
        self.process = subprocess.Popen(
            [shutil.which("redis-server"), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.directory), "--logfile", str(self.directory / "redis.log"),
             *self.extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                client = Resp(self.port)
                client.command("PING")
                client.close()
                return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis-server did not answer on port {self.port}; see {self.directory / 'redis.log'}")

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait(timeout=10)
            self.process = None


def need_redis() -> None:
    """Skips the test where the remote tier cannot run: `make setup` names what to install."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (Debian/Ubuntu: apt-get install redis-server libhiredis-dev)")
    try:
        kv.attach_remote("kvexport-probe-no-such-runtime", "redis://127.0.0.1:1", "on_evict")
    except ValueError as exc:
        if "without the remote tier" in str(exc):
            pytest.skip("the op library was built without the remote tier (install libhiredis-dev)")
