"""The remote tier against a real redis-server: sharing across processes, bad entries, a lost server."""

from __future__ import annotations

import copy
import json
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml

from kvexport.ops import wrappers as kv
from tests.conftest import ROOT, TINY, scratch_runtime, scratch_runtime_name
from tests.test_runtime import kv_values, request

PAGE_SIZE = 2
# host_pages 0: every user evicted from the device tier goes on to the remote tier.
CONFIG = json.dumps({"num_layers": 2, "num_heads": 1, "head_dim": 2, "page_size": PAGE_SIZE,
                     "device_pages": 8, "host_pages": 0, "dtype": "float32"})
READ_BUDGET_US = 200_000  # generous: the suite shares two cores with builds


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

    def __init__(self, directory: Path, port: int | None = None):
        self.directory = directory
        self.port = port or free_port()
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "RedisServer":
        self.process = subprocess.Popen(
            [shutil.which("redis-server"), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.directory), "--logfile", str(self.directory / "redis.log")],
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


def _need_redis() -> None:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (Debian package redis-server)")
    try:
        kv.attach_remote("kvexport-probe-no-such-runtime", "redis://127.0.0.1:1", "on_evict", READ_BUDGET_US)
    except ValueError as exc:
        if "without hiredis" in str(exc):
            pytest.skip("the op library was built without hiredis (libhiredis-dev)")


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    _need_redis()
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture
def redis(redis_server):
    client = Resp(redis_server.port)
    yield client
    client.close()


def key(runtime: str, user_id: int) -> bytes:
    return f"kvexport:{runtime}:{user_id}".encode()


def wait_for(runtime: str, name: str, value: int, timeout_s: float = 10.0) -> dict[str, int]:
    """Polls the runtime's stats until counter `name` reaches `value` (the writer is asynchronous)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = kv.runtime_stats(runtime)
        if stats[name] >= value or time.monotonic() > deadline:
            return stats
        time.sleep(0.01)


@pytest.fixture
def remote_runtime(redis_server):
    with scratch_runtime(CONFIG) as name:
        kv.attach_remote(name, redis_server.url, "on_evict", READ_BUDGET_US)
        yield name


# ---- in one process: what a hit is, and what is never served --------------------------------------

def test_evicted_user_comes_back_from_the_remote_tier_bit_exact(remote_runtime):
    tokens = [10, 11, 12, 13, 14]
    request(remote_runtime, {1: tokens}, config=CONFIG)
    assert kv.evict_user(remote_runtime, 1)
    assert wait_for(remote_runtime, "remote_writes", 1)["remote_writes"] == 1
    assert kv.cached_length(remote_runtime, 1) == 0  # not in either local tier
    assert request(remote_runtime, {1: tokens + [15]}, config=CONFIG) == [5]
    stats = kv.runtime_stats(remote_runtime)
    assert (stats["remote_hits"], stats["remote_hit_tokens"], stats["hit_tokens"]) == (1, 5, 5)
    assert (stats["recomputed_tokens"], stats["onboards"], stats["host_evictions"]) == (5 + 1, 1, 1)
    stored = kv.read_user_kv(remote_runtime, 1)
    for layer in range(2):
        assert torch.equal(stored[layer, 0], kv_values(tokens + [15], layer))
        assert torch.equal(stored[layer, 1], kv_values(tokens + [15], layer))
    assert stats["remote_bytes_in"] == stats["remote_bytes_out"] > 2 * 2 * 3 * PAGE_SIZE * 2 * 4
    assert stats["remote_connected"] == 1 and stats["remote_errors"] == 0


def test_host_tier_lets_its_least_recent_user_go_to_the_remote_tier(redis_server):
    config = CONFIG.replace('"host_pages": 0', '"host_pages": 2')
    with scratch_runtime(config) as name:
        kv.attach_remote(name, redis_server.url, "on_evict", READ_BUDGET_US)
        request(name, {1: [1, 2, 3], 2: [4, 5, 6]}, config=config)  # 2 pages each
        kv.evict_user(name, 1)
        kv.evict_user(name, 2)  # the host tier (2 pages) lets user 1 go
        stats = wait_for(name, "remote_writes", 1)
        assert (stats["offloads"], stats["host_evictions"], stats["host_users"]) == (2, 1, 1)
        assert (kv.cached_length(name, 1), kv.cached_length(name, 2)) == (0, 3)
        assert request(name, {1: [1, 2, 3, 7], 2: [4, 5, 6, 8]}, config=config) == [3, 3]
        stats = kv.runtime_stats(name)
        assert (stats["onboards"], stats["remote_hits"], stats["remote_hit_tokens"]) == (2, 1, 3)
        assert stats["remote_writes"] == 1
        assert torch.equal(kv.read_user_kv(name, 1)[1, 1], kv_values([1, 2, 3, 7], 1))


def test_unknown_user_is_a_miss(remote_runtime):
    assert request(remote_runtime, {42: [1, 2, 3]}, config=CONFIG) == [0]
    stats = kv.runtime_stats(remote_runtime)
    assert (stats["remote_misses"], stats["remote_hits"], stats["remote_reads"]) == (1, 0, 1)


def test_a_batch_reads_its_absent_users_in_one_round_trip(remote_runtime):
    request(remote_runtime, {1: [1, 2, 3], 2: [4, 5, 6, 7]}, config=CONFIG)
    kv.evict_user(remote_runtime, 1)
    kv.evict_user(remote_runtime, 2)
    wait_for(remote_runtime, "remote_writes", 2)
    reads = kv.runtime_stats(remote_runtime)["remote_reads"]
    assert request(remote_runtime, {2: [4, 5, 6, 7, 8], 3: [9], 1: [1, 2, 3]}, config=CONFIG) == [4, 0, 3]
    stats = kv.runtime_stats(remote_runtime)
    assert stats["remote_reads"] == reads + 1
    assert (stats["remote_hits"], stats["remote_hit_tokens"]) == (2, 7)
    assert stats["remote_misses"] == 2 + 1  # users 1 and 2 when first seen, then user 3


def test_diverged_entry_serves_only_the_common_prefix(remote_runtime):
    request(remote_runtime, {1: [10, 11, 12, 13, 14]}, config=CONFIG)
    request(remote_runtime, {2: [20, 21, 22]}, config=CONFIG)
    kv.evict_user(remote_runtime, 1)
    kv.evict_user(remote_runtime, 2)
    wait_for(remote_runtime, "remote_writes", 2)
    assert request(remote_runtime, {1: [10, 11, 12, 99, 14]}, config=CONFIG) == [3]
    assert request(remote_runtime, {2: [99, 21, 22]}, config=CONFIG) == [0]
    stats = kv.runtime_stats(remote_runtime)
    assert (stats["remote_hits"], stats["remote_hit_tokens"], stats["remote_rejected_prefix"]) == (1, 3, 1)
    assert torch.equal(kv.read_user_kv(remote_runtime, 1)[1, 0], kv_values([10, 11, 12, 99, 14], 1))
    assert torch.equal(kv.read_user_kv(remote_runtime, 2)[0, 1], kv_values([99, 21, 22], 0))


def test_after_batch_writes_every_committed_user(redis_server, redis):
    with scratch_runtime(CONFIG) as name:
        kv.attach_remote(name, redis_server.url, "after_batch", READ_BUDGET_US)
        request(name, {1: [1, 2, 3], 2: [4, 5]}, config=CONFIG)
        request(name, {1: [1, 2, 3, 6]}, config=CONFIG)
        assert wait_for(name, "remote_writes", 3)["remote_writes"] == 3
        assert redis.command("EXISTS", key(name, 1)) == 1 and redis.command("EXISTS", key(name, 2)) == 1


def _flip_byte(value: bytes, index: int) -> bytes:
    return value[:index] + bytes([value[index] ^ 0x40]) + value[index + 1:]


def test_bad_entries_are_misses_counted_by_reason_and_never_served(remote_runtime, redis_server, redis):
    tokens = {user: [user * 10 + i for i in range(5)] for user in (1, 2, 3)}
    for user, ts in tokens.items():
        request(remote_runtime, {user: ts}, config=CONFIG)
        kv.evict_user(remote_runtime, user)
    assert wait_for(remote_runtime, "remote_writes", 3)["remote_writes"] == 3
    good = redis.command("GET", key(remote_runtime, 1))
    redis.command("SET", key(remote_runtime, 1), _flip_byte(good, len(good) - 20))  # a k/v byte
    entry = redis.command("GET", key(remote_runtime, 2))
    redis.command("SET", key(remote_runtime, 2), entry[: len(entry) // 2])
    redis.command("SET", key(remote_runtime, 3), b"not an entry")
    with scratch_runtime(CONFIG) as other:  # same config, another runtime name
        kv.attach_remote(other, redis_server.url, "on_evict", READ_BUDGET_US)
        redis.command("SET", key(other, 1), good)
        assert request(other, {1: tokens[1]}, config=CONFIG) == [0]
        assert kv.runtime_stats(other)["remote_rejected_runtime"] == 1
    for user, ts in tokens.items():
        assert request(remote_runtime, {user: ts}, config=CONFIG) == [0]
        assert torch.equal(kv.read_user_kv(remote_runtime, user)[0, 0], kv_values(ts, 0))
    stats = kv.runtime_stats(remote_runtime)
    assert (stats["remote_rejected_checksum"], stats["remote_rejected_format"]) == (1, 2)
    assert (stats["remote_hits"], stats["remote_hit_tokens"], stats["hit_tokens"]) == (0, 0, 0)
    assert stats["remote_errors"] == 0


def test_unreachable_server_at_start_runs_without_the_tier(redis_server, caplog):
    with scratch_runtime(CONFIG) as name:
        url = f"redis://127.0.0.1:{free_port()}"
        assert not kv.attach_remote(name, url, "on_evict", READ_BUDGET_US)
        assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
            f"remote tier {url} is unreachable; runtime '{name}' runs without it"]
        assert request(name, {1: [1, 2, 3]}, config=CONFIG) == [0]
        kv.evict_user(name, 1)
        assert request(name, {1: [1, 2, 3]}, config=CONFIG) == [0]
        stats = kv.runtime_stats(name)
        assert (stats["remote_connected"], stats["remote_reads"], stats["remote_errors"]) == (0, 0, 0)
        assert kv.attach_remote(name, redis_server.url, "on_evict", READ_BUDGET_US)  # a later attach may succeed
        assert kv.runtime_stats(name)["remote_connected"] == 1


@pytest.mark.parametrize(("url", "policy", "budget", "message"), [
    ("http://127.0.0.1:6379", "on_evict", 1000, "not of the form redis://host"),
    ("redis://127.0.0.1:70000", "on_evict", 1000, "port 70000 outside 1..65535"),
    ("redis://127.0.0.1:6379", "sometimes", 1000, "write policy 'sometimes'"),
    ("redis://127.0.0.1:6379", "on_evict", 0, "read budget must be positive, got 0 us"),
])
def test_bad_remote_settings_are_refused(url, policy, budget, message):
    with scratch_runtime(CONFIG) as name:
        with pytest.raises(ValueError, match=message):
            kv.attach_remote(name, url, policy, budget)


def test_second_remote_tier_is_refused(remote_runtime, redis_server):
    with pytest.raises(ValueError, match="has a tier of this kind already"):
        kv.attach_remote(remote_runtime, redis_server.url, "on_evict", READ_BUDGET_US)


def test_opcheck_attach_remote():
    """A management op: its schema declares no mutation of its inputs."""
    with scratch_runtime(CONFIG) as name:
        torch.library.opcheck(torch.ops.kvexport.attach_remote.default,
                              (name, f"redis://127.0.0.1:{free_port()}", "on_evict", 1000),
                              test_utils=("test_schema",))


def _in_thread(target, timeout_s: float) -> list:
    """Runs target in a thread; returns [result] or [] if it did not finish in time (a hang)."""
    result = []
    thread = threading.Thread(target=lambda: result.append(target()), daemon=True)
    thread.start()
    thread.join(timeout=timeout_s)
    return result


def test_lost_server_mid_run_recomputes_counts_errors_and_reconnects(tmp_path):
    _need_redis()
    server = RedisServer(tmp_path).start()
    try:
        with scratch_runtime(CONFIG) as name:
            kv.attach_remote(name, server.url, "on_evict", READ_BUDGET_US)
            request(name, {1: [1, 2, 3]}, config=CONFIG)
            kv.evict_user(name, 1)
            wait_for(name, "remote_writes", 1)
            server.stop()

            def requests_while_down():
                return [request(name, {user: [1, 2, 3]}, config=CONFIG) for user in (1, 2, 3)]

            assert _in_thread(requests_while_down, timeout_s=30) == [[[0], [0], [0]]]
            kv.evict_user(name, 2)
            stats = wait_for(name, "remote_errors", 2)
            assert stats["remote_errors"] >= 2  # at least the first failed read and the failed write
            assert (stats["remote_hits"], stats["remote_connected"]) == (0, 0)
            assert stats["remote_misses"] == 1 + 3  # user 1's first, cold request was a miss too

            server.start()  # same port, empty: the tier reconnects after its backoff

            def reconnect():
                deadline = time.monotonic() + 15
                while kv.runtime_stats(name)["remote_connected"] == 0 and time.monotonic() < deadline:
                    request(name, {4: [4, 4]}, config=CONFIG)
                    kv.evict_user(name, 4)
                    time.sleep(0.05)
                return kv.runtime_stats(name)["remote_connected"]

            assert _in_thread(reconnect, timeout_s=30) == [1]
            writes = kv.runtime_stats(name)["remote_writes"]
            request(name, {5: [5, 6, 7]}, config=CONFIG)
            kv.evict_user(name, 5)
            wait_for(name, "remote_writes", writes + 1)
            assert request(name, {5: [5, 6, 7, 8]}, config=CONFIG) == [3]
            assert kv.runtime_stats(name)["remote_hits"] == 1
    finally:
        server.stop()


# ---- two processes sharing one server ----------------------------------------------------------------

def _eager_config(name: str):
    from kvexport.config import config_from_dict

    raw = copy.deepcopy(yaml.safe_load(TINY.read_text()))
    raw["name"] = name
    raw["kv_cache"]["host_pages"] = 0
    return config_from_dict(raw)


def _returning_user(config, num_appended: int):
    """User 7's history (20 events), with `num_appended` more events appended, and 4 candidates."""
    from kvexport.model.batch import Batch, UserRequest, random_user

    first = random_user(config.model, torch.Generator().manual_seed(11), 7, 20, 4)
    later = random_user(config.model, torch.Generator().manual_seed(12), 7, num_appended, 4)
    return Batch.concat([UserRequest(7, torch.cat([first.item_ids, later.item_ids]),
                                     torch.cat([first.action_ids, later.action_ids]), first.context_ids,
                                     later.candidate_ids if num_appended else first.candidate_ids)])


def remote_worker(spec_json: str) -> None:
    """One serving process: scores user 7 through the eager model with the remote tier attached.

    Run by the test in a fresh interpreter; prints its runtime stats and outputs as JSON.
    """
    from kvexport.model import build_model
    from kvexport.ops.manager import KVCacheManager

    spec = json.loads(spec_json)
    config = _eager_config(spec["runtime"])
    model = build_model(config, seed=1)
    cache = KVCacheManager(config)
    kv.attach_remote(config.name, spec["url"], "on_evict", READ_BUDGET_US)
    batch = _returning_user(config, spec["num_appended"])
    with torch.no_grad():
        cached = model.forward_cached(batch)
        full = model(batch)
    cache.evict_user(7)
    stats = wait_for(config.name, "remote_writes", 1)
    json.dump({"stats": stats, "cached": cached.tolist(), "full": full.tolist()}, sys.stdout)


def _run_worker(spec: dict) -> dict:
    code = "import sys; from tests.test_remote_tier import remote_worker; remote_worker(sys.argv[1])"
    result = subprocess.run([sys.executable, "-c", code, json.dumps(spec)], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


def test_a_user_scored_in_one_process_is_a_remote_hit_in_another(redis_server):
    runtime = f"remote-{scratch_runtime_name()}"
    first = _run_worker({"url": redis_server.url, "runtime": runtime, "num_appended": 0})
    first_stats = first["stats"]
    # A prefix is the context tokens, then an item and an action token per event.
    num_cached_tokens = _eager_config(runtime).model.num_contextual_features + 2 * 20
    assert (first_stats["hit_tokens"], first_stats["recomputed_tokens"]) == (0, num_cached_tokens)
    assert (first_stats["remote_misses"], first_stats["remote_writes"]) == (1, 1)

    second = _run_worker({"url": redis_server.url, "runtime": runtime, "num_appended": 5})
    stats = second["stats"]
    assert (stats["remote_hits"], stats["remote_hit_tokens"], stats["hit_tokens"]) == (1, num_cached_tokens,
                                                                                       num_cached_tokens)
    assert stats["recomputed_tokens"] == 2 * 5
    assert stats["remote_rejected_runtime"] + stats["remote_rejected_checksum"] + stats["remote_rejected_format"] == 0
    cached, full = torch.tensor(second["cached"]), torch.tensor(second["full"])
    assert cached.shape[0] == 4 and cached.shape == full.shape
    assert torch.allclose(cached, full, rtol=0, atol=1e-4)
