"""The remote tier against a real redis-server: sharing across processes, bad entries, a lost server."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

from kvexport.errors import UserError
from kvexport.ops import wrappers as kv
from kvexport.remote import WRITE_POLICIES, read_password_file, url_with_password
from tests.helpers import ROOT
from tests.helpers.network import free_port
from tests.helpers.remote import (
    BAD_PASSWORD_FILES,
    GatedProxy,
    LocalServer,
    RedisServer,
    Resp,
    need_redis,
    remote_config,
    wait_for,
    write_password_file,
)
from tests.helpers.runtime import kv_values, request, scratch_runtime, scratch_runtime_name

PAGE_SIZE = 2
# host_pages 0: every user evicted from the device tier goes on to the remote tier.
# remote_read_budget_us: generous, the suite may share its CPUs with builds.
CONFIG = json.dumps(
    {
        "num_layers": 2,
        "num_heads": 1,
        "head_dim": 2,
        "page_size": PAGE_SIZE,
        "device_pages": 8,
        "host_pages": 0,
        "dtype": "float32",
        "remote_read_budget_us": 200_000,
    }
)


def key(runtime: str, user_id: int) -> bytes:
    return f"kvexport:{runtime}:{user_id}".encode()


@pytest.fixture
def remote_runtime(redis_server):
    with scratch_runtime(CONFIG) as name:
        kv.attach_remote(name, redis_server.url, "on_evict")
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
        kv.attach_remote(name, redis_server.url, "on_evict")
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
        kv.attach_remote(name, redis_server.url, "after_batch")
        request(name, {1: [1, 2, 3], 2: [4, 5]}, config=CONFIG)
        request(name, {1: [1, 2, 3, 6]}, config=CONFIG)
        assert wait_for(name, "remote_writes", 3)["remote_writes"] == 3
        assert redis.command("EXISTS", key(name, 1)) == 1 and redis.command("EXISTS", key(name, 2)) == 1


def _flip_byte(value: bytes, index: int) -> bytes:
    return value[:index] + bytes([value[index] ^ 0x40]) + value[index + 1 :]


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
        kv.attach_remote(other, redis_server.url, "on_evict")
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
        assert not kv.attach_remote(name, url, "on_evict")
        assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
            f"remote tier {url} is unreachable; runtime '{name}' runs without it"
        ]
        assert request(name, {1: [1, 2, 3]}, config=CONFIG) == [0]
        kv.evict_user(name, 1)
        assert request(name, {1: [1, 2, 3]}, config=CONFIG) == [0]
        stats = kv.runtime_stats(name)
        assert (stats["remote_connected"], stats["remote_reads"], stats["remote_errors"]) == (0, 0, 0)
        assert kv.attach_remote(name, redis_server.url, "on_evict")  # a later attach may succeed
        assert kv.runtime_stats(name)["remote_connected"] == 1


@pytest.mark.parametrize(
    ("url", "policy", "message"),
    [
        ("http://127.0.0.1:6379", "on_evict", r"not of the form redis://\[\[user\]:password@\]host\[:port\]\[/db\]"),
        ("redis://127.0.0.1:70000", "on_evict", "port 70000 outside 1..65535"),
        ("redis://:topsecret@127.0.0.1:70000", "on_evict", r"'redis://\*\*\*@127.0.0.1:70000': port 70000"),
        ("redis://ann:@127.0.0.1", "on_evict", "names a user but no password"),
        ("redis://ann:top%4secret@127.0.0.1", "on_evict", "is not followed by two hex digits"),
        ("redis://ann:topsecret@127.0.0.1:6379", "sometimes", "write policy 'sometimes'"),
        ("redis://:@127.0.0.1", "on_evict", "gives an empty password"),
        ("redis://127.0.0.1/2147483648", "on_evict", "db 2147483648 outside 0..2147483647"),
        ("redis://127.0.0.1/99999999999999999999999", "on_evict", "db 99999999999999999999999 outside 0..2147483647"),
        # Malformed, yet the password is hidden all the same: all but the scheme, wherever a ':' or '@'
        # could set off a credential.
        ("redis://:a/topsecret@127.0.0.1:1", "on_evict", r"^remote URL 'redis://\*\*\*' is not of the form"),
        ("redis://:topsecret:127.0.0.1:6379", "on_evict", r"^remote URL 'redis://\*\*\*' is not of the form"),
        ("ann:topsecret@127.0.0.1:6379", "on_evict", r"^remote URL '\*\*\*' is not of the form"),
        ("redis:/:topsecret@127.0.0.1", "on_evict", r"^remote URL '\*\*\*' is not of the form"),
        ("redis://127.0.0.1/0?password=topsecret", "on_evict", r"^remote URL 'redis://\*\*\*' is not of the form"),
        ("redis://kv%3Atopsecret%40127.0.0.1", "on_evict", r"^remote URL 'redis://\*\*\*' is not of the form"),
        ("http://nohost/0", "on_evict", r"^remote URL 'http://nohost/0' is not of the form"),
    ],
)
def test_bad_remote_settings_are_refused(url, policy, message):
    with scratch_runtime(CONFIG) as name:
        with pytest.raises(ValueError, match=message) as refused:
            kv.attach_remote(name, url, policy)
        assert "topsecret" not in str(refused.value) and "top%4secret" not in str(refused.value)


def test_a_db_may_have_leading_zeros():
    with scratch_runtime(CONFIG) as name:
        assert not kv.attach_remote(name, f"redis://127.0.0.1:{free_port()}/00000000000001", "on_evict")


# ---- a server that wants a password ------------------------------------------------------------------

# '@', ':' and '/' in a password are percent-encoded in the URL.
PASSWORD = "s3:cr@t/pw"
ENCODED = "s3%3Acr%40t%2Fpw"


@pytest.fixture(scope="module")
def locked_server(tmp_path_factory):
    """A redis-server of its own that wants PASSWORD from the default user, and knows an ACL user
    'kv' (password 'kv-pw') allowed only kvexport's keys and one, 'mute', allowed no command."""
    need_redis()
    server = RedisServer(tmp_path_factory.mktemp("redis-auth"), extra=("--requirepass", PASSWORD)).start()
    admin = Resp(server.port)
    assert admin.command("AUTH", PASSWORD) == b"OK"
    assert admin.command("ACL", "SETUSER", "kv", "on", ">kv-pw", "~kvexport:*", "+@all") == b"OK"
    assert admin.command("ACL", "SETUSER", "mute", "on", ">wrong-pw-too", "-@all") == b"OK"
    admin.close()
    yield server
    server.stop()


def _evicted_user_comes_back(name: str) -> dict[str, int]:
    request(name, {1: [10, 11, 12]}, config=CONFIG)
    assert kv.evict_user(name, 1)
    wait_for(name, "remote_writes", 1)
    assert request(name, {1: [10, 11, 12, 13]}, config=CONFIG) == [3]
    return kv.runtime_stats(name)


@pytest.mark.parametrize("credentials", [f":{ENCODED}", f"default:{ENCODED}", "kv:kv-pw"])
def test_a_password_protected_server_serves_with_the_right_password(locked_server, credentials):
    with scratch_runtime(CONFIG) as name:
        assert kv.attach_remote(name, f"redis://{credentials}@127.0.0.1:{locked_server.port}/0", "on_evict")
        stats = _evicted_user_comes_back(name)
    assert (stats["remote_writes"], stats["remote_hits"], stats["remote_errors"]) == (1, 1, 0)


@pytest.mark.parametrize(
    ("credentials", "db", "reply"),
    [
        (":wrong-pw", 0, "WRONGPASS"),
        ("kv:wrong-pw", 0, "WRONGPASS"),
        ("", 0, "NOAUTH"),
        ("mute:wrong-pw-too", 0, "NOPERM"),  # a user that may not even PING
        (f":{ENCODED}", 99, "ERR DB index is out of range"),
    ],
)
def test_a_refused_password_is_an_error_at_attach_that_hides_it(locked_server, credentials, db, reply):
    url = f"redis://{credentials + '@' if credentials else ''}127.0.0.1:{locked_server.port}/{db}"
    with scratch_runtime(CONFIG) as name:
        shown = r"redis://\*\*\*@" if credentials else "redis://"
        with pytest.raises(
            ValueError, match=f"^remote tier {shown}127.0.0.1:{locked_server.port}/{db} refused the connection: {reply}"
        ) as refused:
            kv.attach_remote(name, url, "on_evict")
        secret = credentials.partition(":")[2]
        assert not [shown for shown in (secret, ENCODED, PASSWORD) if shown and shown in str(refused.value)]
        assert kv.runtime_stats(name)["remote_connected"] == 0  # no tier was attached
        assert kv.attach_remote(name, f"redis://:{ENCODED}@127.0.0.1:{locked_server.port}/0", "on_evict")


def test_a_reconnect_sends_the_password_again(locked_server):
    with scratch_runtime(CONFIG) as name:
        assert kv.attach_remote(name, f"redis://kv:kv-pw@127.0.0.1:{locked_server.port}", "on_evict")
        admin = Resp(locked_server.port)
        admin.command("AUTH", PASSWORD)
        assert admin.command("CLIENT", "KILL", "USER", "kv") >= 1  # the tier's connections, not the admin's
        admin.close()
        # The first read after the kill fails; one a backoff later reconnects, and only an
        # authenticated connection can serve the hit.
        deadline = time.monotonic() + 15
        hits = 0
        user = 1
        while hits == 0 and time.monotonic() < deadline:
            request(name, {user: [user, 7, 8]}, config=CONFIG)
            kv.evict_user(name, user)
            kv.flush_remote(name, 10_000)
            time.sleep(0.06)
            hits = request(name, {user: [user, 7, 8, 9]}, config=CONFIG)[0]
            user += 1
        stats = kv.runtime_stats(name)
    assert hits == 3
    assert stats["remote_reconnects"] >= 1 and stats["remote_errors"] >= 1


def _only_client(port: int, timeout_s: float = 10.0) -> Resp:
    """A client holding the only slot of a server started with maxclients 1 (once the server has
    seen the start-up probe's connection close)."""
    deadline = time.monotonic() + timeout_s
    while True:
        client = Resp(port)
        try:
            client.command("PING")
            return client
        except (RuntimeError, OSError):
            client.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_a_server_that_is_busy_at_attach_is_an_outage_not_a_refusal(tmp_path, caplog):
    """An error reply that is not about the settings ("ERR max number of clients reached" here;
    "LOADING" and "BUSY" alike) is a passing state: the runtime runs without the tier."""
    need_redis()
    server = RedisServer(tmp_path, extra=("--maxclients", "1")).start()
    try:
        holder = _only_client(server.port)
        with scratch_runtime(CONFIG) as name:
            assert not kv.attach_remote(name, server.url, "on_evict")
            assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
                f"remote tier {server.url} is unreachable; runtime '{name}' runs without it"
            ]
            holder.close()
            deadline = time.monotonic() + 10
            while not kv.attach_remote(name, server.url, "on_evict") and time.monotonic() < deadline:
                time.sleep(0.05)
            assert kv.runtime_stats(name)["remote_connected"] == 1
    finally:
        server.stop()


class ErrorServer(LocalServer):
    """A stand-in server that answers every command with one error reply."""

    def __init__(self, reply: str):
        self.reply = f"-{reply}\r\n".encode()
        super().__init__()

    def connected(self, client: socket.socket) -> None:
        threading.Thread(target=self._answer, args=(client,), daemon=True).start()

    def _answer(self, client: socket.socket) -> None:
        with client:
            while data := client.recv(65536):
                client.sendall(self.reply * data.count(b"*"))  # one reply per command (RESP arrays)


@pytest.mark.parametrize(
    ("db", "reply", "refused"),
    [
        (0, "DENIED Redis is running in protected mode because protected mode is enabled", True),
        (1, "ERR SELECT is not allowed in cluster mode", True),
        (0, "LOADING Redis is loading the dataset in memory", False),
        (0, "BUSY Redis is busy running a script", False),
    ],
)
def test_an_error_reply_at_attach_is_a_refusal_only_when_it_rejects_the_settings(db, reply, refused, caplog):
    server = ErrorServer(reply)
    url = f"redis://127.0.0.1:{server.port}/{db}"
    try:
        with scratch_runtime(CONFIG) as name:
            if refused:
                with pytest.raises(ValueError, match=f"^remote tier {url} refused the connection: {reply}"):
                    kv.attach_remote(name, url, "on_evict")
            else:
                assert not kv.attach_remote(name, url, "on_evict")
                assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
                    f"remote tier {url} is unreachable; runtime '{name}' runs without it"
                ]
            assert kv.runtime_stats(name)["remote_connected"] == 0
    finally:
        server.close()


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
        ("redis://kv:pw@127.0.0.1", "redis://***@127.0.0.1"),
        ("redis://:a/b@127.0.0.1:1", "redis://***@127.0.0.1:1"),
        ("kv:pw@127.0.0.1:6379", "***@127.0.0.1:6379"),
        ("redis:/:pw@127.0.0.1", "***@127.0.0.1"),
        ("pw:x://y@127.0.0.1", "***@127.0.0.1"),  # "pw:x" is no scheme
        ("redis://:p@w@[::1]:6379/2", "redis://***@[::1]:6379/2"),
    ],
)
def test_the_op_library_hides_credentials(url, shown):
    """The one statement of the rule (csrc/runtime/url_redaction.cpp), which Python calls."""
    assert kv.redact_url(url) == shown


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://kv:pw@127.0.0.1:70000", "redis://***@127.0.0.1:70000"),
        ("redis://:s3%40cr@[::1]:70000/2", "redis://***@[::1]:70000/2"),
        ("redis://127.0.0.1:70000", "redis://127.0.0.1:70000"),
    ],
)
def test_attach_remote_names_the_url_without_its_credentials(url, shown):
    with scratch_runtime(CONFIG) as name:
        with pytest.raises(ValueError) as refused:
            kv.attach_remote(name, url, "on_evict")
    assert str(refused.value) == f"remote URL '{shown}': port 70000 outside 1..65535"


def test_an_unreachable_server_is_logged_without_its_password(caplog):
    with scratch_runtime(CONFIG) as name:
        port = free_port()
        assert not kv.attach_remote(name, f"redis://kv:{ENCODED}@127.0.0.1:{port}", "on_evict")
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        f"remote tier redis://***@127.0.0.1:{port} is unreachable; runtime '{name}' runs without it"
    ]


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("remote_read_budget_us", 0, "remote_read_budget_us must be positive, got 0"),
        ("remote_ttl_s", -1, "remote_ttl_s must be positive, got -1"),
    ],
)
def test_bad_remote_config_is_refused(field, value, message):
    with pytest.raises(ValueError, match=message):
        with scratch_runtime(json.dumps({**json.loads(CONFIG), field: value})):
            pass


def test_python_write_policies_are_the_op_librarys():
    with scratch_runtime(CONFIG) as name:
        for policy in WRITE_POLICIES:  # accepted: only the server is missing
            assert not kv.attach_remote(name, f"redis://127.0.0.1:{free_port()}", policy)


def test_second_remote_tier_is_refused(remote_runtime, redis_server):
    with pytest.raises(ValueError, match="has a tier of this kind already"):
        kv.attach_remote(remote_runtime, redis_server.url, "on_evict")


def test_opcheck_attach_remote():
    """A management op: its schema declares no mutation of its inputs."""
    with scratch_runtime(CONFIG) as name:
        torch.library.opcheck(
            torch.ops.kvexport.attach_remote.default,
            (name, f"redis://127.0.0.1:{free_port()}", "on_evict"),
            test_utils=("test_schema",),
        )


def _in_thread(target, timeout_s: float) -> list:
    """Runs target in a thread; returns [result] or [] if it did not finish in time (a hang)."""
    result = []
    thread = threading.Thread(target=lambda: result.append(target()), daemon=True)
    thread.start()
    thread.join(timeout=timeout_s)
    return result


def test_lost_server_mid_run_recomputes_counts_errors_and_reconnects(tmp_path):
    need_redis()
    server = RedisServer(tmp_path).start()
    try:
        with scratch_runtime(CONFIG) as name:
            kv.attach_remote(name, server.url, "on_evict")
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


def test_a_remote_read_holds_neither_the_runtime_nor_the_gil(redis_server):
    config = json.dumps({**json.loads(CONFIG), "remote_read_budget_us": 10_000_000})
    proxy = GatedProxy(redis_server.port)
    try:
        with scratch_runtime(config) as name:
            assert kv.attach_remote(name, f"redis://127.0.0.1:{proxy.port}", "on_evict")
            request(name, {1: [1, 2, 3, 4, 5]}, config=config)
            kv.evict_user(name, 1)
            assert kv.flush_remote(name, 10_000)
            request(name, {2: [7, 8]}, config=config)  # stays on the device tier: no remote read
            proxy.gate.clear()
            returning: list = []
            reader = threading.Thread(
                target=lambda: returning.append(request(name, {1: [1, 2, 3, 4, 5, 6]}, config=config)), daemon=True
            )
            reader.start()
            assert proxy.mget_seen.wait(timeout=10)  # forwarded by a Python thread: the GIL is free
            # While user 1's read waits on the server, another request has the runtime.
            assert _in_thread(lambda: request(name, {2: [7, 8, 9]}, config=config), timeout_s=10) == [[2]]
            proxy.gate.set()
            reader.join(timeout=30)
            assert returning == [[5]]
            stats = kv.runtime_stats(name)
            assert (stats["remote_hits"], stats["remote_hit_tokens"], stats["remote_errors"]) == (1, 5, 0)
    finally:
        proxy.close()


@pytest.mark.parametrize(("ttl_s", "expected"), [(100, range(1, 101)), (0, [-1])])
def test_entries_expire_after_the_configured_ttl(redis_server, redis, ttl_s, expected):
    config = json.dumps({**json.loads(CONFIG), "remote_ttl_s": ttl_s})
    with scratch_runtime(config) as name:
        kv.attach_remote(name, redis_server.url, "on_evict")
        request(name, {1: [1, 2, 3]}, config=config)
        kv.evict_user(name, 1)
        assert kv.flush_remote(name, 10_000)
        assert redis.command("TTL", key(name, 1)) in expected  # -1: no expiry


def test_flush_waits_for_queued_writes(remote_runtime, redis):
    for user in range(1, 5):
        request(remote_runtime, {user: [user, user + 1, user + 2]}, config=CONFIG)
        kv.evict_user(remote_runtime, user)
    assert kv.flush_remote(remote_runtime, 10_000)
    assert kv.runtime_stats(remote_runtime)["remote_writes"] == 4
    assert all(redis.command("EXISTS", key(remote_runtime, user)) == 1 for user in range(1, 5))
    with pytest.raises(ValueError, match="flush timeout must be >= 0 ms, got -1"):
        kv.flush_remote(remote_runtime, -1)


# ---- two processes sharing one server ----------------------------------------------------------------


def _run_worker(spec: dict) -> dict:
    code = "import sys; from tests.helpers.remote import remote_worker; remote_worker(sys.argv[1])"
    result = subprocess.run(
        [sys.executable, "-c", code, json.dumps(spec)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


def test_a_user_scored_in_one_process_is_a_remote_hit_in_another(redis_server):
    runtime = f"remote-{scratch_runtime_name()}"
    first = _run_worker({"url": redis_server.url, "runtime": runtime, "num_appended": 0})
    first_stats = first["stats"]
    # A prefix is the context tokens, then an item and an action token per event.
    num_cached_tokens = remote_config(runtime).model.num_contextual_features + 2 * 20
    assert (first_stats["hit_tokens"], first_stats["recomputed_tokens"]) == (0, num_cached_tokens)
    assert (first_stats["remote_misses"], first_stats["remote_writes"]) == (1, 1)

    second = _run_worker({"url": redis_server.url, "runtime": runtime, "num_appended": 5})
    stats = second["stats"]
    assert (stats["remote_hits"], stats["remote_hit_tokens"], stats["hit_tokens"]) == (
        1,
        num_cached_tokens,
        num_cached_tokens,
    )
    assert stats["recomputed_tokens"] == 2 * 5
    assert stats["remote_rejected_runtime"] + stats["remote_rejected_checksum"] + stats["remote_rejected_format"] == 0
    cached, full = torch.tensor(second["cached"]), torch.tensor(second["full"])
    assert cached.shape[0] == 4 and cached.shape == full.shape
    assert torch.allclose(cached, full, rtol=0, atol=1e-4)


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("redis://127.0.0.1:6379/2", "redis://:a%3Ab%40c%2Fd%25e@127.0.0.1:6379/2"),
        ("redis://kv@127.0.0.1", "redis://kv:a%3Ab%40c%2Fd%25e@127.0.0.1"),
        ("redis://[::1]:6379", "redis://:a%3Ab%40c%2Fd%25e@[::1]:6379"),
    ],
)
def test_a_password_added_to_a_url_is_percent_encoded(url, expected):
    assert url_with_password(url, "a:b@c/d%e") == expected


def test_a_url_with_a_password_takes_no_second_one():
    with pytest.raises(UserError, match="holds a password already"):
        url_with_password("redis://kv:pw@127.0.0.1", "other")


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("pw\n", "pw"),
        ("pw\r\n", "pw"),
        ("pw", "pw"),
        (" pw \n", " pw "),
        ("p\u00e4ss\n", "p\u00e4ss"),
    ],
)
def test_a_password_file_loses_one_trailing_newline(tmp_path, content, expected):
    (tmp_path / "pw").write_bytes(content.encode())
    assert read_password_file(tmp_path / "pw") == expected


@pytest.mark.parametrize(("content", "message"), BAD_PASSWORD_FILES)
def test_a_bad_password_file_is_refused_by_name(tmp_path, content, message):
    path = write_password_file(tmp_path / "pw", content)
    with pytest.raises(UserError) as refused:
        read_password_file(path)
    assert message in str(refused.value) and str(refused.value).count(path) == 1
    if "symbolic links" not in message:
        assert str(refused.value) == f"the remote tier's password file {path} {message}"


def test_a_password_file_may_fill_its_4_kib(tmp_path):
    (tmp_path / "pw").write_bytes(b"x" * 4095 + b"\n")
    assert read_password_file(tmp_path / "pw") == "x" * 4095
    (tmp_path / "pw").write_bytes(b"x" * 4096)
    assert read_password_file(tmp_path / "pw") == "x" * 4096
