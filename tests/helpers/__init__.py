"""Helpers shared by the test modules; no test module imports another (tests/test_layout.py).

- configs: `tiny_config(**overrides)`, `tiny_raw`, `write_config` (hstu-tiny with changed fields)
- network: `free_port`, `free_ports`
- artifacts: `edit_manifest`, `rehash`, `assert_verifies_and_replays`
- runtime: scratch cache runtimes and a request through the runtime ops
- attention: the paged attention's plain-PyTorch reference and inputs
- serving: Triton clients, `kvexport serve` processes, scrapes, and the `eager` fixture
- remote: the tests' redis-server, a RESP client, proxies, and the `redis_server`/`redis` fixtures
- hostile, plain_host: the hostile request corpus and the plain-torch host that runs it
- reference, meta_reference, nvidia_reference: the model and the trainers' forwards, written apart
- meta_fixture, nvidia_fixture, sharded_writer: checkpoints in the trainers' own layouts
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent  # the repository
