"""The hostile-request corpus every host is tested with: requests a package must refuse by itself.

Each entry is a complete request (all seven signature tensors) that a host could hand to
model.pt2 directly, with the words the refusal must contain. Shared by the plain-torch host, the
C++ harness and kvexport's own runner tests; run_plain_host runs a corpus (the `host_corpus`
fixture's) through plain_host.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from kvexport.model import Batch, random_batch

PLAIN_HOST = Path(__file__).with_name("plain_host.py")
HOST_TIMEOUT_S = 300  # a hang fails the test instead of the suite


def good_request(config, first_user: int = 0) -> dict[str, torch.Tensor]:
    return random_batch(
        config.model, seed=1, history_lengths=[2, 3], num_candidates=[1, 2], first_user_id=first_user
    ).to_dict()


def package_corpus(config) -> list[tuple[dict[str, torch.Tensor], str]]:
    """(request, expected message) pairs; batch 2 users unless the fault is the batch size."""
    m, max_batch = config.model, config.serving.max_batch_size
    good = good_request(config)

    def edit(**changes):
        return {**good_request(config), **changes}

    too_many = random_batch(
        m, seed=0, history_lengths=[1] * (max_batch + 1), num_candidates=[1] * (max_batch + 1)
    ).to_dict()
    too_long = random_batch(m, seed=0, history_lengths=[m.max_history_length + 1], num_candidates=[1]).to_dict()
    too_many_candidates = random_batch(m, seed=0, history_lengths=[1], num_candidates=[m.max_num_candidates + 1])
    query_time = " and the query time" if m.head == "item_tower" else ""
    # A model whose head reads a query time (context_ids' last column) refuses one before the epoch.
    negative_time = good["context_ids"].clone()
    negative_time[:, -1] = -1
    tower = [(edit(context_ids=negative_time), "context_ids' query time has -1")] if query_time else []
    return tower + [
        (edit(item_ids=good["item_ids"].int()), "item_ids must be int64, got int32"),
        (edit(user_ids=good["user_ids"].int()), "user_ids must be int64, got int32"),
        (edit(history_lengths=good["history_lengths"].int()), "history_lengths must be int64, got int32"),
        (edit(candidate_ids=good["candidate_ids"].float()), "candidate_ids must be int64, got float32"),
        (edit(context_ids=good["context_ids"].reshape(-1)), "context_ids must be 2-D"),
        (
            edit(context_ids=good["context_ids"][:, :1]),
            f"context_ids has 1 features, the model has {m.num_contextual_features}{query_time}",
        ),
        (edit(history_lengths=torch.tensor([2, 4])), "history_lengths sum to 6 but item_ids has 5 entries"),
        (edit(history_lengths=torch.tensor([-1, 6])), "history_lengths has -1, outside events"),
        (edit(action_ids=good["action_ids"][:4]), "history_lengths sum to 5 but action_ids has 4 entries"),
        (edit(num_candidates=torch.tensor([1, 1])), "num_candidates sum to 2 but candidate_ids has 3 entries"),
        (edit(item_ids=good["item_ids"] + m.item_vocab_size), "outside the item vocabulary"),
        (edit(item_ids=good["item_ids"] - 2**40), "outside the item vocabulary"),
        (edit(candidate_ids=good["candidate_ids"] + m.item_vocab_size), "candidate_ids has"),
        (edit(action_ids=torch.full((5,), m.action_vocab_size)), "outside the action vocabulary"),
        (edit(context_ids=-good["context_ids"] - 1), "outside the context vocabulary"),
        (edit(num_candidates=torch.tensor([0, 3])), "num_candidates has 0, outside candidates"),
        (too_many_candidates.to_dict(), f"num_candidates has {m.max_num_candidates + 1}, outside candidates"),
        (edit(user_ids=torch.tensor([5, 5])), "user_ids repeat a user"),
        (too_many, f"{max_batch + 1} users exceed serving.max_batch_size ({max_batch})"),
        (too_long, f"history_lengths has {m.max_history_length + 1}, outside events"),
    ]


def write_host_corpus(config, model, path: Path) -> Path:
    """Hostile requests of the config, plus valid ones with `model`'s eager full-recompute logits (no
    cache), as plain_host.py reads them; returns path."""
    good = []
    for first_user in (100, 200, 300, 400):
        request = good_request(config, first_user)
        with torch.no_grad():
            good.append([request, model(Batch(**request))])
    torch.save({"hostile": [list(entry) for entry in package_corpus(config)], "good": good}, path)
    return path


def run_plain_host(artifact: Path, corpus: Path, mode: str) -> dict:
    """plain_host.py's summary of a corpus run against the artifact in a subprocess (mode sequential
    or threads); fails on a crash, a hang or any expectation that did not hold."""
    result = subprocess.run(
        [sys.executable, str(PLAIN_HOST), str(artifact), str(corpus), mode],
        capture_output=True,
        text=True,
        timeout=HOST_TIMEOUT_S,
    )
    assert result.returncode in (0, 1), f"host died with {result.returncode}: {result.stderr[-2000:]}"
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert result.returncode == 0, summary["failures"]
    return summary
