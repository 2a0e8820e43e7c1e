"""A package with the remote tier, as a fleet runs it: kvexport.load(remote=...), the CLI's --remote, the
C++ harness, and soaks of two processes sharing one real redis-server (also while it is killed, and
while it is full). Every output is checked against the eager model's float32 full recompute."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import kvexport
from kvexport.errors import UserError
from kvexport.model.batch import random_user
from kvexport.ops import wrappers as kv
from kvexport.remote import read_password_file
from kvexport.trace.record import reference_model
from kvexport.trace.replay import replay_command
from tests.helpers import ROOT
from tests.helpers.network import free_port
from tests.helpers.remote import BAD_PASSWORD_FILES, GatedProxy, RedisServer, Resp, need_redis, write_password_file

SOAK_TIMEOUT_S = 300


def user_request(config, user_id: int, num_events: int, seed: int) -> dict:
    u = random_user(config.model, torch.Generator().manual_seed(seed), user_id, num_events, 4)
    return {
        "user_id": user_id,
        "item_ids": u.item_ids,
        "action_ids": u.action_ids,
        "context_ids": u.context_ids,
        "candidate_ids": u.candidate_ids,
    }


def grown(request: dict, extra: dict) -> dict:
    """The same user with extra's events appended (and extra's candidates)."""
    return {
        **request,
        "item_ids": torch.cat([request["item_ids"], extra["item_ids"]]),
        "action_ids": torch.cat([request["action_ids"], extra["action_ids"]]),
        "candidate_ids": extra["candidate_ids"],
    }


def full_recompute(model, pkg, request: dict) -> torch.Tensor:
    from kvexport.host.requests import check_user_request
    from kvexport.model.batch import Batch

    with torch.no_grad():
        return reference_model(model)(Batch.concat([check_user_request(request, pkg.config, 0)]))


# ---- kvexport.load(remote=...) -----------------------------------------------------------------------


def test_load_with_remote_serves_a_returning_user_from_it_and_close_flushes(
    tiny_artifact, tiny_checkpoint, redis_server, redis, tiny_config
):
    from kvexport.trace.soak import eager_model_for

    first = user_request(tiny_config, 900_001, 40, seed=1)
    later = grown(first, user_request(tiny_config, 900_001, 6, seed=2))
    with kvexport.load(tiny_artifact, remote=redis_server.url, remote_write="after_batch") as pkg:
        assert pkg.remote == redis_server.url
        pkg.score_users([first])
        runtime = pkg.runtime_name
    # close() flushed the write: the entry is there now.
    assert redis.command("EXISTS", f"kvexport:{runtime}:900001") == 1
    with kvexport.load(tiny_artifact, remote=redis_server.url) as pkg:  # an empty runtime: a new host
        (logits,) = pkg.score_users([later])
        stats = pkg.stats()
        model = eager_model_for(pkg.artifact, tiny_checkpoint)
    prefix = tiny_config.model.num_contextual_features + 2 * 40
    assert (stats["remote_hits"], stats["remote_hit_tokens"], stats["hit_tokens"]) == (1, prefix, prefix)
    assert stats["recomputed_tokens"] == 2 * 6
    assert stats["remote_bytes_in"] > 0 and stats["remote_read_us"] > 0
    for name in ("remote_misses", "remote_rejected", "remote_write_drops", "remote_errors", "remote_bytes_out"):
        assert name in stats
    assert torch.allclose(logits, full_recompute(model, pkg, later), rtol=0, atol=pkg.artifact.tolerance["atol"])


def test_a_remote_read_inside_a_package_releases_the_gil_and_the_runtime(tiny_artifact, redis_server, tiny_config):
    """The AOTInductor runner calls the package holding the GIL; the read must not keep it (a read
    that did would time out: the proxy could not forward it)."""
    returning_user = user_request(tiny_config, 900_011, 30, seed=3)
    resident = user_request(tiny_config, 900_012, 10, seed=4)
    proxy = GatedProxy(redis_server.port)
    try:
        with kvexport.load(tiny_artifact, remote=f"redis://127.0.0.1:{proxy.port}", remote_write="after_batch") as pkg:
            pkg.score_users([returning_user])
            assert kv.flush_remote(pkg.runtime_name, 10_000)
            kv.reset_runtime(pkg.runtime_name)  # this host forgets the user; the server keeps it
            pkg.score_users([resident])
            proxy.gate.clear()
            reader = threading.Thread(target=pkg.score_users, args=([returning_user],), daemon=True)
            reader.start()
            # The proxy's Python thread saw the read, so the GIL is free; the runtime is free too (the
            # package's one AOTInductor runner is not: this process scores one request at a time).
            assert proxy.mget_seen.wait(timeout=10)
            assert pkg.stats()["remote_hits"] == 0
            proxy.gate.set()
            reader.join(timeout=30)
            stats = pkg.stats()
    finally:
        proxy.close()
    assert (stats["remote_hits"], stats["remote_errors"]) == (1, 0)


def test_bad_remote_url_is_one_line_and_leaves_no_runtime(tiny_artifact):
    with pytest.raises(
        UserError,
        match=r"^remote URL 'http://x' is not of the form "
        r"redis://\[\[user\]:password@\]host\[:port\]\[/db\]$",
    ):
        kvexport.load(tiny_artifact, remote="http://x")
    runtime = json.loads((tiny_artifact / "manifest.json").read_text())["runtime_name"]
    with pytest.raises(ValueError, match="no KV runtime named"):
        kv.runtime_stats(runtime)


def test_a_password_in_the_url_is_never_shown(tiny_artifact, tmp_path):
    need_redis()
    server = RedisServer(tmp_path, extra=("--requirepass", "pkg-pw")).start()
    try:
        refused = f"redis://:not-the-pw@127.0.0.1:{server.port}/0"
        with pytest.raises(
            UserError,
            match=f"^remote tier redis://\\*\\*\\*@127.0.0.1:{server.port}/0 refused the connection: WRONGPASS",
        ) as error:
            kvexport.load(tiny_artifact, remote=refused)
        assert "not-the-pw" not in str(error.value)
        with kvexport.load(tiny_artifact, remote=f"redis://:pkg-pw@127.0.0.1:{server.port}/0") as pkg:
            assert pkg.remote == f"redis://***@127.0.0.1:{server.port}/0"
        harness = kvexport_cli("replay", str(tiny_artifact), "--remote", refused)
        assert harness.returncode == 2 and "not-the-pw" not in harness.stderr
        assert harness.stderr.strip().startswith(f"error: remote tier redis://***@127.0.0.1:{server.port}/0 refused")
    finally:
        server.stop()


def test_bad_write_policy_is_refused_before_loading(tiny_artifact, monkeypatch):
    monkeypatch.setattr("torch._inductor.aoti_load_package", lambda *a, **k: pytest.fail("loaded"))
    with pytest.raises(UserError, match="^remote_write 'sometimes': expected one of on_evict, after_batch$"):
        kvexport.load(tiny_artifact, remote="redis://127.0.0.1:6379", remote_write="sometimes")


def test_unreachable_server_at_load_runs_without_the_tier_and_says_so_once(tiny_artifact, tiny_config, caplog):
    url = f"redis://127.0.0.1:{free_port()}"
    with kvexport.load(tiny_artifact, remote=url) as pkg:
        assert pkg.remote is None
        pkg.score_users([user_request(tiny_config, 900_021, 8, seed=5)])
        assert pkg.stats()["remote_reads"] == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == [f"remote tier {url} is unreachable; runtime '{pkg.runtime_name}' runs without it"]


def test_op_library_without_the_remote_tier_is_one_line(tiny_artifact, monkeypatch):
    def built_without(*args):
        raise ValueError(
            "this op library was built without the remote tier (hiredis was not found when it was "
            "built); install libhiredis-dev\nException raised from attach_remote"
        )

    monkeypatch.setattr(kv, "attach_remote", built_without)
    with pytest.raises(UserError, match=r"^this op library was built without the remote tier .*libhiredis-dev$"):
        kvexport.load(tiny_artifact, remote="redis://127.0.0.1:6379")


# ---- the CLI and the C++ harness ------------------------------------------------------------------------


def kvexport_cli(*args: str, timeout: float = SOAK_TIMEOUT_S, **popen) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvexport", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, **popen
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--remote", "redis://h:99999"], "error: remote URL 'redis://h:99999': port 99999 outside 1..65535"),
        (
            ["--remote", "redis://127.0.0.1:6379", "--remote-write", "never"],
            "error: --remote-write 'never': expected one of on_evict, after_batch",
        ),
    ],
)
def test_run_with_a_bad_remote_is_one_line_and_writes_nothing(tiny_artifact, tmp_path, args, message):
    step = torch.load(tiny_artifact / "trace" / "step_0000.pt", weights_only=True)
    torch.save([{k: v for k, v in step.items() if not k.startswith("expected")}], tmp_path / "requests.pt")
    result = kvexport_cli(
        "run",
        str(tiny_artifact),
        "--requests",
        str(tmp_path / "requests.pt"),
        "--output",
        str(tmp_path / "out.pt"),
        *args,
    )
    assert (result.returncode, result.stderr.strip()) == (2, message)
    assert not (tmp_path / "out.pt").exists()


def test_soak_route_must_name_a_process_of_n(tiny_artifact):
    result = kvexport_cli("soak", str(tiny_artifact), "--route", "2/2")
    assert (result.returncode, result.stderr.strip()) == (2, "error: --route must be I/N with 0 <= I < N, got 2/2")


def test_replay_harness_shares_the_trace_through_the_remote_tier(tiny_artifact, redis_server, tmp_path):
    report_path = tmp_path / "replay.json"
    result = kvexport_cli(
        "replay",
        str(tiny_artifact),
        "--repeat",
        "2",
        "--remote",
        redis_server.url,
        "--remote-write",
        "after_batch",
        "--json",
        str(report_path),
    )
    assert result.returncode == 0, result.stderr[-2000:]
    counters = json.loads(report_path.read_text())["counters"]  # of the second pass: local tiers start empty
    assert counters["remote_hits"] > 0 and counters["remote_hit_tokens"] > 0
    assert counters["remote_errors"] == counters["remote_rejected"] - counters["remote_rejected_prefix"] == 0


def test_replay_harness_runs_without_an_unreachable_tier_and_refuses_a_bad_url(tiny_artifact):
    url = f"redis://127.0.0.1:{free_port()}"
    result = kvexport_cli("replay", str(tiny_artifact), "--remote", url)
    assert result.returncode == 0, result.stderr[-2000:]
    assert [line for line in result.stderr.splitlines() if line.startswith("warning")] == [
        "warning: the remote tier (--remote) is unreachable; runtime "
        f"'{json.loads((tiny_artifact / 'manifest.json').read_text())['runtime_name']}' runs without it"
    ]
    bad = kvexport_cli("replay", str(tiny_artifact), "--remote", "redis:/nohost")
    assert (bad.returncode, bad.stderr.strip()) == (
        2,
        "error: remote URL '***' is not of the form redis://[[user]:password@]host[:port][/db]",
    )


# ---- soaks: two processes, random routing -------------------------------------------------------------

# One intra-op thread per soak process: the two processes would otherwise oversubscribe a small host's cores.
SOAK = (
    "import sys, torch; torch.set_num_threads(1); from kvexport.commands.cli import main; "
    "main(sys.argv[1:], 'kvexport')"
)


def start_soaks(
    artifact: Path,
    checkpoint: Path,
    url: str,
    num_requests: int,
    tmp_path: Path,
    num_processes: int = 2,
    extra: tuple[str, ...] = (),
) -> list[subprocess.Popen]:
    return [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                SOAK,
                "soak",
                str(artifact),
                "--checkpoint",
                str(checkpoint),
                "--requests",
                str(num_requests),
                "--seed",
                "7",
                "--remote",
                url,
                "--route",
                f"{i}/{num_processes}",
                "--json",
                str(tmp_path / f"soak-{i}.json"),
                *extra,
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(num_processes)
    ]


def finish(soaks: list[subprocess.Popen], tmp_path: Path) -> list[dict]:
    """Waits (bounded: a hang fails the test) and returns each process's soak report."""
    reports = []
    for i, soak in enumerate(soaks):
        try:
            _, stderr = soak.communicate(timeout=SOAK_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for other in soaks:
                other.kill()
            pytest.fail(f"soak {i} did not finish within {SOAK_TIMEOUT_S} s")
        assert soak.returncode == 0, stderr[-3000:]
        reports.append(json.loads((tmp_path / f"soak-{i}.json").read_text()))
    return reports


def totals(reports: list[dict]) -> dict[str, int]:
    return {name: sum(r["counters"][name] for r in reports) for name in reports[0]["counters"]}


def test_two_process_soak_with_random_routing_is_exact_and_uses_the_remote_tier(
    tiny_artifact, tiny_checkpoint, tmp_path
):
    need_redis()
    server = RedisServer(tmp_path).start()
    try:
        reports = finish(start_soaks(tiny_artifact, tiny_checkpoint, server.url, 1000, tmp_path), tmp_path)
    finally:
        server.stop()
    assert sum(r["requests"] for r in reports) == 1000
    assert [r["mismatches"] for r in reports] == [0, 0]
    counters = totals(reports)
    # Users evicted from one process's small local tiers come back from the other's entries.
    assert counters["remote_hits"] > 100 and counters["remote_hit_tokens"] > 0
    assert all(r["remote_hit_ratio"] > 0.5 for r in reports)
    assert counters["remote_rejected_format"] + counters["remote_rejected_checksum"] == 0
    assert counters["remote_rejected_runtime"] == 0


def _wait_for_progress(soak: subprocess.Popen, done: int, lines: list[str]) -> None:
    """Reads the soak's log until it reports `done` requests of its stream."""
    while line := soak.stderr.readline():
        lines.append(line)
        if line.startswith("soak: ") and int(line.split()[1].split("/")[0]) >= done:
            return
    pytest.fail(f"soak ended before reaching request {done}: {''.join(lines[-20:])}")


def test_soak_with_the_server_killed_and_restarted_is_exact_and_counts_the_outage(
    tiny_artifact, tiny_checkpoint, tmp_path
):
    need_redis()
    server = RedisServer(tmp_path).start()
    try:
        # Both processes are followed by their logs: each is past request 180 when the server dies
        # and past 300 when it comes back, of 900. Following only the first let the second run
        # through its last requests within one reconnect backoff (it doubles while the server is
        # down), so that it ended never having reconnected.
        soaks = start_soaks(tiny_artifact, tiny_checkpoint, server.url, 900, tmp_path)
        lines: list[str] = []
        for soak in soaks:
            _wait_for_progress(soak, 180, lines)
        server.stop()  # SIGKILL, mid-soak
        for soak in soaks:
            _wait_for_progress(soak, 300, lines)
        server.start()  # same port, empty
        reports = finish(soaks, tmp_path)
    finally:
        server.stop()
    assert [r["mismatches"] for r in reports] == [0, 0]
    counters = totals(reports)
    assert counters["remote_errors"] > 0  # reads and writes the lost server failed
    assert counters["remote_reconnects"] > 0 and counters["remote_connected"] == 2
    assert counters["remote_hits"] > 0


def test_soak_against_a_full_server_recomputes_what_it_evicted(tiny_artifact, tiny_checkpoint, tmp_path):
    need_redis()
    server = RedisServer(tmp_path, extra=("--maxmemory", "4mb", "--maxmemory-policy", "allkeys-lru")).start()
    client = Resp(server.port)
    try:
        for i in range(1000):  # unrelated keys, about 3 MB
            client.command("SET", f"other:{i}", b"x" * 3000)
        reports = finish(
            start_soaks(
                tiny_artifact,
                tiny_checkpoint,
                server.url,
                300,
                tmp_path,
                num_processes=1,
                extra=("--remote-write", "after_batch"),
            ),
            tmp_path,
        )
        info = client.command("INFO", "stats").decode()
    finally:
        client.close()
        server.stop()
    assert reports[0]["mismatches"] == 0
    evicted = int(next(line for line in info.splitlines() if line.startswith("evicted_keys:")).split(":")[1])
    counters = reports[0]["counters"]
    assert evicted > 0 and counters["remote_writes"] > 0
    assert counters["remote_misses"] > 0  # entries the server evicted: recomputed
    assert counters["remote_rejected_format"] + counters["remote_rejected_checksum"] == 0


# ---- a password from a file: the Python commands and the C++ harness read it themselves -------------------

LOCKED_PASSWORD = "pw:with@odd/chars%"


@pytest.fixture(scope="module")
def locked_redis(tmp_path_factory):
    need_redis()
    server = RedisServer(tmp_path_factory.mktemp("redis-locked"), extra=("--requirepass", LOCKED_PASSWORD)).start()
    yield server
    server.stop()


def _request_file(tiny_artifact: Path, tmp_path: Path) -> Path:
    step = torch.load(tiny_artifact / "trace" / "step_0000.pt", weights_only=True)
    torch.save([{k: v for k, v in step.items() if not k.startswith("expected")}], tmp_path / "requests.pt")
    return tmp_path / "requests.pt"


def test_run_and_replay_read_the_password_from_a_file(tiny_artifact, locked_redis, tmp_path):
    secret = tmp_path / "redis-password"
    secret.write_text(LOCKED_PASSWORD + "\n")
    url = f"redis://127.0.0.1:{locked_redis.port}/0"
    report_path = tmp_path / "replay.json"
    replayed = kvexport_cli(
        "replay",
        str(tiny_artifact),
        "--repeat",
        "2",
        "--remote",
        url,
        "--remote-write",
        "after_batch",
        "--remote-password-file",
        str(secret),
        "--json",
        str(report_path),
    )
    assert replayed.returncode == 0, replayed.stderr[-2000:]
    counters = json.loads(report_path.read_text())["counters"]
    assert counters["remote_hits"] > 0 and counters["remote_errors"] == 0
    scored = kvexport_cli(
        "run",
        str(tiny_artifact),
        "--requests",
        str(_request_file(tiny_artifact, tmp_path)),
        "--output",
        str(tmp_path / "out.pt"),
        "--remote",
        url,
        "--remote-password-file",
        str(secret),
    )
    assert scored.returncode == 0, scored.stderr[-2000:]
    # Without the file the server refuses (NOAUTH): the file's password was what let them in.
    refused = kvexport_cli("replay", str(tiny_artifact), "--remote", url)
    assert refused.returncode == 2 and "NOAUTH" in refused.stderr


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("wrong-password\n", "refused the connection: WRONGPASS"),
        ("", "is empty"),
        ("one\ntwo\n", "holds more than one line"),
        (None, "the remote tier's password file"),
    ],
)
def test_a_bad_password_file_is_one_line_that_never_shows_a_password(
    tiny_artifact, locked_redis, tmp_path, content, message
):
    secret = tmp_path / "redis-password"
    if content is not None:
        secret.write_text(content)
    url = f"redis://127.0.0.1:{locked_redis.port}/0"
    for command in (
        ["replay", str(tiny_artifact)],
        [
            "run",
            str(tiny_artifact),
            "--requests",
            str(_request_file(tiny_artifact, tmp_path)),
            "--output",
            str(tmp_path / "out.pt"),
        ],
    ):
        result = kvexport_cli(*command, "--remote", url, "--remote-password-file", str(secret))
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1 and message in lines[0], (command, result.stderr[-2000:])
        assert "wrong-password" not in result.stderr and not (tmp_path / "out.pt").exists()


def test_the_harness_reads_a_password_file_by_the_python_rules(tiny_artifact, tmp_path):
    """`kvexport replay` checks the file first; a host that runs the harness itself gets the same
    one-line message from it, before any connection is tried."""
    command = replay_command(tiny_artifact, remote=f"redis://127.0.0.1:{free_port()}")
    for i, (content, message) in enumerate(BAD_PASSWORD_FILES):
        path = write_password_file(tmp_path / f"pw{i}", content)
        with pytest.raises(UserError) as python:
            read_password_file(path)
        result = subprocess.run(
            [*command, "--remote-password-file", str(path)], capture_output=True, text=True, timeout=SOAK_TIMEOUT_S
        )
        assert (result.returncode, result.stderr.strip()) == (2, f"error: {python.value}"), message
        assert message in str(python.value)
    result = subprocess.run(
        [*replay_command(tiny_artifact), "--remote-password-file", str(path)],
        capture_output=True,
        text=True,
        timeout=SOAK_TIMEOUT_S,
    )
    assert (result.returncode, result.stderr.strip()) == (2, "error: --remote-password-file needs --remote URL")


def test_a_password_file_needs_a_remote_and_no_second_password(tiny_artifact, tmp_path):
    secret = tmp_path / "redis-password"
    secret.write_text("pw\n")
    alone = kvexport_cli("replay", str(tiny_artifact), "--remote-password-file", str(secret))
    assert (alone.returncode, alone.stderr.strip()) == (2, "error: --remote-password-file needs --remote URL")
    both = kvexport_cli(
        "replay", str(tiny_artifact), "--remote", "redis://:pw@127.0.0.1:6379", "--remote-password-file", str(secret)
    )
    assert (both.returncode, both.stderr.strip()) == (
        2,
        "error: the remote URL holds a password already: give it there or in a password file, not both",
    )
