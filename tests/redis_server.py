"""The tests' redis-server (kvexport.bench.remote.RedisServer, on 127.0.0.1) and a minimal client."""

from __future__ import annotations

import shutil
import socket

import pytest

from kvexport.bench.remote import RedisServer, free_port  # noqa: F401 (the tests' too)
from kvexport.ops import wrappers as kv


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


def need_redis() -> None:
    """Skips the test where the remote tier cannot run: `make setup` names what to install."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (Debian/Ubuntu: apt-get install redis-server libhiredis-dev)")
    try:
        kv.attach_remote("kvexport-probe-no-such-runtime", "redis://127.0.0.1:1", "on_evict")
    except ValueError as exc:
        if "without the remote tier" in str(exc):
            pytest.skip("the op library was built without the remote tier (install libhiredis-dev)")
