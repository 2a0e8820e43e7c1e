"""Serving benchmark: throughput and p50/p99 latency against concurrency, two routes side by side
in one run, each with Triton's dynamic batching on and off, and the same requests scored in-process.

Routes: `kvexport serve` (which runs the artifact's repository under the serve extra's tritonserver,
the artifact referenced where it is), and a plain `tritonserver --model-repository` on `kvexport
triton-repo`'s repository (the artifact copied into it); in both the model runs inside Triton's
Python-backend stub. Four servers of one artifact run at once (ports on 127.0.0.1); for
each concurrency they are driven one after the other for the same time by the same workload: each
client thread sends one request at a time over gRPC, users returning with growing histories. The
mean batch size is read from each server's kvexport metrics, and the model's busy share of the time
from Triton's (compute time: what batching can save is at most that share). In-process: one thread scores the same
workload with Package.score_users, one request per call; a route's server overhead per request is
its p50 at one client minus that. Last, each server is stopped (SIGTERM) right after its last
answer: the time until its process has exited is its stop time.

    .venv/bin/python benchmarks/serve.py artifacts/hstu-tiny --json /tmp/serve-tiny.json \
        --plot /tmp/serve-tiny.png
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import tritonclient.grpc as grpcclient

from kvexport.artifact import open_artifact
from kvexport.model.batch import random_user
from kvexport.options import ServeOptions
from kvexport.serving.repository import shard_names
from kvexport.serving.triton import serve_command

START_TIMEOUT_S = 120
CONCURRENCY = (1, 4, 16)
TRITON_COUNTERS = ("nv_inference_compute_infer_duration_us", "nv_inference_exec_count", "nv_inference_request_success")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Served:
    """A server on free ports of 127.0.0.1, in its own session: `kvexport serve` (route "serve") or a
    plain tritonserver on `kvexport triton-repo`'s repository (route "repository", `instances` model
    instances)."""

    def __init__(
        self,
        artifact: Path,
        route: str,
        batching: bool,
        work: Path,
        instances: int = 1,
        routing: bool = True,
        add_models: Callable[[Path], None] | None = None,
    ):
        self.grpc, self.metrics = free_port(), free_port()
        self.shards = instances if routing else 1
        self.http = http = free_port()
        flag = "--batching" if batching else "--no-batching"
        if route == "serve":
            options = ServeOptions(address="127.0.0.1", http_port=http, grpc_port=self.grpc, metrics_port=self.metrics)
            self.process = subprocess.Popen(
                serve_command(artifact, options, flag),
                stdout=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
            line = self.process.stdout.readline()
            if not line.startswith("serving "):
                raise SystemExit(f"kvexport serve did not start: {line!r}")
            return
        from kvexport.serving import tritonserver

        repo, server = work / f"repo-{flag[2:]}-{instances}", work / f"server-{flag[2:]}-{instances}"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "kvexport",
                "triton-repo",
                str(artifact),
                "-o",
                str(repo),
                "--this-python",
                flag,
                "--instances",
                str(instances),
                "--routing" if routing else "--no-routing",
            ],
            check=True,
            capture_output=True,
        )
        if add_models is not None:  # more models beside kvexport's, before tritonserver loads the repository
            add_models(repo)
        command, env = tritonserver.prepare(server)
        self.process = subprocess.Popen(
            [
                *command,
                "--model-repository",
                str(repo),
                "--http-address",
                "127.0.0.1",
                "--grpc-address",
                "127.0.0.1",
                "--http-port",
                str(http),
                "--grpc-port",
                str(self.grpc),
                "--metrics-port",
                str(self.metrics),
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _ready(http):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"tritonserver did not start on {repo}")
            time.sleep(0.2)

    def metric(self, name: str, models: tuple[str, ...] = ()) -> float:
        """The sum of the metric's samples (every instance's: each labels its own), of the given
        Triton models only when named."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics}/metrics", timeout=10) as response:
            text = response.read().decode()
        samples = re.findall(rf"^{name}\{{([^}}]*)\}} (\S+)$", text, re.M)
        if not samples:
            raise LookupError(f"no sample of {name}")
        return sum(
            float(value)
            for labels, value in samples
            if not models or any(f'model="{m}"' in labels.split(",") for m in models)
        )

    def cpu_seconds(self) -> float:
        """CPU time (user + system) of every process of the server's session: kvexport, tritonserver, stub."""
        total = 0
        for stat in Path("/proc").glob("[0-9]*/stat"):
            with contextlib.suppress(OSError):
                fields = stat.read_text().rsplit(")", 1)[1].split()
                if int(fields[3]) == self.process.pid:  # the session id
                    total += int(fields[11]) + int(fields[12])  # utime, stime
        return total / os.sysconf("SC_CLK_TCK")

    def stop(self) -> float:
        """SIGTERM, then the seconds until the server's process has exited."""
        started = time.monotonic()
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(timeout=120)
        return time.monotonic() - started


def _ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def workload(config, client: int, num_users: int, seed: int):
    """One client's endless requests (arrays of the serving signature, no batch dimension): its own
    users, each returning with 4 more events."""
    m = config.model
    generator = torch.Generator().manual_seed(seed * 1000 + client)
    longest = min(m.max_history_length, 256)
    users = [random_user(m, generator, client * num_users + u, longest, 8) for u in range(num_users)]
    visit = 0
    while True:
        user = users[visit % num_users]
        events = 8 + 4 * (visit // num_users) % (longest - 8)
        visit += 1
        yield {
            "user_id": np.array([user.user_id]),
            "item_ids": user.item_ids[:events].numpy(),
            "action_ids": user.action_ids[:events].numpy(),
            "context_ids": user.context_ids.numpy(),
            "candidate_ids": user.candidate_ids.numpy(),
        }


def grpc_inputs(arrays: dict[str, np.ndarray]) -> list:
    inputs = []
    for name, array in arrays.items():
        tensor = grpcclient.InferInput(name, [1, *array.shape], "INT64")
        tensor.set_data_from_numpy(array.astype(np.int64)[None])
        inputs.append(tensor)
    return inputs


def in_process(artifact: Path, config, seconds: float) -> dict:
    """One thread scoring client 0's workload with Package.score_users, one request per call."""
    import kvexport
    from kvexport.model.batch import UserRequest

    requests = workload(config, 0, 4, 0)
    latencies = []
    with kvexport.load(artifact) as package:
        stop = time.monotonic() + seconds
        while time.monotonic() < stop:
            arrays = next(requests)
            user = UserRequest(
                int(arrays["user_id"][0]),
                *(
                    torch.from_numpy(arrays[name].astype(np.int64))
                    for name in ("item_ids", "action_ids", "context_ids", "candidate_ids")
                ),
            )
            sent = time.perf_counter()
            package.score_users([user])
            latencies.append(time.perf_counter() - sent)
    flat = np.array(latencies) * 1e3
    return {
        "requests": int(flat.size),
        "p50_ms": round(float(np.percentile(flat, 50)), 3),
        "p99_ms": round(float(np.percentile(flat, 99)), 3),
    }


def drive(served: Served, model: str, config, clients: int, seconds: float) -> dict:
    """`clients` threads, each one request at a time, for `seconds`; throughput and latencies."""
    latencies: list[list[float]] = [[] for _ in range(clients)]
    time.sleep(0.2)  # the model publishes its counters a moment after each batch
    batches, users = served.metric("kvexport_batches_total"), served.metric("kvexport_batch_users_total")
    # Triton's counters of the models that score: the router (shard 0) and the other shards, or the one model.
    scoring = (model, *shard_names(model, served.shards))
    triton = {(m, name): served.metric(name, (m,)) for m in scoring for name in TRITON_COUNTERS}
    server_cpu, client_cpu = served.cpu_seconds(), time.process_time()
    start = time.monotonic()
    stop = start + seconds

    def run(index: int) -> None:
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{served.grpc}")
        requests = workload(config, index, 4, 0)
        try:
            while time.monotonic() < stop:
                inputs = grpc_inputs(next(requests))
                sent = time.perf_counter()
                client.infer(model, inputs, client_timeout=60)
                latencies[index].append(time.perf_counter() - sent)
        finally:
            client.close()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.monotonic() - start
    server_cpu, client_cpu = served.cpu_seconds() - server_cpu, time.process_time() - client_cpu
    flat = np.array([value for values in latencies for value in values]) * 1e3
    time.sleep(0.2)
    triton = {key: served.metric(key[1], (key[0],)) - before for key, before in triton.items()}
    # Triton adds a batch's compute time once per request of the batch: once per execution is the
    # busy time, model by model, summed (a router's waves include its wait for the other shards' packs,
    # so with shards the sum counts that wait twice: an upper bound).
    busy_us = sum(
        triton[m, "nv_inference_compute_infer_duration_us"]
        * triton[m, "nv_inference_exec_count"]
        / max(triton[m, "nv_inference_request_success"], 1)
        for m in scoring
    )
    batches = served.metric("kvexport_batches_total") - batches
    users = served.metric("kvexport_batch_users_total") - users
    return {
        "clients": clients,
        "requests": int(flat.size),
        "seconds": round(elapsed, 2),
        "throughput_rps": round(flat.size / elapsed, 1),
        "p50_ms": round(float(np.percentile(flat, 50)), 2),
        "p99_ms": round(float(np.percentile(flat, 99)), 2),
        "mean_batch": round(users / max(batches, 1), 2),
        "model_busy": round(busy_us / (elapsed * 1e6), 2),
        "server_cpu_ms_per_request": round(1e3 * server_cpu / flat.size, 2),
        "client_cpu_ms_per_request": round(1e3 * client_cpu / flat.size, 2),
    }


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (throughput, latency) = plt.subplots(1, 2, figsize=(10, 4))
    for mode, rows in results["modes"].items():
        clients = [row["clients"] for row in rows]
        throughput.plot(clients, [row["throughput_rps"] for row in rows], marker="o", label=mode)
        latency.plot(clients, [row["p50_ms"] for row in rows], marker="o", label=f"p50, {mode}")
        latency.plot(clients, [row["p99_ms"] for row in rows], marker="x", linestyle="--", label=f"p99, {mode}")
    throughput.set(
        xlabel="concurrent clients",
        ylabel="requests / s",
        xscale="log",
        xticks=CONCURRENCY,
        xticklabels=[str(c) for c in CONCURRENCY],
        title=f"{results['model']}: throughput",
    )
    latency.set(
        xlabel="concurrent clients",
        ylabel="latency (ms)",
        xscale="log",
        xticks=CONCURRENCY,
        xticklabels=[str(c) for c in CONCURRENCY],
        title=f"{results['model']}: latency",
    )
    throughput.legend()
    latency.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--seconds", type=float, default=10.0, help="driving time per point")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()
    artifact = open_artifact(args.artifact)
    load = os.getloadavg()
    results = {
        "model": artifact.config.name,
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "load_before": [round(x, 2) for x in load],
        "seconds_per_point": args.seconds,
        "modes": {},
    }
    results["in_process"] = in_process(args.artifact, artifact.config, args.seconds)
    print(
        f"in-process, 1 thread: p50 {results['in_process']['p50_ms']} ms, p99 {results['in_process']['p99_ms']} ms",
        flush=True,
    )
    servers = {}
    with tempfile.TemporaryDirectory(prefix="kvexport-serve-bench-") as work:
        try:
            for route in ("serve", "repository"):
                for batching in (True, False):
                    mode = f"{route}, batching {'on' if batching else 'off'}"
                    servers[mode] = Served(args.artifact, route, batching, Path(work))
                    results["modes"][mode] = []
            for clients in CONCURRENCY:
                for mode, served in servers.items():
                    row = drive(served, artifact.config.name, artifact.config, clients, args.seconds)
                    results["modes"][mode].append(row)
                    print(
                        f"{mode:>26}, {clients:>2} clients: {row['throughput_rps']:7.1f} req/s, "
                        f"p50 {row['p50_ms']:6.2f} ms, p99 {row['p99_ms']:6.2f} ms, mean batch {row['mean_batch']}, "
                        f"model busy {row['model_busy']:.0%}, "
                        f"cpu/request server {row['server_cpu_ms_per_request']} ms, "
                        f"client {row['client_cpu_ms_per_request']} ms",
                        flush=True,
                    )
            results["stop_s"] = {mode: round(served.stop(), 2) for mode, served in servers.items()}
            print(f"stop (SIGTERM to exit, after the last answer): {results['stop_s']} s", flush=True)
        finally:
            for served in servers.values():
                if served.process.poll() is None:
                    with contextlib.suppress(Exception):
                        served.stop()
    results["load_after"] = [round(x, 2) for x in os.getloadavg()]
    results["speedup_at_16"], results["overhead_ms_at_1"] = {}, {}
    for route in ("serve", "repository"):
        on, off = results["modes"][f"{route}, batching on"], results["modes"][f"{route}, batching off"]
        results["speedup_at_16"][route] = round(on[-1]["throughput_rps"] / off[-1]["throughput_rps"], 2)
        results["overhead_ms_at_1"][route] = round(on[0]["p50_ms"] - results["in_process"]["p50_ms"], 2)
    print(
        f"throughput at 16 clients, batching on / off: {results['speedup_at_16']}; server overhead per request "
        f"at 1 client (p50 minus in-process p50): {results['overhead_ms_at_1']} ms; load average before "
        f"{results['load_before']}, after {results['load_after']}"
    )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
