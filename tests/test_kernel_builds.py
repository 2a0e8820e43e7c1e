"""The attention kernel of each op-library build kvexport offers against the plain-PyTorch
reference, each build in a process of its own: this host's (native), the portable x86-64-v3
baseline with its x86-64-v4 clone, and without it (AVX2 code only, 8-float vectors)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvexport.bench.run import kernel_libraries
from tests.helpers import ROOT

pytestmark = pytest.mark.slow

# Loads the build given, then checks the kernel on every head size it compiles for (32, 64, 128)
# and the generic loop (24), in float32 and bfloat16, and on many rows of one user over many key
# blocks, with q, k, v read in place as the model's column slices.
CHECK = """
import sys
from pathlib import Path

import torch

from kvexport.ops import library
from kvexport.ops import wrappers as kv

library.load(Path(sys.argv[1]))
from tests.helpers.attention import ALPHA, INV_S, random_paged_inputs, reference_paged_attention, strided_like

torch.set_num_threads(1)
for head_dim in (32, 64, 128, 24):
    for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        inputs = random_paged_inputs(head_dim, dtype, head_dim=head_dim)
        got = kv.hstu_paged_attention(*inputs, ALPHA, INV_S).float()
        want = reference_paged_attention(*(t.float() if t.is_floating_point() else t for t in inputs))
        torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)
    g = torch.Generator().manual_seed(head_dim)
    rows, pages, page_size = 150, 40, 16
    cache = torch.randn(pages, 2, page_size, 2, head_dim, generator=g)
    page_table = torch.randperm(pages, generator=g).view(1, pages)
    metadata = (torch.zeros(rows, dtype=torch.int64), torch.randint(0, pages * page_size + 1, (rows,), generator=g),
                torch.rand(rows, generator=g) < 0.4)
    q, k, v = (torch.randn(rows, 2, head_dim, generator=g) for _ in range(3))
    got = kv.hstu_paged_attention(*(strided_like(t, "slices") for t in (q, k, v)), cache, page_table, *metadata,
                                  ALPHA, INV_S)
    torch.testing.assert_close(got, reference_paged_attention(q, k, v, cache, page_table, *metadata),
                               rtol=1e-5, atol=1e-5)
"""


@pytest.fixture(scope="module")
def libraries():
    return kernel_libraries()


@pytest.mark.parametrize("build", ["native", "x86-64-v3+fmv", "x86-64-v3"])
def test_every_build_of_the_kernel_matches_the_reference(libraries, build):
    done = subprocess.run(
        [sys.executable, "-c", CHECK, str(libraries[build])], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
