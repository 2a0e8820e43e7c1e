"""What FP8 pages cost a ranking stage, measured by `kvexport build` (docs/design.md §2.7).

On a seeded workload of fresh users (the trace section's history lengths and candidates, a seed of
its own), three full recomputes: the float32 model over unrounded keys and values (the reference),
the model in its own dtype over unrounded ones, and the model with FP8 pages. For the own dtype and
for FP8 pages: the share of (user, task) pairs whose top-10 candidates keep the reference's order,
and each task's ROC-AUC against labels drawn from the reference's logits. The model's own rounding
is the yardstick: FP8 pages are refused when either falls more than kv_cache.fp8_max_ranking_drop
below the own dtype's, beyond the sample's noise. A drop of 0.001 is far below what a sample of
tens of users resolves (one (user, task) pair of 64 users x 8 tasks is 0.002, and the two variants
swap near-tied candidates of different pairs), so the check bootstraps the users (seeded) and refuses
where even the lower end of a measure's one-sided interval is past the bound. With one top-10
measure and T AUCs, each interval is taken at 1 - 5% / (1 + T) (Bonferroni): a model whose drops all
sit at the bound is refused at most one time in twenty, whatever T. The point estimates and those
lower ends are what the manifest records.
"""

from __future__ import annotations

import copy
import dataclasses

import torch

from kvexport.config import Config
from kvexport.errors import UserError
from kvexport.model import Batch
from kvexport.model.hstu import HSTURanker
from kvexport.progress import Progress
from kvexport.trace.record import unrounded_model
from kvexport.trace.workload import Workload, WorkloadSpec, context_keys_of, item_keys_of

TOP_K = 10
# The ranking workload's seed is the trace's plus this: other users than the trace's.
SEED_OFFSET = 7919
# Labels: a candidate is positive with probability sigmoid(LABEL_SHARPNESS * z), z its reference
# logit standardised over the workload (a task the reference ranks well but not perfectly).
LABEL_SHARPNESS = 3.0
BOOTSTRAP_ROUNDS = 1000  # enough for the lower 0.5% of the bootstrap's drops (eight tasks)
FAMILY_ERROR = 0.05  # the chance of refusing a model whose every drop sits at the bound, at most


def roc_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Mann-Whitney ROC-AUC of `scores` for boolean `labels` (ties count half); nan without both classes."""
    positive, negative = scores[labels].double(), scores[~labels].double()
    if positive.numel() == 0 or negative.numel() == 0:
        return float("nan")
    order = torch.cat([positive, negative]).argsort()
    ranks = torch.empty_like(order, dtype=torch.float64)
    ranks[order] = torch.arange(1, order.numel() + 1, dtype=torch.float64)
    values = torch.cat([positive, negative])
    # Tied scores share their mean rank.
    unique, inverse = values.unique(return_inverse=True)
    mean_rank = torch.zeros(unique.numel(), dtype=torch.float64).index_add_(0, inverse, ranks)
    mean_rank /= torch.bincount(inverse, minlength=unique.numel()).double()
    rank_sum = float(mean_rank[inverse[: positive.numel()]].sum())
    n_pos, n_neg = positive.numel(), negative.numel()
    return (rank_sum - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


def top_k_kept(reference: torch.Tensor, logits: torch.Tensor, counts: list[int], k: int = TOP_K) -> torch.Tensor:
    """[users, tasks] booleans: the user's top-k candidates (all, with fewer) in the reference's order.
    reference, logits: [sum(counts), tasks], users' candidates one after another."""
    kept = []
    for ref, got in zip(reference.split(counts), logits.split(counts)):
        top = min(k, ref.shape[0])
        kept.append((got.double().topk(top, dim=0).indices == ref.double().topk(top, dim=0).indices).all(dim=0))
    return torch.stack(kept)


def draw_labels(reference: torch.Tensor, seed: int) -> torch.Tensor:
    """Seeded boolean labels, each candidate and task positive with the reference's own odds (its
    logit standardised within the task)."""
    z = reference.double()
    z = (z - z.mean(dim=0)) / z.std(dim=0, correction=0).clamp_min(1e-12)  # task by task
    g = torch.Generator().manual_seed(seed)
    return torch.rand(z.shape, generator=g, dtype=torch.float64) < torch.sigmoid(LABEL_SHARPNESS * z)


@dataclasses.dataclass(frozen=True)
class Drop:
    """How far FP8 pages fall below the own dtype on one measure: the point estimate and the lower
    end of its bootstrap interval."""

    estimate: float
    lower: float


@dataclasses.dataclass(frozen=True)
class RankingReport:
    users: int
    pairs: int
    top10_kept: dict[str, float]  # "own", "fp8": share of (user, task) pairs
    roc_auc: dict[str, list[float]]  # "own", "fp8": per task
    top10_drop: Drop
    auc_drop: Drop  # the task whose lower end is highest
    bound: float

    def fields(self) -> dict:
        """The manifest's fp8_ranking: JSON without NaN (a task whose sample holds one class has no
        AUC: null)."""
        fields = dataclasses.asdict(self)
        fields["roc_auc"] = {name: [a if a == a else None for a in aucs] for name, aucs in self.roc_auc.items()}
        quantile = lower_quantile(len(self.roc_auc["own"]))
        return {**fields, "bootstrap": {"rounds": BOOTSTRAP_ROUNDS, "lower_quantile": quantile}}

    def check(self, name: str) -> None:
        """Refuses FP8 pages whose ranking drop is past the bound beyond the sample's noise, in one line."""
        measure, drop = max(
            ("top-10 order kept", self.top10_drop), ("ROC-AUC", self.auc_drop), key=lambda m: m[1].lower
        )
        if drop.lower > self.bound:
            raise UserError(
                f"{name}: FP8 pages lower the {measure} by {drop.estimate:.4f} against the model's own dtype "
                f"(at least {drop.lower:.4f} at {1 - FAMILY_ERROR:.0%} over {self.users} users), "
                f"past kv_cache.fp8_max_ranking_drop {self.bound}; "
                "raise the bound or use kv_cache.dtype of the model's dtype"
            )


def lower_quantile(tasks: int) -> float:
    """Of each measure's bootstrap drops (the top-10 share and `tasks` AUCs): its interval's lower end."""
    return FAMILY_ERROR / (1 + tasks)


def _lower(drops: list[float], quantile: float) -> float:
    return float(torch.tensor(drops, dtype=torch.float64).quantile(quantile))


def rank_variants(
    reference: torch.Tensor, own: torch.Tensor, fp8: torch.Tensor, counts: list[int], seed: int, bound: float
) -> RankingReport:
    """The report of own-dtype and FP8 logits against the reference ([sum(counts), tasks] each)."""
    labels = draw_labels(reference, seed)
    kept = {"own": top_k_kept(reference, own, counts).double(), "fp8": top_k_kept(reference, fp8, counts).double()}
    tasks = reference.shape[1]
    quantile = lower_quantile(tasks)
    auc = {name: [roc_auc(x[:, t], labels[:, t]) for t in range(tasks)] for name, x in (("own", own), ("fp8", fp8))}
    g = torch.Generator().manual_seed(seed)
    samples = [torch.randint(len(counts), (len(counts),), generator=g) for _ in range(BOOTSTRAP_ROUNDS)]
    top10_drops = [float(kept["own"][u].mean() - kept["fp8"][u].mean()) for u in samples]
    # Each sample's candidate rows: its users' rows, one user after the other.
    user_rows = torch.arange(sum(counts)).split(counts)
    sample_rows = [torch.cat([user_rows[u] for u in users.tolist()]) for users in samples]
    auc_drops = []
    for t in range(tasks):
        drops = [
            roc_auc(own[rows, t], labels[rows, t]) - roc_auc(fp8[rows, t], labels[rows, t]) for rows in sample_rows
        ]
        drops = [d for d in drops if d == d]  # a sample without both classes has no AUC
        estimate = auc["own"][t] - auc["fp8"][t]
        auc_drops.append(Drop(estimate if estimate == estimate else 0.0, _lower(drops, quantile) if drops else 0.0))
    return RankingReport(
        users=len(counts),
        pairs=len(counts) * tasks,
        top10_kept={name: float(k.mean()) for name, k in kept.items()},
        roc_auc=auc,
        top10_drop=Drop(float(kept["own"].mean() - kept["fp8"].mean()), _lower(top10_drops, quantile)),
        auc_drop=max(auc_drops, key=lambda d: d.lower),
        bound=bound,
    )


def ranking_workload(config: Config, model: HSTURanker) -> list[Batch]:
    """The check's requests: trace.ranking_users fresh users in batches of serving.max_batch_size."""
    t = config.trace
    spec = WorkloadSpec.from_trace_config(t, t.ranking_users, rewrite_fraction=0.0)
    workload = Workload(
        config.model,
        spec,
        seed=t.seed + SEED_OFFSET,
        item_keys=item_keys_of(model),
        context_keys=context_keys_of(model),
    )
    users = [workload.request(workload.new_user(u)) for u in range(t.ranking_users)]
    size = config.serving.max_batch_size
    return [Batch.concat(users[i : i + size]) for i in range(0, len(users), size)]


def measure_ranking(config: Config, model: HSTURanker, device: torch.device, log) -> RankingReport:
    """The check's three full recomputes and their rankings; `model` has FP8 pages."""
    reference = unrounded_model(model)
    own = copy.deepcopy(model)
    own.round_kv = None
    batches = ranking_workload(config, model)
    outputs: dict[str, list[torch.Tensor]] = {"reference": [], "own": [], "fp8": []}
    progress = Progress("FP8 ranking check (users, three full recomputes each)", config.trace.ranking_users, log)
    for batch in batches:
        request = batch.to(device)
        with torch.no_grad():
            for name, variant in (("reference", reference), ("own", own), ("fp8", model)):
                outputs[name].append(variant(request).cpu().double())
        progress.step(batch.batch_size)
    progress.finish()
    ref, own_logits, fp8_logits = (torch.cat(outputs[n]) for n in ("reference", "own", "fp8"))
    counts = [c for batch in batches for c in batch.num_candidates.tolist()]
    return rank_variants(
        ref, own_logits, fp8_logits, counts, config.trace.seed + SEED_OFFSET, config.kv_cache.fp8_max_ranking_drop
    )
