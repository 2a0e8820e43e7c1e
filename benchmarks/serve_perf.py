"""Serving measured by Triton's own load tool, `perf_analyzer`, on `kvexport triton-repo`'s repository:
the K = 1 / 2 / 4 table (cache shards behind the router, and `--no-routing`: K instances of one model),
throughput and p50 / p99 against concurrency, over gRPC and HTTP, and the cache hit ratio from
kvexport's metrics (what perf_analyzer cannot see).

perf_analyzer sends the requests of an `--input-data` file (write_input_data: users in the request
format of docs/serving.md, one entry a request, per-request shapes without Triton's batch dimension):
NUM_USERS users, each returning with 4 more events a visit, visit after visit, so that consecutive
requests are different users and a user's next request comes NUM_USERS requests later. For each K,
the routed and the unrouted repository are served at once by two plain tritonservers (free ports of
127.0.0.1) and driven in turn, the same points alternating over `--rounds` rounds: their ratio is
measured side by side. `--with-one` serves one model of one instance beside each K in the same rounds.
`--crossing` instead measures a request's overhead at one client: perf_analyzer's p50 on one model of
one instance minus the in-process p50 of the same requests, beside a null model's p50 (a Python-backend
model of the same signature that answers zeros: the floor any Python-backend model pays).

perf_analyzer is the binary of the `tritonclient==2.41.0` wheel (later wheels do not carry it):
`make perf-analyzer` (or `--install`) puts it in build/perf_analyzer/. It needs `libb64.so.0d` and
`libcudart.so.12`, which the serve extra bundles under hashed names: loader_path links them under
their own names in a temporary directory on the subprocess's LD_LIBRARY_PATH only.

    .venv/bin/python benchmarks/serve_perf.py /tmp/hstu-tiny --json /tmp/serve-perf.json
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import glob
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import torch
from serve import Served
from serve_instances import cache_counters

from kvexport.artifact import open_artifact
from kvexport.model.batch import random_user

ROOT = Path(__file__).resolve().parent.parent
PERF_ANALYZER = ROOT / "build" / "perf_analyzer" / "perf_analyzer"
TRITONCLIENT = "tritonclient==2.41.0"
NUM_USERS = 24
VISITS = 7  # histories of 8, 12, ..., 32 events: every shard's cache holds its users at any K
WINDOW_MS = 2000
INPUTS = ("user_id", "item_ids", "action_ids", "context_ids", "candidate_ids")
SPLIT = (
    "Client Send", "Network+Server Send/Recv", "Server Queue", "Server Compute Input", "Server Compute Infer",
    "Server Compute Output", "Client Recv",
)  # fmt: skip
# A shared machine: three windows within 100% of each other are a measurement (perf_analyzer fails a
# point otherwise), and a point's rounds are kept side by side with the other variant's.


def install(binary: Path = PERF_ANALYZER) -> Path:
    """perf_analyzer from the tritonclient 2.41.0 wheel (pip download, no install), at `binary`."""
    binary.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--dest", str(binary.parent), TRITONCLIENT],
        check=True,
    )
    (wheel,) = binary.parent.glob("tritonclient-2.41.0-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        binary.write_bytes(archive.read("tritonclient-2.41.0.data/data/bin/perf_analyzer"))
    binary.chmod(0o755)
    wheel.unlink()
    return binary


def loader_path(work: Path) -> dict[str, str]:
    """perf_analyzer's environment: the serve extra's bundled libb64 and libcudart linked under the
    names perf_analyzer asks for, in work/lib, on LD_LIBRARY_PATH (a system libb64 serves as well)."""
    import pytriton

    bundled = Path(pytriton.__file__).resolve().parent.parent / "nvidia_pytriton.libs"
    lib = work / "lib"
    lib.mkdir(exist_ok=True)
    for name, pattern in (("libb64.so.0d", "libb64-*.so.0d"), ("libcudart.so.12", "libcudart-*.so.12*")):
        found = sorted(glob.glob(str(bundled / pattern)))
        if found and not (lib / name).exists():
            (lib / name).symlink_to(found[0])
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(lib), env.get("LD_LIBRARY_PATH", "")]))
    return env


def write_input_data(config, path: Path, num_users: int = NUM_USERS, visits: int = VISITS, seed: int = 0) -> Path:
    """perf_analyzer's --input-data: `visits` rounds of `num_users` users, their histories growing by
    4 events a round; each entry one request, each tensor its content and its shape without Triton's
    batch dimension."""
    generator = torch.Generator().manual_seed(seed)
    longest = 8 + 4 * (visits - 1)
    users = [random_user(config.model, generator, 1000 + u, longest, 8) for u in range(num_users)]
    data = []
    for visit in range(visits):
        events = 8 + 4 * visit
        for user in users:
            tensors = {
                "user_id": [user.user_id],
                "item_ids": user.item_ids[:events].tolist(),
                "action_ids": user.action_ids[:events].tolist(),
                "context_ids": user.context_ids.tolist(),
                "candidate_ids": user.candidate_ids.tolist(),
            }
            data.append({name: {"content": values, "shape": [len(values)]} for name, values in tensors.items()})
    path.write_text(json.dumps({"data": data}))
    return path


def perf_analyzer(binary: Path, env: dict, model: str, url: str, protocol: str, concurrency: int, data: Path) -> dict:
    """One perf_analyzer measurement: throughput and latencies (ms) of its stable windows."""
    report = data.parent / f"pa-{os.getpid()}-{time.monotonic_ns()}.csv"
    command = [
        str(binary), "-m", model, "-u", url, "-i", protocol, "--input-data", str(data),
        "--concurrency-range", str(concurrency), "--measurement-interval", str(WINDOW_MS),
        "--stability-percentage", "100", "--max-trials", "10", "-f", str(report),
    ]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        return {"error": (done.stdout + done.stderr).strip().splitlines()[-1]}
    with open(report) as file:
        row = next(csv.DictReader(file))
    report.unlink()
    out = {
        "throughput_rps": round(float(row["Inferences/Second"]), 1),
        "p50_ms": round(float(row["p50 latency"]) / 1e3, 3),
        "p99_ms": round(float(row["p99 latency"]) / 1e3, 2),
    }
    # Where a request's mean time went, as perf_analyzer and Triton's statistics split it (ms).
    out["split_ms"] = {name: round(float(row[name]) / 1e3, 3) for name in SPLIT if name in row}
    return out


def in_process(artifact: Path, data: Path, seconds: float) -> float:
    """p50 (ms) of the --input-data requests scored one at a time by Package.score_users, one thread
    (the served model's intra-op threads), in the file's order: the served request minus the crossing."""
    import kvexport
    from kvexport.model.batch import UserRequest

    torch.set_num_threads(1)
    entries = json.loads(data.read_text())["data"]
    requests = [
        UserRequest(
            entry["user_id"]["content"][0],
            *(torch.tensor(entry[name]["content"], dtype=torch.int64) for name in INPUTS[1:]),
        )
        for entry in entries
    ]
    latencies = []
    with kvexport.load(artifact) as package:
        stop = time.monotonic() + seconds
        while time.monotonic() < stop:
            for request in requests:
                sent = time.perf_counter()
                package.score_users([request])
                latencies.append(time.perf_counter() - sent)
    latencies.sort()
    return round(latencies[len(latencies) // 2] * 1e3, 3)


# The Python backend's floor: a model of the same signature that reads the five inputs as kvexport's
# does (DLPack, torch) and answers zeros, with no package: what any Python-backend model pays.
NULL_MODEL = "null"
NULL_MODEL_SOURCE = """import json, os, site


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        parameters = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        for directory in filter(None, parameters.get("python_path", "").split(os.pathsep)):
            site.addsitedir(directory)
        import torch
        import triton_python_backend_utils as pb

        self.torch, self.pb = torch, pb
        self.names = [spec["name"] for spec in config["input"]]
        self.num_tasks = config["output"][0]["dims"][-1]

    def execute(self, requests):
        torch, pb = self.torch, self.pb
        out = []
        for request in requests:
            arrays = {n: torch.from_dlpack(pb.get_input_tensor_by_name(request, n).to_dlpack()) for n in self.names}
            logits = torch.zeros(1, arrays["candidate_ids"].shape[1], self.num_tasks)
            out.append(pb.InferenceResponse([pb.Tensor.from_dlpack("logits", logits)]))
        return out
"""


def add_null_model(name: str):
    """A repository hook (Served's add_models): the null model beside `name`, its config `name`'s."""

    def add(repo: Path) -> None:
        (repo / NULL_MODEL / "1").mkdir(parents=True)
        config = (repo / name / "config.pbtxt").read_text().replace(f'name: "{name}"', f'name: "{NULL_MODEL}"', 1)
        (repo / NULL_MODEL / "config.pbtxt").write_text(config)
        (repo / NULL_MODEL / "1" / "model.py").write_text(NULL_MODEL_SOURCE)

    return add


def crossing(args, config, binary: Path, env: dict, data: Path, work: Path) -> dict:
    """A served request's overhead at one client: perf_analyzer's p50 (gRPC and HTTP, concurrency 1,
    one model of one instance) minus the in-process p50 of the same requests, beside the null model's
    p50 (the Python backend's floor), rounds alternating."""
    server = Served(args.artifact, "repository", True, work, 1, True, add_models=add_null_model(config.name))
    rounds = []
    try:
        for _ in range(args.rounds):
            row = {"in_process_p50_ms": in_process(args.artifact, data, 5.0)}
            for protocol in args.protocols.split(","):
                port = server.grpc if protocol == "grpc" else server.http
                row[protocol] = perf_analyzer(binary, env, config.name, f"127.0.0.1:{port}", protocol, 1, data)
                if "p50_ms" in row[protocol]:
                    row[protocol]["overhead_p50_ms"] = round(row[protocol]["p50_ms"] - row["in_process_p50_ms"], 3)
                floor = perf_analyzer(binary, env, NULL_MODEL, f"127.0.0.1:{port}", protocol, 1, data)
                row[protocol]["null_model_p50_ms"] = floor.get("p50_ms")
                if "error" in floor:
                    row[protocol].setdefault("error", f"null model: {floor['error']}")
            rounds.append(row)
            print(json.dumps(row), flush=True)
    finally:
        with contextlib.suppress(Exception):
            server.stop()
    return {"crossing": rounds}


def hit_ratio(before: dict, after: dict) -> float:
    hits = after["hit_tokens"] - before["hit_tokens"]
    return round(hits / max(hits + after["recomputed_tokens"] - before["recomputed_tokens"], 1), 3)


def measure(args, config, binary: Path, env: dict, data: Path, work: Path, variants: list[tuple[int, bool]]):
    """The repositories of `variants` ((K, routing) each) served at once and driven in turn."""
    servers = {}
    for instances, routing in variants:
        folder = work / f"{'routed' if routing else 'unrouted'}-{instances}"
        folder.mkdir()
        servers[instances, routing] = Served(args.artifact, "repository", True, folder, instances, routing)
    rows = []
    try:
        counters = {variant: cache_counters(server) for variant, server in servers.items()}
        points: dict[tuple, list[dict]] = {}
        for _ in range(args.rounds):
            for protocol in args.protocols.split(","):
                for concurrency in (int(c) for c in args.concurrency.split(",")):
                    for variant, server in servers.items():
                        port = server.grpc if protocol == "grpc" else server.http
                        result = perf_analyzer(
                            binary, env, config.name, f"127.0.0.1:{port}", protocol, concurrency, data
                        )
                        points.setdefault((*variant, protocol, concurrency), []).append(result)
        ratios = {variant: hit_ratio(counters[variant], cache_counters(server)) for variant, server in servers.items()}
    finally:
        for server in servers.values():
            with contextlib.suppress(Exception):
                server.stop()
    for (instances, routing, protocol, concurrency), results in points.items():
        row = {"instances": instances, "routing": routing, "protocol": protocol, "concurrency": concurrency}
        row.update(hit_ratio=ratios[instances, routing], rounds=results)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path, nargs="?")
    parser.add_argument("--instances", default="1,2,4", help="comma-separated instance counts K")
    parser.add_argument("--concurrency", default="1,16", help="comma-separated perf_analyzer concurrencies")
    parser.add_argument("--protocols", default="grpc,http")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds of every point")
    parser.add_argument("--perf-analyzer", type=Path, default=PERF_ANALYZER)
    parser.add_argument("--install", action="store_true", help="install perf_analyzer (then measure, if given OUT)")
    parser.add_argument("--input-data", type=Path, help="write the --input-data file here and stop")
    parser.add_argument(
        "--with-one", action="store_true", help="also serve K = 1 beside each K > 1, driven in the same rounds"
    )
    parser.add_argument("--crossing", action="store_true", help="measure a request's overhead at one client only")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # the servers are stopped on the way out
    if args.install:
        print(f"perf_analyzer: {install(args.perf_analyzer)}")
    if args.artifact is None:
        return
    config = open_artifact(args.artifact).config
    if args.input_data:
        write_input_data(config, args.input_data)
        return
    if not args.perf_analyzer.is_file():
        raise SystemExit(f"{args.perf_analyzer}: no perf_analyzer; install it with `make perf-analyzer`")
    results = {
        "model": config.name,
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "users": NUM_USERS,
        "load_before": [round(x, 2) for x in os.getloadavg()],
        "rows": [],
    }
    with tempfile.TemporaryDirectory(prefix="kvexport-serve-perf-") as work:
        env = loader_path(Path(work))
        data = write_input_data(config, Path(work) / "users.json")
        if args.crossing:
            results.update(crossing(args, config, args.perf_analyzer, env, data, Path(work)))
            args.instances = ""
        for instances in (int(k) for k in args.instances.split(",") if k):
            variants = [(instances, True), (instances, False)] if instances > 1 else [(1, True)]
            if args.with_one and instances > 1:
                variants.append((1, True))  # one model of one instance: the bound of shards in one process
            results["rows"] += measure(args, config, args.perf_analyzer, env, data, Path(work), variants)
    results["load_after"] = [round(x, 2) for x in os.getloadavg()]
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    points = [point for row in results["rows"] for point in row["rounds"]]
    points += [row[p] for row in results.get("crossing", []) for p in args.protocols.split(",") if p in row]
    failed = [point["error"] for point in points if "error" in point]
    if failed:
        raise SystemExit(f"perf_analyzer failed at {len(failed)} point(s): {failed[0]}")


if __name__ == "__main__":
    main()
