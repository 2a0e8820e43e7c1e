"""Affinity across hosts: two plain tritonservers on loopback (each `kvexport triton-repo`'s
repository, its own cache) behind nginx, which hashes on the kvexport-user-id header with
consistent hashing, as docs/serving.md configures it. Each user's requests reach one server; once
one server is stopped, its users move to the other, which recomputes them: no wrong answer, no
error. Answers are compared with the eager model's; which server answered comes from nginx's own
access log."""

from __future__ import annotations

import dataclasses
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from kvexport.model.batch import UserRequest, random_user
from kvexport.serving.triton_router import ROUTING_HEADER
from tests.helpers.serving import ATOL, Client, needs_pytriton, plain_tritonserver, server_ports, started, user_arrays

needs_nginx = pytest.mark.skipif(
    shutil.which("nginx") is None, reason="nginx is not installed (make system-packages installs it)"
)

# docs/serving.md's load balancer, with this test's ports and files.
NGINX_CONF = """
user root;
worker_processes 1;
daemon off;
pid {work}/nginx.pid;
error_log {work}/nginx-error.log;
events {{ worker_connections 256; }}
http {{
    log_format routed '$http_kvexport_user_id $upstream_addr $status';
    access_log {work}/access.log routed;
    client_body_temp_path {work}/body;
    proxy_temp_path {work}/proxy;
    client_body_buffer_size 1m;
    upstream triton {{
        hash $http_kvexport_user_id consistent;
        server 127.0.0.1:{a};
        server 127.0.0.1:{b};
    }}
    server {{
        listen 127.0.0.1:{port};
        client_max_body_size 64m;
        location / {{
            proxy_pass http://triton;
            proxy_next_upstream error timeout;
        }}
    }}
}}
"""


def routed(access_log: Path) -> list[tuple[int, list[str]]]:
    """(user, the upstreams nginx tried, in order) of every request in the access log."""
    rows = []
    for line in access_log.read_text().splitlines():
        user, rest = line.split(" ", 1)
        if user == "-":  # a readiness probe, no routing header
            continue
        upstreams = rest.rsplit(" ", 1)[0]
        rows.append((int(user), upstreams.split(", ")))
    return rows


def routed_when(access_log: Path, count: int, timeout_s: float = 10.0) -> list[tuple[int, list[str]]]:
    """The routed rows once there are `count` of them (or timeout_s passed): nginx logs a request
    after it has answered it, so the client may have its answer before the line is written."""
    deadline = time.monotonic() + timeout_s
    while True:
        rows = routed(access_log)
        if len(rows) >= count or time.monotonic() > deadline:
            return rows
        time.sleep(0.01)


@needs_pytriton
@needs_nginx
@pytest.mark.slow
def test_a_consistent_hash_on_the_routing_header_keeps_each_user_on_one_server(
    tiny_artifact, tiny_config, tmp_path, eager
):
    m = tiny_config.model
    generator = torch.Generator().manual_seed(17)
    users = [random_user(m, generator, 7000 + u, 40, 3) for u in range(12)]

    def visit(v: int) -> list[UserRequest]:
        return [
            UserRequest(u.user_id, u.item_ids[: 8 + 8 * v], u.action_ids[: 8 + 8 * v], u.context_ids, u.candidate_ids)
            for u in users
        ]

    first, second = visit(0) + visit(1), visit(2) + visit(3)
    expected = eager(first + second)
    # The routing header forwarded to the model, as docs/serving.md's servers do.
    forward = ("--http-header-forward-pattern", f"^{ROUTING_HEADER}$")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    balancer = server_ports().http
    conf = tmp_path / "nginx.conf"
    with (
        plain_tritonserver(tiny_artifact, tmp_path / "b", server_options=forward) as (b, _, _),
        plain_tritonserver(tiny_artifact, tmp_path / "a", server_options=forward) as (a, _, a_process),
    ):
        conf.write_text(NGINX_CONF.format(work=tmp_path, a=a.http, b=b.http, port=balancer))
        with started(
            ["nginx", "-c", str(conf), "-p", str(tmp_path), "-e", str(tmp_path / "nginx-error.log")],
            tmp_path / "nginx.log",
            balancer,
        ):
            client = Client("http", dataclasses.replace(server_ports(), http=balancer), "hstu-tiny")

            def send(requests: list[UserRequest]) -> list[np.ndarray]:
                return [
                    client.client.infer(
                        "hstu-tiny", client.inputs(user_arrays(r)), headers={ROUTING_HEADER: str(r.user_id)}
                    ).as_numpy("logits")[0]
                    for r in requests
                ]

            try:
                got = send(first)
                before_stop = len(routed_when(tmp_path / "access.log", len(first)))
                a_process.terminate()  # server a goes away mid-run
                a_process.wait(timeout=60)
                got += send(second)
            finally:
                client.close()
    for k, (g, w) in enumerate(zip(got, expected)):
        np.testing.assert_allclose(g, w, rtol=0, atol=ATOL, err_msg=f"request {k}")
    rows = routed_when(tmp_path / "access.log", len(first) + len(second))
    assert len(rows) == len(first) + len(second)
    a_addr, b_addr = f"127.0.0.1:{a.http}", f"127.0.0.1:{b.http}"
    server_of: dict[int, set[str]] = {}
    for user, upstreams in rows[:before_stop]:
        server_of.setdefault(user, set()).add(upstreams[-1])
    assert all(len(servers) == 1 for servers in server_of.values()), server_of  # one server per user
    on_a = {user for user, servers in server_of.items() if servers == {a_addr}}
    assert on_a and len(on_a) < len(users)  # both servers had users
    for user, upstreams in rows[before_stop:]:  # after the stop: everyone on b, a's users after trying a
        assert upstreams[-1] == b_addr
        if user not in on_a:
            assert upstreams == [b_addr]
