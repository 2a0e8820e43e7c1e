"""The remote KV tier's benchmark (benchmarks/remote.py): a returning user served from the remote
tier vs recomputed, the bytes moved and their throughput, and what writing to the tier costs a
request. Against a redis-server of its own on 127.0.0.1 (Debian's redis-server)."""

from __future__ import annotations

import contextlib
import logging
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from kvexport.artifact import Artifact
from kvexport.bench.suite import NEW_EVENTS, SweepRequests
from kvexport.bench.timing import summary, timed_ms
from kvexport.errors import UserError
from kvexport.host.package import load
from kvexport.host.requests import check_batch
from kvexport.ops import wrappers as kv
from kvexport.remote import WRITE_POLICIES

log = logging.getLogger(__name__)
# User ids: each length's returning user, and users of the same history the server never saw.
RETURNING_USER = 1
RECOMPUTED_USER = 500_000
VARIANTS = (None, *WRITE_POLICIES)  # None: no remote tier


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class RedisServer:
    """A redis-server of its own on 127.0.0.1 (no persistence; log in `directory`): the benchmark's,
    and the tests', which stop and restart it on the same port to play an outage."""

    def __init__(self, directory: Path, port: int | None = None, extra: tuple[str, ...] = ()):
        self.directory = Path(directory)
        self.port = port or free_port()
        self.extra = extra  # more redis-server options, e.g. ("--maxmemory", "4mb")
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        binary = shutil.which("redis-server")
        if binary is None:
            raise UserError("redis-server is not installed (Debian/Ubuntu: apt-get install redis-server)")
        self.process = subprocess.Popen(
            [
                binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.directory),
                "--logfile",
                str(self.directory / "redis.log"),
                *self.extra,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=1):
                return self
            time.sleep(0.05)
        self.stop()
        raise UserError(
            f"redis-server did not listen on 127.0.0.1:{self.port} within {timeout_s:.0f} s; "
            f"see {self.directory / 'redis.log'}"
        )

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait(timeout=10)
            self.process = None


@contextlib.contextmanager
def local_redis() -> Iterator[str]:
    """A RedisServer in a temporary directory for the duration; its URL."""
    with tempfile.TemporaryDirectory(prefix="kvexport-redis-") as directory:
        server = RedisServer(Path(directory)).start()
        try:
            yield server.url
        finally:
            server.stop()


def _score_ms(pkg, requests: SweepRequests, variant: int) -> float:
    batch = check_batch(requests.variant(variant), pkg.config)
    return timed_ms(pkg.run, batch)


def _prime(artifact: Artifact, url: str, lengths: list[int]) -> None:
    """Writes each length's returning user to the server (variant 0), as another host would have."""
    with load(artifact, check_files=False, remote=url, remote_write="after_batch") as pkg:
        for length in lengths:
            pkg.run(check_batch(SweepRequests(pkg.config, length, 1, RETURNING_USER + length).variant(0), pkg.config))


def hit_vs_recompute(artifact: Artifact, url: str, lengths: list[int], warmup: int, repeats: int) -> list[dict]:
    """Per length, side by side in each repetition: a returning user whose cache is on the server only
    (this host's tiers emptied), a user of the same history the server never saw (recomputed), and
    the returning user again, now on the device tier."""
    _prime(artifact, url, lengths)
    rows = []
    with load(artifact, check_files=False, remote=url) as pkg:
        runtime = pkg.runtime_name
        for length in lengths:
            returning = SweepRequests(pkg.config, length, 1, RETURNING_USER + length)
            samples: dict[str, list] = {"recompute": [], "remote": [], "device": [], "reads": []}
            for r in range(warmup + repeats):
                kv.reset_runtime(runtime)
                recompute = _score_ms(pkg, SweepRequests(pkg.config, length, 1, RECOMPUTED_USER + r), r + 1)
                kv.reset_runtime(runtime)  # the entry stays on the server: a host that never saw the user
                remote = _score_ms(pkg, returning, r + 1)
                reads = kv.runtime_stats(runtime)
                device = _score_ms(pkg, returning, 1000 + r)
                if r >= warmup:
                    for name, value in zip(samples, (recompute, remote, device, reads)):
                        samples[name].append(value)
            rows.append(_hit_row(length, samples))
            log.info(
                "remote hit L=%d: recompute %.1f ms, remote hit %.2f ms (x%.1f), device hit %.2f ms",
                length,
                rows[-1]["recompute_ms"]["median"],
                rows[-1]["remote_hit_ms"]["median"],
                rows[-1]["remote_speedup"]["median"],
                rows[-1]["device_hit_ms"]["median"],
            )
    return rows


def _hit_row(length: int, samples: dict[str, list]) -> dict:
    """One length's row; samples["reads"]: the runtime's counters after each timed remote hit."""
    reads = samples["reads"]
    bad = [s for s in reads if (s["remote_hits"], s["remote_hit_tokens"]) != (1, s["hit_tokens"])]
    if bad:
        raise RuntimeError(f"kvexport bug: a remote-hit sample at L={length} was not one remote hit: {bad[0]}")
    read_ms = summary([s["remote_read_us"] / 1e3 for s in reads])
    entry_bytes = reads[0]["remote_bytes_in"]
    recompute, remote, device = samples["recompute"], samples["remote"], samples["device"]
    return {
        "cached_events": length,
        "new_events": NEW_EVENTS,
        "cached_tokens": reads[0]["hit_tokens"],
        "entry_bytes": entry_bytes,
        "recompute_ms": summary(recompute),
        "remote_hit_ms": summary(remote),
        "device_hit_ms": summary(device),
        "remote_speedup": summary([f / m for f, m in zip(recompute, remote)]),
        "remote_over_device": summary([m / d for m, d in zip(remote, device)]),
        "read_ms": read_ms,
        "read_gb_per_s": round(entry_bytes / (read_ms["median"] * 1e6), 3),
        "remote_hit_gb_per_s": round(entry_bytes / (summary(remote)["median"] * 1e6), 3),
    }


def write_behind_cost(artifact: Artifact, url: str, lengths: list[int], warmup: int, repeats: int) -> list[dict]:
    """A device-tier hit's latency with each write policy vs without a remote tier, per length.

    A runtime keeps its tiers while loaded, so each repetition loads the package once per policy, in
    turn; the ratio to no tier is taken within the repetition.
    """
    samples = {(length, policy): [] for length in lengths for policy in VARIANTS}
    for _ in range(repeats):
        for policy in VARIANTS:
            remote = {"remote": url, "remote_write": policy} if policy else {}
            with load(artifact, check_files=False, **remote) as pkg:
                for length in lengths:
                    requests = SweepRequests(pkg.config, length, 1, 2 * RECOMPUTED_USER + length)
                    for r in range(warmup + 1):  # the first request computes the user
                        _score_ms(pkg, requests, r)
                    timed = [_score_ms(pkg, requests, warmup + 1 + r) for r in range(repeats)]
                    samples[(length, policy)].append(sorted(timed)[len(timed) // 2])
    rows = []
    for length in lengths:
        plain = samples[(length, None)]
        row = {"cached_events": length, "new_events": NEW_EVENTS, "no_remote_ms": summary(plain)}
        for policy in WRITE_POLICIES:
            row[f"{policy}_ms"] = summary(samples[(length, policy)])
            row[f"{policy}_over_no_remote"] = summary([p / n for p, n in zip(samples[(length, policy)], plain)])
        rows.append(row)
        log.info("write-behind L=%d: %s", length, {k: v["median"] for k, v in row.items() if k.endswith("_ms")})
    return rows
