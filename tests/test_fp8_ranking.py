"""The build's FP8 ranking check (kvexport/trace/ranking.py, docs/design.md §2.7): its measures
against definitions written here, and its verdict on a model whose FP8 pages do reorder the top 10
and on one whose do not."""

from __future__ import annotations

import itertools
import json
import logging

import pytest
import torch

from kvexport.config import ConfigError
from kvexport.errors import UserError
from kvexport.model import build_model
from kvexport.trace.ranking import draw_labels, measure_ranking, rank_variants, roc_auc, top_k_kept
from tests.helpers.configs import tiny_config

log = logging.getLogger(__name__)


def pairwise_auc(scores: list[float], labels: list[bool]) -> float:
    """ROC-AUC by its definition: the share of (positive, negative) pairs ranked right, ties half."""
    pairs = [
        1.0 if p > n else 0.5 if p == n else 0.0
        for (p, lp), (n, ln) in itertools.product(zip(scores, labels), repeat=2)
        if lp and not ln
    ]
    return sum(pairs) / len(pairs)


@pytest.mark.parametrize("seed", range(4))
def test_roc_auc_is_the_share_of_pairs_ranked_right(seed):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, 12, (300,), generator=g).double()  # many ties
    labels = torch.rand(300, generator=g) < 0.3
    assert roc_auc(scores, labels) == pytest.approx(pairwise_auc(scores.tolist(), labels.tolist()), abs=1e-12)


def test_roc_auc_without_both_classes_is_nan():
    auc = roc_auc(torch.tensor([1.0, 2.0]), torch.tensor([True, True]))
    assert auc != auc


def test_top_k_kept_compares_the_order_of_each_users_top_candidates():
    reference = torch.tensor([[5.0], [4.0], [3.0], [2.0], [1.0], [9.0], [8.0]])
    # User 0 (5 candidates): the top 2 kept, the rest reordered. User 1 (2 candidates): swapped.
    logits = torch.tensor([[5.0], [4.0], [1.0], [2.0], [3.0], [8.0], [9.0]])
    assert top_k_kept(reference, logits, [5, 2], k=2).tolist() == [[True], [False]]
    assert top_k_kept(reference, logits, [5, 2], k=3).tolist() == [[False], [False]]


def test_the_same_logits_drop_nothing():
    g = torch.Generator().manual_seed(0)
    reference = torch.randn(64 * 12, 3, generator=g, dtype=torch.float64)
    report = rank_variants(reference, reference, reference.clone(), [12] * 64, seed=1, bound=0.001)
    assert report.top10_kept == {"own": 1.0, "fp8": 1.0}
    assert report.top10_drop.estimate == 0.0 and report.auc_drop.estimate == 0.0
    report.check("m")


def test_labels_are_drawn_task_by_task():
    """A task whose logits all sit lower still gets its positives (standardised within the task)."""
    g = torch.Generator().manual_seed(0)
    reference = torch.randn(4000, 2, generator=g, dtype=torch.float64)
    reference[:, 1] -= 8
    share = draw_labels(reference, seed=1).double().mean(dim=0)
    assert (share - 0.5).abs().max() < 0.05, share


def test_a_task_without_both_classes_has_a_null_auc_in_the_manifest():
    reference = torch.tensor([[1.0, 2.0]], dtype=torch.float64)  # one user of one candidate: one class
    report = rank_variants(reference, reference, reference, [1], seed=0, bound=0.001)
    fields = report.fields()
    json.dumps(fields, allow_nan=False)  # the C++ harness's JSON parser takes no NaN
    assert fields["roc_auc"] == {"own": [None, None], "fp8": [None, None]}
    report.check("m")


def ranking_model(weight_scale: float):
    """A small S, so that attention moves the logits, with FP8 pages; q/k/v/u weights scaled."""
    config = tiny_config(
        name="ranking-fp8",
        model={"max_history_length": 48, "scaling_seqlen": 4},
        kv_cache={"device_pages": 21, "host_pages": 42, "dtype": "float8_e4m3"},
        trace={"max_trace_history_length": 48},
    )
    model = build_model(config, seed=1)
    with torch.no_grad():
        for layer in model.layers:
            layer.uvqk.weight.mul_(weight_scale)
    return config, model


def test_fp8_pages_that_reorder_the_top_10_are_refused_in_one_line():
    config, model = ranking_model(16.0)
    report = measure_ranking(config, model, torch.device("cpu"), log)
    assert report.users == 64 and report.top10_kept["own"] == 1.0  # float32: the own dtype is the reference
    assert report.top10_drop.lower > config.kv_cache.fp8_max_ranking_drop, report
    with pytest.raises(UserError) as error:
        report.check("m")
    message = str(error.value)
    assert message.startswith("m: FP8 pages lower the top-10 order kept by ") and "\n" not in message
    assert "kv_cache.fp8_max_ranking_drop 0.001" in message


def test_fp8_pages_of_a_model_that_keeps_its_ranking_pass():
    config, model = ranking_model(1.0)
    report = measure_ranking(config, model, torch.device("cpu"), log)
    report.check("m")
    fields = report.fields()
    assert fields["pairs"] == 64 * config.model.num_tasks and fields["bound"] == 0.001
    # Each measure's interval at 1 - 5% / (1 + tasks): at most one refusal in twenty at the bound.
    assert fields["bootstrap"]["lower_quantile"] == pytest.approx(0.05 / (1 + config.model.num_tasks))
    assert len(fields["roc_auc"]["fp8"]) == config.model.num_tasks


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"kv_cache": {"fp8_max_ranking_drop": -0.1}},
            "kv_cache.fp8_max_ranking_drop must be a number in [0, 1], got -0.1",
        ),
        ({"kv_cache": {"fp8_max_ranking_drop": "x"}}, "kv_cache.fp8_max_ranking_drop must be float, got 'x'"),
        ({"trace": {"ranking_users": 0}}, "trace.ranking_users must be > 0, got 0"),
    ],
)
def test_bad_ranking_check_settings_are_one_line(overrides, message):
    with pytest.raises(ConfigError) as error:
        tiny_config(**overrides)
    assert str(error.value) == message
