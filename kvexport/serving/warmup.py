"""Loading a package for serving: warmed up before the first request, the remote tier after that.

Used by the Triton model (kvexport.serving.triton_model) in its `initialize`, so that Triton reports
the model ready only once the package can score at full speed.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from kvexport.errors import RequestFailed
from kvexport.remote import DEFAULT_WRITE_POLICY, check_write_policy

log = logging.getLogger(__name__)

WARMUP_EVENTS = 8


def warm_up(package) -> None:
    """Scores a batch of synthetic users twice (cold, then grown from the cache), then empties the
    cache runtime and zeroes its counters: the first real request finds the code warm and the cache
    empty. A package whose device tier cannot hold that batch is warmed with one user."""
    from kvexport.model.batch import UserRequest, random_user

    m = package.config.model
    generator = torch.Generator().manual_seed(0)
    events = min(WARMUP_EVENTS, m.max_history_length // 2)
    candidates = min(WARMUP_EVENTS, m.max_num_candidates)
    users = [random_user(m, generator, user_id, events, candidates) for user_id in range(package.max_batch_size)]
    grown = [
        UserRequest(u.user_id, u.item_ids.repeat(2), u.action_ids.repeat(2), u.context_ids, u.candidate_ids)
        for u in users
    ]
    try:
        package.score_users(users)
        package.score_users(grown)
    except RequestFailed as refused:
        log.debug("warm-up batch refused (%s); warming up with one user", refused)
        package.score_users(users[:1])
        package.score_users(grown[:1])
    package.reset()


def load_warm(
    out: Path | str, remote: str | None = None, remote_write: str = DEFAULT_WRITE_POLICY, device: str | None = None
):
    """kvexport.load(out, device), warmed up (warm_up), then the remote tier attached: the warm-up's
    synthetic users (ids 0 and up) must neither overwrite real users' shared entries nor read them."""
    from kvexport.host.package import load

    check_write_policy(remote_write)  # before minutes of loading
    package = load(out, device)
    try:
        warm_up(package)
        if remote is not None:
            package.attach_remote(remote, remote_write)
    except BaseException:
        package.close()
        raise
    return package
