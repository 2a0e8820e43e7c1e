"""How far cache-exact replacements of Meta DlrmHSTU's three per-request rules move its logits.

Upstream's inference (tests/helpers/meta_reference.py) divides attention by N = C + the padded batch's
longest history + its most candidates, counts history positions back from the end of the history
and buckets each event by its age at the request's query time Q: a user's cached tokens would
change with the batch, with every new event and as time passes. kvexport's cache needs rules that
depend only on a token's own data and the tokens before it (tests/helpers/meta_reference.Rules):

    N           fixed: C + M + Tmax (the config's maxima) for every row; causal: prefix row i
                max(i + 1, C) + Tmax (candidates C + U + Tmax); the candidates' rows (not cached)
                may instead keep upstream's batch N ("+cand batch") or take the user's own
                C + U + T ("+cand own": upstream's in a one-user batch, whatever the batch)
    positions   from_max: event k at C + M - k + 1 (upstream's when U = M); from_start: C + k;
                none: no position row for history events
    time        previous: the bucket of s_k - s_(k-1) (the first event the last row); zero: row 0,
                the bucket the event had at its own moment; none: no time row for history events

Contextual tokens and candidates keep upstream's positions, buckets and postprocessor features
under every rule. The weights are tests/helpers/meta_fixture.dense_state's synthetic ones at the sizes of
SIZES (upstream's shapes scaled down; position and time tables at upstream's 8192 and 2049 rows),
random, not a trained model: differences measure how far each rule moves this network's logits,
not the loss in a trained model's quality. Three scenarios: "fixture" keeps the fixture's scales
(position and time rows about 0.03 of a sqrt(D)-scaled token); "strong" rescales the position
and time tables to the tokens' size, as a trained model that leans on them might; "smooth" makes
them, at that size, vary slowly with the row (each coordinate a sinusoid of wavelength 4 to 4096
rows), as learned position and time rows tend to: with random rows every wrong row is equally
wrong, with smooth ones a row off by a few is a near miss.

Requests: --users users, histories of 2 to M events (log-uniform, --long-share at M) over 1
to 60 days with recent events denser (ages span * u^3), Zipf-popular items, kuairand-like action
bits, the query time 5 s to 5 min after the newest event (any hour of a week), 2 to Tmax
candidates. Each rule's logits are compared with upstream's in one-user batches and in shuffled
batches of --batch users: the max and median |Δ|, the median and 90th percentile of
|Δ| / |upstream logit|, and the share of candidate pairs (per user and task) kept in order. The
first row, upstream in batches against upstream alone, is upstream's own batch dependence. About
20 s on one thread.

    .venv/bin/python benchmarks/meta_rules.py
    .venv/bin/python benchmarks/meta_rules.py --users 64 --json /tmp/meta-rules.json
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import platform
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.* from a checkout

from tests.helpers import meta_fixture  # noqa: E402
from tests.helpers.meta_reference import POS, Features, Rules, dlrm_hstu_forward, event_tokens  # noqa: E402

# Upstream's DLRMv3 (kuairand): D = E = 512, Hd 256, 4 heads of 128, 5 layers, 512-wide towers, 8
# action bits, 8 tasks, 8192 position and 2049 time rows, 10 candidates in training. Scaled to run
# in well under a minute on one core; M (max history) is this benchmark's choice.
SIZES = meta_fixture.Sizes(
    D=128,
    E=64,
    HIDDEN=64,
    HEADS=4,
    DQK=32,
    DV=32,
    LAYERS=3,
    POSITION_ROWS=8192,
    TIME_ROWS=2049,
    MLP_WIDTH=128,
    ACTION_DIM=8,
    ACTION_WEIGHTS=(1, 2, 4, 8, 16, 32, 64, 128),
    TASKS=8,
    TABLE_ROWS={"video_id": 4000, "user_id": 1000, "user_active_degree": 8},
)
ACTION_RATES = [0.6, 0.1, 0.01, 0.02, 0.02, 0.01, 0.3, 0.1]  # each bit's share of events (click, like, ...)
T0 = 1_699_200_000


def build_state(seed: int) -> tuple[dict, dict, Features]:
    dense, tables = meta_fixture.synthetic_state(seed, sizes=SIZES)
    return dense, tables, meta_fixture.features_for(SIZES)


def draw_users(count: int, max_history: int, max_candidates: int, seed: int, long_share: float = 0.2) -> list[dict]:
    """Synthetic requests, one a user: long_share of them at the full M events, the rest log-uniform."""
    rng = random.Random(seed)
    items = SIZES.TABLE_ROWS["video_id"]
    popularity = list(itertools.accumulate(1 / (rank + 1) ** 0.9 for rank in range(items)))
    order = list(range(items))
    rng.shuffle(order)
    users = []
    for _ in range(count):
        if rng.random() < long_share:
            history = max_history
        else:
            history = min(max_history, int(math.exp(rng.uniform(math.log(2), math.log(max_history + 1)))))
        span = 86400 * math.exp(rng.uniform(0, math.log(60)))  # 1 to 60 days
        query_time = T0 + rng.randrange(7 * 86400)
        newest = query_time - rng.randint(5, 300)
        ages = sorted((span * rng.random() ** 3 for _ in range(history - 1)), reverse=True)
        timestamps = [int(newest - age) for age in ages] + [newest]
        actions = [
            sum(bit for bit, rate in zip(SIZES.ACTION_WEIGHTS, ACTION_RATES) if rng.random() < rate)
            for _ in range(history)
        ]
        candidates = rng.randint(2, max_candidates)
        ids = [order[i] for i in rng.choices(range(items), cum_weights=popularity, k=history + candidates)]
        users.append(
            {
                "contextual": [
                    rng.randrange(SIZES.TABLE_ROWS["user_id"]),
                    rng.randrange(SIZES.TABLE_ROWS["user_active_degree"]),
                ],
                "history": ids[:history],
                "actions": actions,
                "timestamps": timestamps,
                "candidates": ids[history:],
                "query_time": query_time,
            }
        )
    return users


def scenario_state(dense: dict, tables: dict, features: Features, users: list[dict], scenario: str, seed: int) -> dict:
    """dense for a scenario: "fixture" as built; "strong" the position and time tables rescaled to the
    RMS of sqrt(D) times the users' event tokens; "smooth" those tables replaced, at that RMS, by rows
    that vary slowly with their index (each coordinate a sinusoid of wavelength 4 to 4096 rows), as
    trained position and time rows tend to, so that a nearby row is a near miss."""
    if scenario == "fixture":
        return dense
    tokens = torch.cat([event_tokens(dense, tables, features, user) for user in users[:8]])
    target = (tokens * math.sqrt(tokens.shape[1])).pow(2).mean().sqrt()
    g = torch.Generator().manual_seed(seed + 7)
    out = dict(dense)
    for name in (POS + "_position_embeddings_weight", POS + "_timestamp_embeddings_weight"):
        table = dense[name]
        if scenario == "smooth":
            wavelengths = torch.exp(torch.empty(table.shape[1]).uniform_(math.log(4), math.log(4096), generator=g))
            phases = torch.rand(table.shape[1], generator=g) * 2 * math.pi
            table = torch.sin(torch.arange(table.shape[0]).float()[:, None] * (2 * math.pi / wavelengths) + phases)
        elif scenario != "strong":
            raise ValueError(f"scenario {scenario!r}: fixture, strong or smooth")
        out[name] = table * (target / table.pow(2).mean().sqrt())
    return out


def rule_set(max_history: int, max_candidates: int) -> list[tuple[str, Rules]]:
    """(label, rules): upstream, each replacement alone, then every cache-exact combination."""
    limits = dict(max_history=max_history, max_candidates=max_candidates)
    normalisers = {
        "N fixed": dict(normaliser="fixed"),
        "N fixed+cand batch": dict(normaliser="fixed", candidate_normaliser="batch"),
        "N fixed+cand own": dict(normaliser="fixed", candidate_normaliser="own"),
        "N causal": dict(normaliser="causal"),
        "N causal+cand batch": dict(normaliser="causal", candidate_normaliser="batch"),
    }
    positions = {f"pos {rule}": dict(positions=rule) for rule in ("from_max", "from_start", "none")}
    times = {f"time {rule}": dict(times=rule) for rule in ("previous", "zero", "none")}
    rules = [("upstream", Rules())]
    rules += [(label, Rules(**choice, **limits)) for label, choice in {**normalisers, **positions, **times}.items()]
    for n, p, t in itertools.product(("N fixed", "N fixed+cand own"), positions, times):
        rules.append((f"{n}, {p}, {t}", Rules(**normalisers[n], **positions[p], **times[t], **limits)))
    return rules


def batch_dependent(rules: Rules) -> bool:
    """Whether a rule's logits for a user change with the other users of its batch."""
    return rules.normaliser == "batch" or rules.candidate_normaliser == "batch"


def forward(state: tuple, batches: list[list[dict]], rules: Rules) -> list[torch.Tensor]:
    """Each user's logits [T, K], users in the order of the batches."""
    dense, tables, features = state
    out = []
    for batch in batches:
        logits = dlrm_hstu_forward(dense, tables, batch, features, rules=rules)
        out += list(logits.split([len(user["candidates"]) for user in batch]))
    return out


def compare(logits: list[torch.Tensor], reference: list[torch.Tensor]) -> dict:
    delta = torch.cat([(a - b).abs().flatten() for a, b in zip(logits, reference)])
    upstream = torch.cat([b.abs().flatten() for b in reference])
    relative = delta / upstream.clamp(min=1e-12)
    kept = total = 0
    for a, b in zip(logits, reference):
        i, j = torch.triu_indices(a.shape[0], a.shape[0], 1)
        same = torch.sign(a[i] - a[j]) == torch.sign(b[i] - b[j])
        kept, total = kept + int(same.sum()), total + same.numel()
    return {
        "max_abs": float(delta.max()),
        "median_abs": float(delta.median()),
        "median_rel": float(relative.median()),
        "p90_rel": float(relative.quantile(0.9)),
        "pairs_kept": kept / max(total, 1),
    }


def run_scenario(
    state: tuple, users: list[dict], rules: list[tuple[str, Rules]], batch_size: int, seed: int, fixed_normaliser: int
) -> dict:
    """Every rule against upstream, in one-user batches and in shuffled batches of batch_size."""
    order = list(range(len(users)))
    random.Random(seed + 1).shuffle(order)
    mixed = [[users[i] for i in order[first : first + batch_size]] for first in range(0, len(order), batch_size)]
    singles = [[user] for user in users]

    def unshuffle(values: list[torch.Tensor]) -> list[torch.Tensor]:  # mixed batches' order -> users'
        out = [None] * len(values)
        for position, value in enumerate(values):
            out[order[position]] = value
        return out

    num_contextual = len(state[2].contextual_tables)
    batch_ns = [
        num_contextual + max(len(u["history"]) for u in batch) + max(len(u["candidates"]) for u in batch)
        for batch in mixed
    ]
    upstream_single = forward(state, singles, Rules())
    upstream_mixed = unshuffle(forward(state, mixed, Rules()))
    logit_scale = torch.cat([b.flatten() for b in upstream_single])
    rows = [
        {
            "rule": "upstream, batches vs one user",
            "single": compare(upstream_mixed, upstream_single),
            "mixed": compare(upstream_single, upstream_mixed),
        }
    ]
    for label, rule in rules[1:]:
        alone = forward(state, singles, rule)
        together = unshuffle(forward(state, mixed, rule)) if batch_dependent(rule) else alone
        rows.append(
            {"rule": label, "single": compare(alone, upstream_single), "mixed": compare(together, upstream_mixed)}
        )
    return {
        "fixed_normaliser": fixed_normaliser,
        "mixed_batch_normalisers": batch_ns,
        "upstream_logits": {
            "mean": float(logit_scale.mean()),
            "std": float(logit_scale.std()),
            "median_abs": float(logit_scale.abs().median()),
        },
        "rows": rows,
    }


def print_table(name: str, result: dict) -> None:
    scale = result["upstream_logits"]
    print(
        f"\n== {name}: upstream logits mean {scale['mean']:.3g}, std {scale['std']:.3g}, "
        f"median |logit| {scale['median_abs']:.3g}; fixed N {result['fixed_normaliser']}, "
        f"mixed batches' N {result['mixed_batch_normalisers']}"
    )
    head = f"{'max|Δ|':>8} {'med|Δ|':>8} {'med rel':>8} {'p90 rel':>8} {'order':>6}"
    print(f"{'':48} | {'vs upstream, one user a batch':^42} | {'vs upstream, mixed batches':^42}")
    print(f"{'rule':48} | {head} | {head}")

    def cells(m: dict) -> str:
        return (
            f"{m['max_abs']:8.3g} {m['median_abs']:8.3g} {m['median_rel']:8.3g} {m['p90_rel']:8.3g} "
            f"{m['pairs_kept']:6.3f}"
        )

    for row in result["rows"]:
        print(f"{row['rule']:48} | {cells(row['single'])} | {cells(row['mixed'])}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=48)
    parser.add_argument("--max-history", type=int, default=256, help="M: the config's max history length")
    parser.add_argument("--max-candidates", type=int, default=10, help="Tmax: the config's max candidates")
    parser.add_argument(
        "--long-share",
        type=float,
        default=0.2,
        help="share of users at M events (active users, truncated; they send most requests)",
    )
    parser.add_argument("--batch", type=int, default=8, help="users a mixed batch")
    parser.add_argument("--scenarios", default="fixture,strong,smooth")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (these ops are too small to share)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    dense, tables, features = build_state(args.seed)
    users = draw_users(args.users, args.max_history, args.max_candidates, args.seed, args.long_share)
    rules = rule_set(args.max_history, args.max_candidates)
    lengths = sorted(len(user["history"]) for user in users)
    print(
        "Random synthetic weights (tests/helpers/meta_fixture.dense_state at benchmarks/meta_rules.SIZES), "
        "not a trained model:\nthe differences are how far each rule moves this network, "
        "not a trained model's quality loss."
    )
    print(
        f"{args.users} users, history lengths {lengths[0]}..{lengths[-1]} (median {lengths[len(lengths) // 2]}), "
        f"M = {args.max_history}, Tmax = {args.max_candidates}, mixed batches of {args.batch}; "
        f"rules: this script's docstring; rel: |Δ| / |upstream logit|; order: share of candidate pairs kept "
        f"in order"
    )
    sizes = {k: v for k, v in dataclasses.asdict(SIZES).items() if k not in ("ACTION_DIM", "TABLE_ROWS")}
    result = {
        "sizes": sizes,
        "users": args.users,
        "max_history": args.max_history,
        "max_candidates": args.max_candidates,
        "batch": args.batch,
        "long_share": args.long_share,
        "seed": args.seed,
        "trained": False,
        "scenarios": {},
    }
    with torch.inference_mode():
        for scenario in args.scenarios.split(","):
            state_dense = scenario_state(dense, tables, features, users, scenario, args.seed)
            fixed = len(features.contextual_tables) + args.max_history + args.max_candidates
            outcome = run_scenario((state_dense, tables, features), users, rules, args.batch, args.seed, fixed)
            result["scenarios"][scenario] = outcome
            print_table(scenario, outcome)
    result.update(
        seconds=round(time.perf_counter() - started, 1),
        torch=torch.__version__,
        machine=f"{platform.machine()}, {torch.get_num_threads()} threads",
    )
    print(f"\n{result['seconds']} s")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
