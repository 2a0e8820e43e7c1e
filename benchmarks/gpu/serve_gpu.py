"""A CUDA package served through Triton on the GPU host, as a user runs it: `kvexport serve OUT`
(the serve extra's tritonserver) answers the artifact's trace one user per request, refuses a
hostile request alone, and costs what over scoring the same request in-process at one client.

The client is the standard library's HTTP (KServe v2 JSON), so the host needs nothing beyond the
serve extra. Expected values are the trace's: the eager model's, recorded when the artifact was
built. Exit 1 when any answer differs from them beyond the artifact's tolerance or the hostile
request is not refused alone.

    python benchmarks/gpu/serve_gpu.py OUT [--json serve.json] [--repeats 100]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import torch

from kvexport.artifact import open_artifact
from kvexport.host.package import load
from kvexport.model.batch import Batch, UserRequest
from kvexport.options import ServeOptions
from kvexport.serving.triton import serve_command
from kvexport.trace.record import load_trace_step

START_TIMEOUT_S = 600


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`kvexport serve OUT` on loopback, free ports; its output in a log file."""

    def __init__(self, artifact: Path, work: Path):
        self.http = free_port()
        self.log_path = work / "serve.log"
        self._log = self.log_path.open("w")
        options = ServeOptions(
            address="127.0.0.1", http_port=self.http, grpc_port=free_port(), metrics_port=free_port()
        )
        self.process = subprocess.Popen(
            serve_command(artifact, options),
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.ready():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                sys.exit(f"kvexport serve did not come up:\n{self.log_path.read_text()[-3000:]}")
            time.sleep(0.5)

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http}/v2/health/ready", timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def infer(self, model: str, user: UserRequest, num_tasks: int) -> tuple[int, np.ndarray | str]:
        """(HTTP status, logits [T, num_tasks] or the error message)."""
        tensors = {
            "user_id": torch.tensor([[user.user_id]]),
            "item_ids": user.item_ids[None],
            "action_ids": user.action_ids[None],
            "context_ids": user.context_ids[None],
            "candidate_ids": user.candidate_ids[None],
        }
        body = {
            "inputs": [
                {"name": name, "datatype": "INT64", "shape": list(t.shape), "data": t.flatten().tolist()}
                for name, t in tensors.items()
            ],
            "outputs": [{"name": "logits"}],
        }
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.http}/v2/models/{model}/infer",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                output = json.load(response)["outputs"][0]
                return response.status, np.asarray(output["data"], dtype=np.float32).reshape(-1, num_tasks)
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read() or b"{}").get("error", "")

    def stop(self) -> int:
        self.process.terminate()
        try:
            code = self.process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = self.process.wait()
        self._log.close()
        return code


def at_once(server: Server, model: str, users: list[UserRequest], num_tasks: int) -> list:
    """The users' requests sent together (one thread each), so Triton may batch them."""
    with concurrent.futures.ThreadPoolExecutor(len(users)) as pool:
        return list(pool.map(lambda u: server.infer(model, u, num_tasks), users))


def percentiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "p50_ms": round(statistics.median(ordered) * 1e3, 3),
        "p99_ms": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1e3, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--repeats", type=int, default=100)
    args = parser.parse_args()
    artifact = open_artifact(args.artifact)
    config, atol = artifact.config, artifact.tolerance["atol"]
    model, num_tasks = config.name, config.model.num_tasks
    report: dict = {
        "artifact": str(args.artifact),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "atol": atol,
    }
    last: dict[int, tuple[UserRequest, np.ndarray]] = {}  # each user's last request and its expected logits
    with tempfile.TemporaryDirectory() as work:
        server = Server(args.artifact, Path(work))
        try:
            worst, mismatches, requests = 0.0, [], 0
            for step in artifact.trace_steps:
                if step.get("expect_error"):
                    continue  # its users together exceed the cache: refused as one request, not served per user
                batch, cached, _ = load_trace_step(args.artifact / step["file"], True)
                users = Batch(**batch).users()
                expected = cached.float().numpy().reshape(-1, num_tasks)
                rows = np.split(expected, np.cumsum([len(u.candidate_ids) for u in users])[:-1])
                for user, want, (status, got) in zip(users, rows, at_once(server, model, users, num_tasks)):
                    requests += 1
                    if status != 200:
                        mismatches.append(f"{step['file']} user {user.user_id}: HTTP {status} {got}")
                        continue
                    error = float(np.abs(got - want).max())
                    worst = max(worst, error)
                    if error > atol:
                        mismatches.append(f"{step['file']} user {user.user_id}: off by {error:.3g}")
                    last[user.user_id] = (user, want)
            report["trace"] = {"requests": requests, "mismatches": mismatches, "worst_abs_error": worst}
            print(f"trace: {requests} requests, {len(mismatches)} mismatches, worst {worst:.3g} (atol {atol})")

            # A hostile request (an item outside the vocabulary) among returning users re-sending their
            # last request: it alone is refused; theirs are answered as before.
            others = list(last.values())[:3]
            hostile_user, _ = others[0]
            items = hostile_user.item_ids.clone()
            items[-1] = config.model.item_vocab_size
            hostile = UserRequest(
                hostile_user.user_id + 10**9,
                items,
                hostile_user.action_ids,
                hostile_user.context_ids,
                hostile_user.candidate_ids,
            )
            answers = at_once(server, model, [hostile] + [u for u, _ in others], num_tasks)
            status, message = answers[0]
            others_ok = all(
                s == 200 and float(np.abs(got - want).max()) <= atol for (s, got), (_, want) in zip(answers[1:], others)
            )
            report["hostile"] = {"status": status, "message": message, "others_answered_exactly": others_ok}
            print(f"hostile: HTTP {status} {message!r}; the {len(others)} users beside it exact: {others_ok}")

            # One client, one returning user re-sending its last request (its whole prefix cached).
            user, _ = others[1]
            served = []
            for _ in range(args.repeats + 10):
                started = time.perf_counter()
                server.infer(model, user, num_tasks)
                served.append(time.perf_counter() - started)
            report["served"] = percentiles(served[10:])
        finally:
            report["serve_exit_code"] = server.stop()
    with load(args.artifact) as package:
        one = Batch.concat([user])
        in_process = []
        for _ in range(args.repeats + 10):
            started = time.perf_counter()
            package.run(one).cpu()
            in_process.append(time.perf_counter() - started)
    report["in_process"] = percentiles(in_process[10:])
    report["overhead_p50_ms"] = round(report["served"]["p50_ms"] - report["in_process"]["p50_ms"], 3)
    print(
        f"one client: served p50 {report['served']['p50_ms']} ms, in-process p50 {report['in_process']['p50_ms']} "
        f"ms, overhead {report['overhead_p50_ms']} ms; kvexport serve exited {report['serve_exit_code']}"
    )
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    ok = not report["trace"]["mismatches"] and status == 400 and others_ok and report["serve_exit_code"] == 0
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
