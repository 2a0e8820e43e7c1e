"""fbgemm's jagged ops and the aten fallback agree (the fallback serves hosts without fbgemm)."""

from __future__ import annotations

import pytest
import torch

from kvexport.ops import jagged


@pytest.fixture(params=[True, False], ids=["fbgemm", "aten"])
def backend(request, monkeypatch):
    if request.param and not jagged.HAVE_FBGEMM:
        pytest.skip("fbgemm_gpu is not installed")
    monkeypatch.setattr(jagged, "HAVE_FBGEMM", request.param)
    return request.param


def test_lengths_to_offsets(backend):
    assert jagged.lengths_to_offsets(torch.tensor([3, 0, 2])).tolist() == [0, 3, 3, 5]


def test_jagged_padded_round_trip(backend):
    values = torch.arange(10.0).view(5, 2)
    offsets = torch.tensor([0, 3, 3, 5])
    padded = jagged.jagged_to_padded(values, offsets, 3)
    assert padded.tolist() == [[[0, 1], [2, 3], [4, 5]], [[0, 0], [0, 0], [0, 0]], [[6, 7], [8, 9], [0, 0]]]
    assert torch.equal(jagged.padded_to_jagged(padded, offsets, 5), values)


def test_required_library_is_named_only_with_fbgemm():
    path = jagged.fbgemm_library_path()
    assert (path is not None) == jagged.HAVE_FBGEMM
    if path is not None:
        assert path.name == "fbgemm_gpu_py.so" and path.is_file()
