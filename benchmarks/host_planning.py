"""Host planning of a cached request: the time of kvexport::check_request and kvexport::begin_batch
(model.pt2's planning), and of kvexport::begin_step (the step program's: the same planning, plus its
inputs laid out and padded to a bucket in one buffer), side by side.

The H200 workload's shapes (configs/hstu-kuairand-1k.yaml: 4064 cached + 32 new events, 100
candidates per user) on a CPU runtime of a one-layer, narrow model: the ops' work depends on the
token counts, not on the model's width. Steady state: the users' prefixes are cached once, then
each repetition checks and plans the same request and aborts it, so every repetition reuses
exactly the cached prefix. --gap-ms idles the host between repetitions, as the device's part of a
GPU request does: the next request's passes then start on caches that other work may have cooled.

--threads runs the whole sweep once per intra-op thread count (the team that lays out and
compares a request of many tokens), e.g. 1,4,16 on a GPU host to see whether waking the team pays.

    .venv/bin/python benchmarks/host_planning.py --batch 1,8,32 [--gap-ms 1.3] [--threads 1,2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import yaml

from kvexport.bench.suite import SweepRequests
from kvexport.cached import CachedRanker
from kvexport.config import config_from_dict
from kvexport.model.hstu import HSTURanker
from kvexport.ops import wrappers as kv

CONFIG = "configs/hstu-kuairand-1k.yaml"


def planning_config(batch_size: int):
    raw = yaml.safe_load(open(CONFIG))
    raw["name"] = "host-planning"
    raw["model"].update(num_layers=1, hidden_size=32, num_heads=1, head_dim=32, mlp_hidden_size=32, dtype="float32")
    raw["serving"]["device"] = "cpu"
    m, page_size = raw["model"], raw["kv_cache"]["page_size"]
    pages_per_user = -(-(m["num_contextual_features"] + 2 * m["max_history_length"]) // page_size)
    raw["kv_cache"].update(device_pages=pages_per_user * batch_size, host_pages=64)  # no eviction
    return config_from_dict(raw)


def measure(
    batch_size: int, repeats: int, cached_events: int, new_events: int, candidates: int, gap_ms: float = 0.0
) -> dict:
    config = planning_config(batch_size)
    model = HSTURanker(config).eval()
    requests = SweepRequests(
        config, cached_events, batch_size, first_user=0, new_events=new_events, candidates=candidates
    )
    name, placement = config.name, model.position_embedding.weight
    limits, runtime_config = config.request_limits_json(), config.runtime_json()
    check_us, begin_us, step_us = [], [], []
    with torch.no_grad():
        CachedRanker(model, name).run(requests.variant(0))
        batch = requests.variant(1)
        for _ in range(repeats):
            if gap_ms > 0:
                time.sleep(gap_ms / 1e3)
            started = time.perf_counter()
            user_ids, token_lengths, token_ids, num_candidates, candidate_ids = kv.check_request(
                name, limits, *batch.tensors()
            )
            checked = time.perf_counter()
            kv.begin_batch(name, runtime_config, user_ids, token_ids, token_lengths, num_candidates, placement)
            planned = time.perf_counter()
            kv.abort_batch(name)
            stepped = time.perf_counter()
            kv.begin_step(
                name,
                runtime_config,
                user_ids,
                token_ids,
                token_lengths,
                num_candidates,
                candidate_ids,
                placement,
                config.model.max_prefix_length,
            )
            step_us.append((time.perf_counter() - stepped) * 1e6)
            kv.abort_batch(name)
            check_us.append((checked - started) * 1e6)
            begin_us.append((planned - checked) * 1e6)
    kv.drop_runtime(name)
    check, begin, step = (statistics.median(us) for us in (check_us, begin_us, step_us))
    return {
        "batch_size": batch_size,
        "check_request_us": round(check, 1),
        "begin_batch_us": round(begin, 1),
        "begin_step_us": round(step, 1),
        "total_us": round(check + begin, 1),
        "repeats": repeats,
        "gap_ms": gap_ms,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", default="1,8,32", help="comma-separated batch sizes")
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--cached-events", type=int, default=4064)
    parser.add_argument("--new-events", type=int, default=32)
    parser.add_argument("--candidates", type=int, default=100)
    parser.add_argument("--threads", help="comma-separated intra-op thread counts (default: torch's)")
    parser.add_argument(
        "--gap-ms",
        type=float,
        default=0.0,
        help="idle milliseconds before each repetition (a GPU request's device wait)",
    )
    args = parser.parse_args()
    if args.gap_ms < 0:
        parser.error(f"--gap-ms must be >= 0, got {args.gap_ms}")
    thread_counts = [int(t) for t in args.threads.split(",")] if args.threads else [torch.get_num_threads()]
    if min(thread_counts) < 1:
        parser.error(f"--threads must be positive, got {args.threads}")
    for threads in thread_counts:
        torch.set_num_threads(threads)
        for batch_size in (int(b) for b in args.batch.split(",")):
            row = measure(batch_size, args.repeats, args.cached_events, args.new_events, args.candidates, args.gap_ms)
            print(
                f"{threads:2d} threads, batch {row['batch_size']:3d}: "
                f"check_request {row['check_request_us']:7.1f} us, "
                f"begin_batch {row['begin_batch_us']:7.1f} us, total {row['total_us']:7.1f} us; "
                f"begin_step {row['begin_step_us']:7.1f} us (median of {args.repeats}, {args.gap_ms} ms apart)"
            )


if __name__ == "__main__":
    main()
