"""Typed model configuration: one YAML file per model, loaded into frozen dataclasses.

Layout of a config file::

    name: hstu-tiny
    model:    {num_layers, hidden_size, num_heads, head_dim, ...}
    kv_cache: {page_size, device_pages, host_pages, remote_read_budget_us, remote_ttl_s, dtype,
               fp8_max_ranking_drop}
    serving:  {max_batch_size, device, cpu_isa}
    trace:    {seed, num_users, ...}

Every rule is checked once, here, with a one-line message naming the field and value.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from kvexport.errors import UserError

DTYPES = ("float32", "bfloat16", "float16")
# kv_cache.dtype: the model's dtype (the default), or FP8 pages (docs/design.md §2.7).
FP8_PAGES = "float8_e4m3"
# Why a CUDA package cannot have FP8 pages yet (config check, runtime, build).
FP8_CUDA_REFUSAL = "FP8 pages need the Hopper kernel's FP8 path, not built yet"
DEVICES = ("cpu", "cuda")
# The CPU a package's machine code is compiled for: this host's ("native"), or a portable
# x86-64 baseline that any newer CPU runs (kvexport/native/isa.py).
CPU_ISAS = ("native", "x86-64-v2", "x86-64-v3")
# The prediction head's activation between its two linear layers (docs/design.md §1.5): kvexport's
# SiLU, or ReLU as NVIDIA recsys-examples' ranking head uses by default.
HEAD_ACTIVATIONS = ("silu", "relu")
# Which of a layer's projections get SiLU (docs/design.md §1.3): all four (kvexport, NVIDIA) or u
# only (Meta's DLRMv3).
SILU_ON = ("uvqk", "u")
# What a layer's output projection reads: u * LN(o) ("gated": kvexport, NVIDIA) or the
# concatenation [u, o, u * LN(o)] ("concat": Meta's DLRMv3).
LAYER_OUTPUTS = ("gated", "concat")
# What a request's item ids are (docs/checkpoint.md): rows of the item table ("rows": kvexport's
# own, 0..item_vocab_size-1), or the trainer's keys ("keys": any id >= 0; the checkpoint's
# item_keys name the table's rows, and every id not among them reads its last row), as a trainer
# with a hash-keyed table (NVIDIA's dynamic embeddings) stores them.
ITEM_IDS = ("rows", "keys")
# Where a request's item ids end in "keys" mode: int64's largest value (exclusive).
MAX_ITEM_KEY = 2**63 - 1
# What a request's context ids are: rows of the one shared context table ("rows": kvexport's own), or
# each feature's own keys ("keys": a trainer with one table per contextual feature). With keys, the
# checkpoint's context_keys hold (feature << CONTEXT_FEATURE_SHIFT) | key for every row but the last,
# ascending, and a pair that is not among them reads the last row (docs/design.md §1.2).
CONTEXT_IDS = ("rows", "keys")
# How a history event becomes tokens (docs/design.md §1.2): an item token then an action token
# ("pairs": kvexport's own, NVIDIA), or one token whose embedding is the item's row plus the
# action's ("combined": Meta's DLRMv3 adds its action encoding to the item token). A combined
# token's id is (item << action bits) | action, so the cache compares events whole.
EVENT_TOKENS = ("pairs", "combined")
# Which position row a user's candidates read (docs/design.md §1.2): the row of the prefix's length
# ("after_prefix": kvexport, NVIDIA), or the table's last row, which only candidates read
# ("shared_row": a trainer whose candidates share one position whatever the history's length, as
# Meta's DLRMv3 puts every candidate at the position just past the contextual tokens).
CANDIDATE_POSITIONS = ("after_prefix", "shared_row")
# What a contextual token attends to (docs/design.md §1.4): the tokens before it and itself
# ("causal": kvexport, every trainer's inference), or every token of the user's prefix
# ("whole_prefix": NVIDIA recsys-examples' training default, without disable_contextual_mask).
# With whole_prefix every cached state depends on the whole prefix, so a user's cache is reused
# only when its prefix is unchanged (new candidates for the same history).
CONTEXT_ATTENTION = ("causal", "whole_prefix")
# The prediction head (docs/design.md §1.5): "mlp" (kvexport, NVIDIA) L2-normalises the candidate's
# state and runs Linear, activation, Linear; "item_tower" (Meta's DLRMv3) combines the state with
# features of the request's query time, multiplies it by the candidate's row of a second item table
# (the item tower) and runs Linear, SwishLayerNorm, Linear. With item_tower a request's context_ids
# carry one more column, its query time in seconds, and model.query_time_periods say which
# calendar features of it the head reads.
HEADS = ("mlp", "item_tower")
# Most distinct query-time codes an item_tower head reads (the product of the periods' units).
MAX_TIME_CODES = 1 << 16
CONTEXT_FEATURE_SHIFT = 56
MAX_CONTEXT_KEY = 2**CONTEXT_FEATURE_SHIFT  # context keys lie in [0, 2^56)
MAX_KEYED_CONTEXT_FEATURES = 2 ** (63 - CONTEXT_FEATURE_SHIFT)  # so that every pair is a non-negative int64


class ConfigError(UserError):
    """The user's config is unusable; the message names the field and value."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    num_layers: int
    hidden_size: int
    num_heads: int
    head_dim: int
    num_contextual_features: int
    max_history_length: int
    max_num_candidates: int
    scaling_seqlen: int
    num_tasks: int
    dtype: str
    context_vocab_size: int
    item_vocab_size: int
    action_vocab_size: int
    mlp_hidden_size: int
    head_activation: str = "silu"
    layer_norm_eps: float = 1e-5
    silu_on: str = "uvqk"
    layer_output: str = "gated"
    item_ids: str = "rows"
    context_ids: str = "rows"
    event_tokens: str = "pairs"
    candidate_position: str = "after_prefix"
    head: str = "mlp"
    context_attention: str = "causal"
    # [seconds per unit, units per cycle] of each calendar feature an item_tower head reads from the
    # query time: [[3600, 24], [86400, 7]] is the hour of the day and the day of the week.
    query_time_periods: tuple = ()

    @property
    def action_bits(self) -> int:
        """Low bits of a combined event token that hold its action id."""
        return (self.action_vocab_size - 1).bit_length()

    @property
    def tokens_per_event(self) -> int:
        return 2 if self.event_tokens == "pairs" else 1

    @property
    def num_time_codes(self) -> int:
        """Distinct calendar codes of a query time (item_tower head): the product of the periods' units."""
        return math.prod(units for _, units in self.query_time_periods)

    @property
    def time_code_bits(self) -> int:
        """Low bits of a checked candidate id that hold its query time's code (0 without item_tower)."""
        return (self.num_time_codes - 1).bit_length() if self.head == "item_tower" else 0

    @property
    def context_rows_see_prefix(self) -> int:
        """A user's first rows that read its whole prefix: its contextual tokens under
        context_attention whole_prefix, else none."""
        return self.num_contextual_features if self.context_attention == "whole_prefix" else 0

    @property
    def context_width(self) -> int:
        """Columns of a request's context_ids: the contextual features, then (item_tower) the query time."""
        return self.num_contextual_features + (self.head == "item_tower")

    @property
    def item_id_limit(self) -> int:
        """Item ids of a request lie in [0, item_id_limit): the table's rows, or any key >= 0 below
        2^(63 - b), b the low bits a combined event token keeps for the action or a checked
        candidate for its query time's code."""
        if self.item_ids == "rows":
            return self.item_vocab_size
        low_bits = max(self.action_bits if self.event_tokens == "combined" else 0, self.time_code_bits)
        return min(MAX_ITEM_KEY, 1 << (63 - low_bits))

    @property
    def context_id_limit(self) -> int:
        """Context ids of a request lie in [0, context_id_limit): the shared table's rows, or keys < 2^56."""
        return self.context_vocab_size if self.context_ids == "rows" else MAX_CONTEXT_KEY

    @property
    def max_prefix_length(self) -> int:
        """Most cacheable tokens of one user: context plus each event's tokens."""
        return self.prefix_length(self.max_history_length)

    def prefix_length(self, num_events: int) -> int:
        """Cacheable tokens of a user with num_events events."""
        return self.num_contextual_features + self.tokens_per_event * num_events


@dataclasses.dataclass(frozen=True)
class KVCacheConfig:
    page_size: int
    device_pages: int
    host_pages: int
    # A request whose ops stop for this long (its host failed it between two ops) loses the
    # runtime to the next waiting request; see docs/hosting.md.
    stall_timeout_ms: int = 10000
    # The remote tier, when a host attaches one (kvexport.load(remote=...)): a batch waits at most
    # this long for its users' remote entries (then recomputes them), and entries expire this long
    # after they were written (0: never; see docs/hosting.md, *Remote tier*).
    remote_read_budget_us: int = 5000
    remote_ttl_s: int = 86400
    # How pages store keys and values: the model's dtype (left out: filled in from model.dtype) or
    # float8_e4m3 (docs/design.md §2.7).
    dtype: str = ""
    # With FP8 pages, the build's ranking check refuses them when the lower end of a drop's one-sided
    # bootstrap interval (top-10 order kept, or a task's ROC-AUC, below the model's own dtype's; 95%
    # over all the measures together) passes this bound (kvexport/trace/ranking.py).
    fp8_max_ranking_drop: float = 0.001

    @property
    def fp8_pages(self) -> bool:
        return self.dtype == FP8_PAGES

    def pages_for(self, num_tokens: int) -> int:
        """Pages that hold num_tokens cached tokens."""
        return -(-num_tokens // self.page_size)


@dataclasses.dataclass(frozen=True)
class ServingConfig:
    max_batch_size: int
    device: str = "cpu"
    cpu_isa: str = "native"


@dataclasses.dataclass(frozen=True)
class TraceConfig:
    """How `kvexport build` generates the recorded request sequence."""

    seed: int = 0
    num_users: int = 8
    min_history_length: int = 4
    max_trace_history_length: int = 64
    max_new_events: int = 8
    num_candidates: int = 8
    # Fresh users of the FP8 ranking check (FP8 pages only; kvexport/trace/ranking.py).
    ranking_users: int = 64


@dataclasses.dataclass(frozen=True)
class ToleranceConfig:
    """How verify/replay tolerances follow from the error measured at build time (docs/design.md §5).

    atol = margin * (eager output vs float32 full recompute), never below the dtype's floor; a
    non-zero atol here replaces the derived one (the manifest still records the measurement).
    """

    margin: float = 4.0
    rtol: float = 0.0
    atol: float = 0.0


@dataclasses.dataclass(frozen=True)
class Config:
    name: str
    model: ModelConfig
    kv_cache: KVCacheConfig
    serving: ServingConfig
    trace: TraceConfig = TraceConfig()
    tolerance: ToleranceConfig = ToleranceConfig()

    def to_dict(self) -> dict[str, Any]:
        """Plain values (lists, not tuples), as YAML and JSON write them."""
        return json.loads(json.dumps(dataclasses.asdict(self)))

    def runtime_json(self) -> str:
        """The cache runtime's config, as the C++ op library reads it."""
        m, c = self.model, self.kv_cache
        return json.dumps(
            {
                "num_layers": m.num_layers,
                "num_heads": m.num_heads,
                "head_dim": m.head_dim,
                "dtype": m.dtype,
                "page_size": c.page_size,
                "device_pages": c.device_pages,
                "host_pages": c.host_pages,
                "stall_timeout_ms": c.stall_timeout_ms,
                "remote_read_budget_us": c.remote_read_budget_us,
                "remote_ttl_s": c.remote_ttl_s,
                # Only with FP8 pages: a package in the model's dtype keeps its runtime config (and name).
                **({"kv_dtype": c.dtype} if c.fp8_pages else {}),
                # Only when set: a causal package's runtime config (and the runtime name digested from
                # it) does not name an option it does not use.
                **({"context_rows_see_prefix": m.context_rows_see_prefix} if m.context_rows_see_prefix else {}),
            },
            sort_keys=True,
        )

    def request_limits_json(self) -> str:
        """The limits every request is checked against inside the package (kvexport::check_request)."""
        m = self.model
        return json.dumps(
            {
                "max_batch_size": self.serving.max_batch_size,
                "max_history_length": m.max_history_length,
                "max_num_candidates": m.max_num_candidates,
                "num_contextual_features": m.num_contextual_features,
                "context_vocab_size": m.context_id_limit,
                "item_vocab_size": m.item_id_limit,
                "action_vocab_size": m.action_vocab_size,
                # Derived here once; the op library lays out and shifts by them as given.
                "tokens_per_event": m.tokens_per_event,
                "context_width": m.context_width,
                "time_code_bits": m.time_code_bits,
                # Only when combined or with an item tower: absent, the op library reads pairs and no query time.
                **({"combined_action_bits": m.action_bits} if m.event_tokens == "combined" else {}),
                **({"query_time_periods": [list(p) for p in m.query_time_periods]} if m.head == "item_tower" else {}),
            },
            sort_keys=True,
        )


_SECTIONS = {
    "model": ModelConfig,
    "kv_cache": KVCacheConfig,
    "serving": ServingConfig,
    "trace": TraceConfig,
    "tolerance": ToleranceConfig,
}


def _yaml_float(text: str) -> float | str:
    """A number in exponent notation that YAML left as a string ("1e-6"); other text unchanged."""
    try:
        return float(text) if any(c.isdigit() for c in text) and math.isfinite(float(text)) else text
    except ValueError:
        return text


def _build(cls: type, raw: Any, where: str) -> Any:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where} must be a mapping, got {type(raw).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ConfigError(f"unknown key {where}.{unknown[0]}")
    values = {}
    for name, field in fields.items():
        key = f"{where}.{name}"
        if name not in raw:
            has_default = field.default is not dataclasses.MISSING
            if not has_default:
                raise ConfigError(f"missing key {key}")
            continue
        value = raw[name]
        if field.type == "tuple":
            values[name] = _int_pairs(key, value)
            continue
        if field.type == "float" and isinstance(value, str):
            value = _yaml_float(value)  # YAML 1.1 reads 1e-6 (no dot) as a string
        expected = {"int": int, "str": str, "float": (int, float)}[field.type]
        if isinstance(value, bool) or not isinstance(value, expected):
            raise ConfigError(f"{key} must be {field.type}, got {value!r}")
        values[name] = value
    return cls(**values)


def _int_pairs(key: str, value: Any) -> tuple:
    """A YAML list of [int, int] pairs as a tuple of tuples."""
    if not isinstance(value, (list, tuple)) or not all(
        isinstance(pair, (list, tuple))
        and len(pair) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) for v in pair)
        for pair in value
    ):
        raise ConfigError(f"{key} must be a list of [int, int] pairs, got {value!r}")
    return tuple(tuple(pair) for pair in value)


def _positive(where: str, **fields: int) -> None:
    for name, value in fields.items():
        if value <= 0:
            raise ConfigError(f"{where}.{name} must be > 0, got {value}")


def _check_tolerance(tol: ToleranceConfig) -> None:
    if not (math.isfinite(tol.margin) and tol.margin >= 1):
        raise ConfigError(f"tolerance.margin must be a finite number >= 1, got {tol.margin}")
    for name in ("rtol", "atol"):
        value = getattr(tol, name)
        if not (math.isfinite(value) and value >= 0):
            raise ConfigError(f"tolerance.{name} must be a finite number >= 0, got {value}")


def _check_head(m: ModelConfig) -> None:
    if m.head == "mlp":
        if m.query_time_periods:
            raise ConfigError("model.query_time_periods is read only by model.head: item_tower")
        return
    if m.head_activation != "silu":
        raise ConfigError("model.head_activation applies to model.head: mlp (item_tower's is SwishLayerNorm)")
    if not m.query_time_periods:
        raise ConfigError(
            "model.query_time_periods must name at least one [seconds, units] period with model.head: item_tower"
        )
    for seconds, units in m.query_time_periods:
        if seconds <= 0 or units <= 0 or seconds >= 1 << 24:
            raise ConfigError(f"model.query_time_periods: [{seconds}, {units}] must be positive, seconds below 2^24")
    if not 2 <= m.num_time_codes <= MAX_TIME_CODES:
        raise ConfigError(
            f"model.query_time_periods make {m.num_time_codes} codes; an item_tower head reads 2 to {MAX_TIME_CODES}"
        )
    if m.item_ids == "rows" and m.item_vocab_size > 1 << (63 - m.time_code_bits):
        raise ConfigError(
            f"model.item_vocab_size ({m.item_vocab_size}) leaves no room for the query time's "
            f"{m.time_code_bits}-bit code in a checked candidate id"
        )


def _check(config: Config) -> None:
    _check_tolerance(config.tolerance)
    m, c, s, t = config.model, config.kv_cache, config.serving, config.trace
    if not config.name or not all(ch.isalnum() or ch in "-_." for ch in config.name):
        raise ConfigError(f"name must be non-empty and use only letters, digits, '-', '_' or '.', got {config.name!r}")
    _positive(
        "model",
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_heads=m.num_heads,
        head_dim=m.head_dim,
        max_history_length=m.max_history_length,
        max_num_candidates=m.max_num_candidates,
        scaling_seqlen=m.scaling_seqlen,
        num_tasks=m.num_tasks,
        context_vocab_size=m.context_vocab_size,
        item_vocab_size=m.item_vocab_size,
        action_vocab_size=m.action_vocab_size,
        mlp_hidden_size=m.mlp_hidden_size,
    )
    if m.num_contextual_features < 0:
        raise ConfigError(f"model.num_contextual_features must be >= 0, got {m.num_contextual_features}")
    if m.hidden_size != m.num_heads * m.head_dim:
        raise ConfigError(
            f"model.hidden_size ({m.hidden_size}) must equal model.num_heads ({m.num_heads}) "
            f"* model.head_dim ({m.head_dim})"
        )
    if m.dtype not in DTYPES:
        raise ConfigError(f"model.dtype must be one of {', '.join(DTYPES)}, got {m.dtype!r}")
    for name, allowed in (
        ("head_activation", HEAD_ACTIVATIONS),
        ("silu_on", SILU_ON),
        ("layer_output", LAYER_OUTPUTS),
        ("item_ids", ITEM_IDS),
        ("context_ids", CONTEXT_IDS),
        ("event_tokens", EVENT_TOKENS),
        ("candidate_position", CANDIDATE_POSITIONS),
        ("head", HEADS),
        ("context_attention", CONTEXT_ATTENTION),
    ):
        if getattr(m, name) not in allowed:
            raise ConfigError(f"model.{name} must be one of {', '.join(allowed)}, got {getattr(m, name)!r}")
    if m.context_ids == "keys" and not 0 < m.num_contextual_features <= MAX_KEYED_CONTEXT_FEATURES:
        raise ConfigError(
            f"model.num_contextual_features must be 1..{MAX_KEYED_CONTEXT_FEATURES} with "
            f"model.context_ids: keys, got {m.num_contextual_features}"
        )
    if m.item_ids == "keys" and m.item_vocab_size < 2:
        raise ConfigError(
            f"model.item_vocab_size must be >= 2 with model.item_ids: keys (the keyed rows, then "
            f"the row of unknown ids), got {m.item_vocab_size}"
        )
    if m.event_tokens == "combined" and m.item_id_limit > 1 << (63 - m.action_bits):
        raise ConfigError(
            f"model.item_vocab_size ({m.item_vocab_size}) leaves no room for model.action_vocab_size "
            f"({m.action_vocab_size}) in a combined event token (items below 2^{63 - m.action_bits})"
        )
    _check_head(m)
    if not (math.isfinite(m.layer_norm_eps) and 0 < m.layer_norm_eps < 1):
        raise ConfigError(f"model.layer_norm_eps must be a number in (0, 1), got {m.layer_norm_eps}")
    if c.dtype not in (m.dtype, FP8_PAGES):
        raise ConfigError(f"kv_cache.dtype must be {FP8_PAGES} or model.dtype ({m.dtype}), got {c.dtype!r}")
    if c.fp8_pages and s.device == "cuda":
        raise ConfigError(f"kv_cache.dtype {FP8_PAGES} with serving.device cuda: {FP8_CUDA_REFUSAL}")
    _positive("kv_cache", page_size=c.page_size, device_pages=c.device_pages, stall_timeout_ms=c.stall_timeout_ms)
    if c.page_size & (c.page_size - 1):
        raise ConfigError(f"kv_cache.page_size must be a power of two, got {c.page_size}")
    if c.host_pages < 0:
        raise ConfigError(f"kv_cache.host_pages must be >= 0, got {c.host_pages}")
    _positive("kv_cache", remote_read_budget_us=c.remote_read_budget_us)
    if c.remote_ttl_s < 0:
        raise ConfigError(f"kv_cache.remote_ttl_s must be >= 0 (0: entries never expire), got {c.remote_ttl_s}")
    if not (math.isfinite(c.fp8_max_ranking_drop) and 0 <= c.fp8_max_ranking_drop <= 1):
        raise ConfigError(f"kv_cache.fp8_max_ranking_drop must be a number in [0, 1], got {c.fp8_max_ranking_drop}")
    pages_per_user = c.pages_for(m.max_prefix_length)
    if c.device_pages < pages_per_user:
        raise ConfigError(
            f"kv_cache.device_pages ({c.device_pages}) cannot hold one user at model.max_history_length "
            f"({m.max_history_length}), which needs {pages_per_user} pages"
        )
    if s.max_batch_size < 1:
        raise ConfigError(f"serving.max_batch_size must be >= 1, got {s.max_batch_size}")
    if s.device not in DEVICES:
        raise ConfigError(f"serving.device must be one of {', '.join(DEVICES)}, got {s.device!r}")
    if s.cpu_isa not in CPU_ISAS:
        raise ConfigError(f"serving.cpu_isa must be one of {', '.join(CPU_ISAS)}, got {s.cpu_isa!r}")
    _positive(
        "trace",
        num_users=t.num_users,
        min_history_length=t.min_history_length,
        max_new_events=t.max_new_events,
        num_candidates=t.num_candidates,
        ranking_users=t.ranking_users,
    )
    if not t.min_history_length <= t.max_trace_history_length <= m.max_history_length:
        raise ConfigError(
            f"trace.max_trace_history_length ({t.max_trace_history_length}) must lie between "
            f"trace.min_history_length ({t.min_history_length}) and model.max_history_length "
            f"({m.max_history_length})"
        )
    if t.num_candidates > m.max_num_candidates:
        raise ConfigError(
            f"trace.num_candidates ({t.num_candidates}) exceeds model.max_num_candidates ({m.max_num_candidates})"
        )


def config_from_dict(raw: Any) -> Config:
    """Builds and checks a Config from parsed YAML; raises ConfigError naming the bad field."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"config must be a mapping at the top level, got {type(raw).__name__}")
    unknown = sorted(set(raw) - {"name", *_SECTIONS})
    if unknown:
        raise ConfigError(f"unknown key {unknown[0]}")
    if "name" not in raw:
        raise ConfigError("missing key name")
    if not isinstance(raw["name"], str):
        raise ConfigError(f"name must be str, got {raw['name']!r}")
    sections = {}
    for section, cls in _SECTIONS.items():
        if section not in raw:
            if section in ("trace", "tolerance"):
                continue
            raise ConfigError(f"missing section {section}")
        sections[section] = _build(cls, raw[section], section)
    if not sections["kv_cache"].dtype and isinstance(sections["model"].dtype, str):
        sections["kv_cache"] = dataclasses.replace(sections["kv_cache"], dtype=sections["model"].dtype)
    config = Config(name=raw["name"], **sections)
    _check(config)
    return config


def load_config(path: str | Path) -> Config:
    """Reads a YAML config file with `yaml.safe_load`; raises ConfigError on any problem."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from exc
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise ConfigError(f"config {path} is not valid YAML{where}") from exc
    return config_from_dict(raw)
