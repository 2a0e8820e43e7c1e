"""What the library's entry points take besides a config or an artifact, with their defaults.

Each default is stated here once: the entry points take these dataclasses, and the command line
shows and passes their defaults. Nothing here imports torch, so `kvexport --help` can read them.
"""

from __future__ import annotations

import dataclasses

from kvexport.remote import DEFAULT_WRITE_POLICY

# A model's random initialisation when no checkpoint is given (kvexport.model.build_model).
INIT_SEED = 0
ITEM_TABLE = "video_id"  # the item feature's table in both trainers' example configs


@dataclasses.dataclass(frozen=True)
class NvidiaOptions:
    """Importing an NVIDIA recsys-examples checkpoint (kvexport.importers.nvidia_ranking)."""

    item_table: str = ITEM_TABLE  # the dynamic (or data-parallel) table of the item feature
    action_table: str = "action_weights"
    table_rows: dict[str, int] = dataclasses.field(default_factory=dict)  # rows of each data-parallel table
    # The trainer's contextual features in token order (recsys-examples' dataset preprocessor's
    # order); each names its table, data-parallel or dynamic.
    contextual_features: tuple[str, ...] = ()
    # Import without the trainer's contextual features (their tables are left out), as recsys-examples'
    # own inference runs with disable_contextual_features; without either option such tables are refused.
    skip_contextual: bool = False
    iteration: int | None = None  # the iter<N> directory (default: the newest)


@dataclasses.dataclass(frozen=True)
class MetaOptions:
    """Importing a Meta generative-recommenders DLRMv3 checkpoint (kvexport.importers.meta_dlrmv3)."""

    num_heads: int  # not in the checkpoint: DLRMv3's config (hstu_num_heads)
    max_history_length: int  # the longest history served (kvexport's positions count from it)
    max_num_candidates: int
    item_table: str = ITEM_TABLE
    contextual_features: tuple[str, ...] = ()  # tables in the trainer's contextual feature order
    items: tuple[int, ...] | None = None  # the item ids served; None: the whole table, ids as rows
    # The time row every history event reads in place of its age's bucket: "zero" (row 0, an event
    # that just happened) or "none" (no time row); benchmarks/meta_rules.py measures both.
    history_time: str = "zero"
    history_positions: str = "from_max"
    # Each named contextual feature's served ids: only their rows are read (the others: every row).
    context_ids: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    batch: int | None = None  # the <batch> directory (default: the newest)


@dataclasses.dataclass(frozen=True)
class SampleOptions:
    """A generated batch scored by the eager model (kvexport.model.score_sample)."""

    num_users: int = 2
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class ReplayOptions:
    """The C++ harness's replay of an artifact's trace (kvexport.trace.replay.run_replay)."""

    repeat: int = 1  # replays of the whole trace, each from an empty cache
    threads: int = 1  # threads replaying it concurrently through one loaded package
    atol: float | None = None  # None: the manifest's tolerance
    rtol: float | None = None
    route: str = "model"  # model: model.pt2; step: step.pt2 after planning; graphs: step.pt2 as CUDA graphs


@dataclasses.dataclass(frozen=True)
class SoakOptions:
    """A seeded random workload checked against the eager model (kvexport.trace.soak.soak)."""

    num_requests: int = 300
    num_users: int = 40
    seed: int = 0
    route: tuple[int, int] = (0, 1)  # (I, N): the requests a seeded router sends to process I of N


@dataclasses.dataclass(frozen=True)
class BenchOptions:
    """`kvexport bench`'s sweep (kvexport.bench.run.run_benchmarks)."""

    lengths: tuple[int, ...] = (64, 256, 1024, 4096)  # cached history events swept
    warmup: int = 1  # untimed repetitions
    repeats: int = 5  # timed repetitions


@dataclasses.dataclass(frozen=True)
class RepositoryOptions:
    """A Triton model repository's models (kvexport.serving.repository.write_repository)."""

    instances: int = 1  # cache shards per GPU (or on the host)
    gpus: int = 1  # GPUs a CUDA package's shards spread over
    routing: bool = True  # a router sends each user to one shard (when there are several)
    batching: bool = True  # Triton's dynamic batcher merges concurrent users
    # Intra-op CPU threads of each model instance. One: a server's concurrency comes from batching and
    # instances, and torch's default (one thread per core) spins on a small request's work, doubling
    # its CPU time for no gain in wall time.
    threads: int = 1


@dataclasses.dataclass(frozen=True)
class ServeOptions:
    """An artifact served under tritonserver (kvexport.serving.triton.Server)."""

    address: str = "0.0.0.0"
    http_port: int = 8000  # Triton's own defaults, for its three ports
    grpc_port: int = 8001
    metrics_port: int = 8002
    batching: bool = RepositoryOptions.batching
    threads: int = RepositoryOptions.threads
    remote: str | None = None  # a shared remote KV tier's URL, as kvexport.load takes it
    remote_write: str = DEFAULT_WRITE_POLICY
