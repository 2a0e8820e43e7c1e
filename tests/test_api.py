"""The Python API: kvexport.load(OUT) -> Package (score, score_users, stats, close), and docs/hosting.md's example.

Every output is compared with the eager model's full recompute (the build's checkpoint), never
with the package's own output.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading

import pytest
import torch

import kvexport
from kvexport.errors import RequestError, RequestFailed, UserError, VerificationError
from kvexport.model import Batch, build_model, random_batch
from kvexport.model.batch import UserRequest, random_user
from kvexport.ops import wrappers as kv
from tests.helpers import ROOT

ATOL = 1e-5  # package vs eager full recompute in float32: far above float32 rounding, far below a wrong result
README_EXAMPLE = re.compile(r"<!-- example: tests/test_api\.py[^>]*-->\n```python\n(.*?)```", re.S)
README_OUT = 'OUT = "artifacts/hstu-tiny"'


@pytest.fixture(scope="module")
def eager(tiny_config, tiny_checkpoint):
    """The eager model with the build's weights: forward() is the full recompute."""
    model = build_model(tiny_config, checkpoint=tiny_checkpoint)

    def recompute(batch) -> torch.Tensor:
        if isinstance(batch, dict):
            batch = Batch(**batch)
        with torch.no_grad():
            return model(batch)

    return recompute


@pytest.fixture
def pkg(tiny_artifact):
    with kvexport.load(tiny_artifact) as package:
        yield package


def _user_dict(user, user_id=None) -> dict:
    return {
        "user_id": user.user_id if user_id is None else user_id,
        "item_ids": user.item_ids,
        "action_ids": user.action_ids,
        "context_ids": user.context_ids,
        "candidate_ids": user.candidate_ids,
    }


def _users(config, seed: int, shapes: list[tuple[int, int]], first_user_id: int):
    generator = torch.Generator().manual_seed(seed)
    return [random_user(config.model, generator, first_user_id + i, h, t) for i, (h, t) in enumerate(shapes)]


def test_import_kvexport_does_not_import_torch():
    code = "import sys, kvexport; assert callable(kvexport.load); assert 'torch' not in sys.modules, 'torch'"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.slow
def test_readme_example_runs(tiny_artifact, eager, capsys):
    blocks = README_EXAMPLE.findall((ROOT / "docs" / "hosting.md").read_text())
    assert len(blocks) == 1, "docs/hosting.md has no (or several) Python API example blocks"
    code = blocks[0]
    assert code.count(README_OUT) == 1, f"the example must set {README_OUT}"
    namespace: dict = {"__name__": "readme_example"}
    exec(compile(code.replace(README_OUT, f"OUT = {str(tiny_artifact)!r}"), "docs/hosting.md", "exec"), namespace)

    torch.testing.assert_close(namespace["logits"], eager(namespace["request"]), rtol=0, atol=ATOL)
    users, per_user = namespace["users"], namespace["per_user"]
    assert [tuple(t.shape) for t in per_user] == [(len(u["candidate_ids"]), 3) for u in users]
    for user, logits in zip(users, per_user):
        torch.testing.assert_close(logits, eager(Batch.concat([UserRequest(**user)])), rtol=0, atol=ATOL)
    assert set(namespace["stats"]) == set(kv.stat_names())
    assert namespace["pkg"].closed
    printed = capsys.readouterr().out
    assert "hstu-tiny cpu 4 ['user_ids', 'history_lengths'," in printed
    assert "refused: invalid_request candidate_ids has " in printed


@pytest.mark.slow
def test_score_equals_eager_full_recompute(pkg, tiny_config, eager):
    users = _users(tiny_config, seed=21, shapes=[(12, 3), (0, 1), (40, 6)], first_user_id=100)
    more = _users(tiny_config, seed=22, shapes=[(4, 2)] * 3, first_user_id=100)
    cold = Batch.concat(users)
    # The same users with four more events each: their prefixes come from the cache.
    grown = Batch.concat(
        [
            UserRequest(
                u.user_id,
                torch.cat([u.item_ids, x.item_ids]),
                torch.cat([u.action_ids, x.action_ids]),
                u.context_ids,
                x.candidate_ids,
            )
            for u, x in zip(users, more)
        ]
    )
    for batch in (cold, grown, grown, cold.to_dict()):
        got = pkg.score(batch)
        rows = int(Batch(**batch).num_candidates.sum()) if isinstance(batch, dict) else int(batch.num_candidates.sum())
        assert got.dtype == torch.float32 and got.shape == (rows, tiny_config.model.num_tasks)
        torch.testing.assert_close(got, eager(batch), rtol=0, atol=ATOL)
    assert pkg.stats()["hit_tokens"] > 0  # the repeats were served from the cache


@pytest.mark.slow
def test_score_users_equals_merged_batch_and_eager_per_user(pkg, tiny_config, eager):
    users = _users(tiny_config, seed=7, shapes=[(30, 4), (0, 1), (9, 7), (64, 2)], first_user_id=300)
    users = users[2:] + users[:2]  # input order, not user-id order
    ids = [torch.tensor(users[0].user_id), torch.tensor([users[1].user_id]), users[2].user_id, users[3].user_id]
    requests = [_user_dict(u, uid) for u, uid in zip(users, ids)]

    per_user = pkg.score_users(requests)
    assert [tuple(t.shape) for t in per_user] == [(len(u.candidate_ids), 3) for u in users]
    for user, logits in zip(users, per_user):
        torch.testing.assert_close(logits, eager(Batch.concat([user])), rtol=0, atol=ATOL)
    merged = Batch.concat(users)
    torch.testing.assert_close(torch.cat(per_user), pkg.score(merged), rtol=0, atol=ATOL)
    torch.testing.assert_close(torch.cat(per_user), eager(merged), rtol=0, atol=ATOL)
    # A UserRequest does as well as a dict.
    torch.testing.assert_close(pkg.score_users(users[:1])[0], per_user[0], rtol=0, atol=ATOL)


@pytest.mark.slow
def test_score_users_refusals_leave_the_package_serving(pkg, tiny_config, eager):
    users = _users(tiny_config, seed=8, shapes=[(5, 2)] * 5, first_user_id=400)
    good = [_user_dict(u) for u in users[:2]]
    pkg.score_users(good)
    before = pkg.stats()
    cases = {
        "are both user 400": [good[0], good[1], dict(good[0])],
        "at most 4 users per request": [_user_dict(u) for u in users],
        "got no requests": [],
        "request 1: missing candidate_ids": [good[0], {k: v for k, v in good[1].items() if k != "candidate_ids"}],
        "request 0: item_ids must be int64": [dict(good[0], item_ids=good[0]["item_ids"].int())],
        "request 0: user_id must be an int": [dict(good[0], user_id=1.0)],
        "request 0: context_ids has 2 entries, the model takes 3": [dict(good[0], context_ids=torch.tensor([1, 2]))],
        "request 0: item_ids has 5 events but action_ids has 4": [dict(good[0], action_ids=good[0]["action_ids"][:4])],
        "candidate_ids has 10000, outside the item vocabulary": [dict(good[0], candidate_ids=torch.tensor([10000]))],
    }
    for message, requests in cases.items():
        with pytest.raises(RequestError, match=re.escape(message)) as refused:
            pkg.score_users(requests)
        assert refused.value.code == "invalid_request"
    assert pkg.stats() == before
    for user, logits in zip(users[:2], pkg.score_users(good)):
        torch.testing.assert_close(logits, eager(Batch.concat([user])), rtol=0, atol=ATOL)


@pytest.mark.slow
def test_bad_request_raises_invalid_request_and_the_next_is_correct(pkg, tiny_config, eager):
    m = tiny_config.model
    batch = random_batch(m, seed=31, history_lengths=[20, 3], num_candidates=[2, 5], first_user_id=500)
    torch.testing.assert_close(pkg.score(batch), eager(batch), rtol=0, atol=ATOL)
    before = pkg.stats()
    bad = batch.to_dict() | {"candidate_ids": batch.candidate_ids.clone()}
    bad["candidate_ids"][3] = m.item_vocab_size
    with pytest.raises(RequestFailed, match="candidate_ids has 10000, outside the item vocabulary") as refused:
        pkg.score(bad)
    assert refused.value.code == "invalid_request"
    assert kv.last_error(pkg.runtime_name)[0] == "invalid_request"
    # score checks only the structure in Python: the values are refused by the package itself (the
    # request's one check), the code read from the runtime; run, which skips the structure check,
    # is refused alike, naming the batch it is given.
    with pytest.raises(RequestError, match="^batch 4: candidate_ids has 10000") as refused:
        pkg.run(Batch(**bad), 4)
    assert refused.value.code == "invalid_request"
    assert pkg.stats() == before
    torch.testing.assert_close(pkg.score(batch), eager(batch), rtol=0, atol=ATOL)
    assert kv.last_error(pkg.runtime_name) == ("ok", "")


@pytest.mark.slow
def test_capacity_refusal_has_the_runtime_code(pkg, tiny_config, eager):
    m = tiny_config.model
    too_big = random_batch(
        m, seed=2, history_lengths=[m.max_history_length] * 2, num_candidates=[1, 1], first_user_id=600
    )
    with pytest.raises(RequestFailed, match="KV cache capacity exceeded") as refused:
        pkg.score(too_big)
    assert refused.value.code == "capacity_exceeded"
    single = random_batch(m, seed=2, history_lengths=[m.max_history_length], num_candidates=[1], first_user_id=600)
    torch.testing.assert_close(pkg.score(single), eager(single), rtol=0, atol=ATOL)


@pytest.mark.slow
def test_threads_scoring_through_one_package(pkg, tiny_config, eager):
    m = tiny_config.model
    batches = [
        random_batch(m, seed=s, history_lengths=[5 + 3 * s, 11], num_candidates=[2, 3], first_user_id=700 + 2 * (s % 4))
        for s in range(8)
    ]
    expected = [eager(b) for b in batches]
    errors: list[BaseException] = []
    worst = [0.0]

    def work(offset: int) -> None:
        try:
            for i in range(len(batches)):
                j = (i + offset) % len(batches)
                worst[0] = max(worst[0], (pkg.score(batches[j]) - expected[j]).abs().max().item())
        except BaseException as exc:  # noqa: BLE001 — reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert worst[0] <= ATOL
    assert pkg.stats()["lookups"] == 4 * len(batches) * 2


@pytest.mark.slow
def test_close_then_score_raises(tiny_artifact, tiny_config):
    batch = random_batch(tiny_config.model, seed=1, history_lengths=[4], num_candidates=[2], first_user_id=800)
    with kvexport.load(tiny_artifact) as package:
        package.score(batch)
        runtime = package.runtime_name
    assert package.closed
    package.close()  # idempotent
    for call in (
        lambda: package.score(batch),
        lambda: package.stats(),
        lambda: package.score_users([{"user_id": 1}]),
        lambda: package.run(batch),
    ):
        with pytest.raises(UserError, match="^package closed"):
            call()
    assert kv.drop_runtime(runtime) is False  # close() dropped it
    with kvexport.load(tiny_artifact) as again:  # a new load serves again
        assert again.score(batch).shape == (2, 3)


@pytest.mark.slow
def test_load_runs_no_compiler_probe(tiny_artifact, tiny_config, eager, monkeypatch):
    """torch's aoti_load_package compiles and runs CPU-ISA probe programs before it opens a package
    (seconds to a minute on a fresh host) only to log a warning; kvexport checks the host itself."""
    import torch._inductor.cpu_vec_isa as cpu_vec_isa

    def probe(*args, **kwargs):
        raise AssertionError("kvexport.load ran torch's CPU-ISA probe")

    monkeypatch.setattr(cpu_vec_isa, "pick_vec_isa", probe)
    batch = random_batch(tiny_config.model, seed=3, history_lengths=[5], num_candidates=[2], first_user_id=820)
    with kvexport.load(tiny_artifact) as package:
        logits = package.score(batch)
    torch.testing.assert_close(logits, eager(batch), rtol=0, atol=ATOL)


@pytest.mark.slow
def test_stats_keys_equal_stat_names(pkg):
    stats = pkg.stats()
    assert list(stats) == kv.stat_names()
    assert all(isinstance(v, int) for v in stats.values())
    assert stats["lookups"] == 0  # loading starts from an empty cache


@pytest.mark.slow
def test_properties_come_from_the_artifact(pkg, tiny_artifact, tiny_config):
    from kvexport.artifact import open_artifact

    artifact = open_artifact(tiny_artifact)
    assert pkg.name == "hstu-tiny" and pkg.runtime_name == artifact.runtime_name
    assert pkg.config == tiny_config and pkg.max_batch_size == 4 and pkg.num_tasks == 3
    assert pkg.signature == artifact.manifest.signature
    assert [i["name"] for i in pkg.signature["inputs"]] == list(kvexport.model.SIGNATURE)
    assert pkg.signature["output"]["dtype"] == "float32"
    assert pkg.device == torch.device("cpu") and pkg.path == tiny_artifact
    pkg.signature["inputs"].clear()  # a copy
    assert len(pkg.signature["inputs"]) == 7
    for name in ("name", "runtime_name", "config", "max_batch_size", "signature", "device"):
        with pytest.raises(AttributeError):
            setattr(pkg, name, None)
    assert isinstance(pkg, kvexport.Package)


@pytest.mark.slow
def test_device_must_be_the_packages(tiny_artifact):
    with kvexport.load(tiny_artifact, device="cpu") as package:
        assert package.device == torch.device("cpu")
    with kvexport.load(tiny_artifact, device=torch.device("cpu")) as package:
        assert package.device == torch.device("cpu")
    with pytest.raises(UserError, match="is a cpu package; it cannot run on device cuda"):
        kvexport.load(tiny_artifact, device="cuda")
    with pytest.raises(UserError, match="'tpu9' is not a torch device"):
        kvexport.load(tiny_artifact, device="tpu9")


@pytest.mark.slow
def test_check_files_catches_a_tampered_file(artifact_copy):
    victim = artifact_copy / "trace" / "step_0001.pt"
    victim.write_bytes(victim.read_bytes() + b"\0")
    with pytest.raises(VerificationError, match="trace/step_0001.pt does not match its sha256"):
        kvexport.load(artifact_copy)
    kvexport.load(artifact_copy, check_files=False).close()  # only the op library is checked then


@pytest.mark.slow
def test_shipped_op_library_must_be_the_loaded_one(artifact_copy):
    library = artifact_copy / "lib" / "libkvexport_ops.so"
    library.write_bytes(library.read_bytes() + b"\0")
    with pytest.raises(UserError, match="differs from the op library loaded here"):
        kvexport.load(artifact_copy, check_files=False)
