"""A package is safe in hosts we don't write: it checks every request itself, never crashes,
never hangs, and tells the host why a request failed through the runtime (docs/hosting.md)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from kvexport.model import build_model
from kvexport.model.batch import Batch
from kvexport.model.checkpoint import save_checkpoint
from kvexport.trace.replay import harness
from tests.helpers.configs import ITEM_TOWER, tiny_raw, write_config
from tests.helpers.hostile import HOST_TIMEOUT_S, good_request, package_corpus, run_plain_host


@pytest.mark.slow
def test_plain_host_survives_every_hostile_request(tiny_artifact, host_corpus):
    summary = run_plain_host(tiny_artifact, host_corpus, "sequential")
    assert summary["hostile"] >= 20 and summary["failures"] == []


@pytest.mark.slow
def test_plain_host_eight_threads_mixing_valid_and_invalid(tiny_artifact, host_corpus):
    summary = run_plain_host(tiny_artifact, host_corpus, "threads")
    assert summary["failures"] == []


@pytest.mark.slow
def test_plain_host_survives_every_hostile_request_to_an_item_tower_package(tmp_path):
    """The request layout of model.head item_tower (a query time after the contextual ids, checked
    candidate ids that carry its code): every hostile request refused, valid ones exact."""
    from kvexport.config import config_from_dict
    from kvexport.export.build import build_artifact

    raw = tiny_raw(
        name="tower-host", model={**ITEM_TOWER, "event_tokens": "combined", "candidate_position": "shared_row"}
    )
    write_config(raw, tmp_path / "tower.yaml")
    config = config_from_dict(raw)
    model = build_model(config, seed=3)
    save_checkpoint(model, tmp_path / "tower.pt")
    artifact = build_artifact(tmp_path / "tower.yaml", tmp_path / "package", checkpoint=tmp_path / "tower.pt")
    good = []
    for first_user in (100, 200):
        request = good_request(config, first_user)
        with torch.no_grad():
            good.append([request, model(Batch(**request))])
    corpus = tmp_path / "corpus.pt"
    torch.save({"hostile": [list(entry) for entry in package_corpus(config)], "good": good}, corpus)
    summary = run_plain_host(artifact, corpus, "sequential")
    assert summary["hostile"] >= 21 and summary["failures"] == []


@pytest.mark.slow
def test_package_needs_only_the_op_library(tiny_artifact):
    manifest = json.loads((tiny_artifact / "manifest.json").read_text())
    assert manifest["required_libraries"] == ["kvexport_ops"]
    assert not any(op.startswith("fbgemm::") for op in manifest["package_ops"])
    assert manifest["package_ops"]["kvexport::check_request"] == 1


@pytest.mark.slow
def test_cpp_harness_eight_threads_with_hostile_requests(tiny_artifact, tiny_config, tmp_path):
    hostile = tmp_path / "hostile.pt"
    torch.save([request for request, _ in package_corpus(tiny_config)], hostile)
    report = tmp_path / "report.json"
    result = subprocess.run(
        [
            str(harness()),
            "--artifact",
            str(tiny_artifact),
            "--threads",
            "8",
            "--hostile",
            str(hostile),
            "--json",
            str(report),
        ],
        capture_output=True,
        text=True,
        timeout=HOST_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert json.loads(report.read_text())["passed"] is True
    assert "API call failed" not in result.stderr  # expected refusals print no raw AOTInductor lines


@pytest.mark.slow
@pytest.mark.parametrize("command", [["verify"], ["replay", "--repeat", "3", "--threads", "2"]])
def test_expected_refusals_print_no_raw_aoti_lines(tiny_artifact, command):
    """The trace's capacity-error step is refused as expected; AOTInductor's own error line (with
    its build-host path) must not reach the user."""
    result = subprocess.run(
        [sys.executable, "-m", "kvexport", command[0], str(tiny_artifact), *command[1:]],
        capture_output=True,
        text=True,
        timeout=HOST_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "exceed device tier" in result.stdout  # the refused step ran
    assert "API call failed" not in result.stdout + result.stderr
    assert "Error: " not in result.stderr
