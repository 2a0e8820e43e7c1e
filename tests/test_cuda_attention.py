"""The CUDA kernel of kvexport::hstu_paged_attention against the CPU kernel (the reference).

Both kernels get the same inputs (bf16/fp16 inputs stay bf16/fp16 on both sides), so the only
differences are the GPU's rounding of the SiLU weights to the input dtype before P V (tensor-core
path), summation order, and the output's final rounding. Tolerances are absolute, relative to the
output's scale (its largest magnitude), plus a relative part for the final rounding:
- float32: 2e-5 of the scale (exact expf and fp32 throughout; only the summation order differs).
- bfloat16: 2e-2 of the scale, rtol 2e-2. Each weight is rounded to 8 bits of mantissa (relative
  error up to 2^-9); over n keys the errors add like a random walk, about 1e-3 of the scale at a
  few thousand keys, and the output's own rounding is 2^-9 relative. 2e-2 leaves a factor of ten
  while still catching a wrong key, mask or page (errors of the order of the scale).
- float16: 5e-3 of the scale, rtol 5e-3 (11 bits of mantissa: errors eight times smaller).
"""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TOLERANCES = {torch.float32: (2e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (5e-3, 5e-3)}


@pytest.fixture(scope="module")
def ops():
    from kvexport.ops import library

    library.load()
    assert torch._C._dispatch_has_kernel_for_dispatch_key("kvexport::hstu_paged_attention", "CUDA"), (
        "the op library was built without CUDA kernels: rebuild it with a CUDA torch (python -m kvexport.native)"
    )
    return torch.ops.kvexport


def users_for(page_size: int) -> list[tuple[int, int, int]]:
    """(cached keys, new prefix rows, candidates) per user: keys read from 0 up to past a key chunk,
    page boundaries, a user with more rows than one tile, users without candidates or without rows."""
    return [
        (0, 0, 3),  # candidates that read no cached key, only themselves
        (0, 2, 1),  # prefix rows reading 1 and 2 keys
        (page_size - 1, 1, 2),  # a prefix row that reads exactly one page
        (page_size, 0, 2),  # candidates that read exactly one page
        (2 * page_size + 1, 3, 5),  # one key into the third page
        (10, 0, 0),  # a user with pages but no rows
        (2500, 20, 70),  # 90 rows, keys over several chunks
        (1200, 150, 100),  # 250 rows: two tiles
        (700, 64, 0),  # prefix rows only, one full tile
    ]


def make_inputs(
    users, heads: int, head_dim: int, page_size: int, dtype: torch.dtype, seed: int, fused_qkv: bool = False
):
    """hstu_paged_attention's inputs on the CPU. Rows are [candidates of all users][new prefix rows
    of all users], as the runtime lays them out; each user's pages are scattered over a shuffled
    pool with spare pages of noise between them."""
    g = torch.Generator().manual_seed(seed)
    total_keys = [cached + prefix for cached, prefix, _ in users]  # new rows' k/v are cached too
    pages_needed = [max(1, -(-keys // page_size)) for keys in total_keys]
    max_pages = max(pages_needed) + 1
    num_pages = sum(pages_needed) + 7
    pool = torch.randperm(num_pages, generator=g)
    page_table = torch.empty(len(users), max_pages, dtype=torch.int64)
    used = 0
    for u, n in enumerate(pages_needed):
        page_table[u, :n] = pool[used : used + n]
        used += n
        page_table[u, n:] = pool[torch.randint(num_pages, (max_pages - n,), generator=g)]  # valid, never read
    cache = torch.randn(num_pages, 2, page_size, heads, head_dim, generator=g).to(dtype)

    row_user, row_keys, row_candidate = [], [], []
    for u, (cached, prefix, candidates) in enumerate(users):
        row_user += [u] * candidates
        row_keys += [cached + prefix] * candidates
        row_candidate += [True] * candidates
    for u, (cached, prefix, _) in enumerate(users):
        row_user += [u] * prefix
        row_keys += [cached + i + 1 for i in range(prefix)]  # a prefix row reads up to its own position
        row_candidate += [False] * prefix
    rows = len(row_user)
    if fused_qkv:  # strided rows, as the model's chunked projection gives them
        qkv = torch.randn(rows, 4 * heads * head_dim, generator=g).to(dtype)
        q, k, v = (t.unflatten(1, (heads, head_dim)) for t in qkv.chunk(4, dim=1)[1:])
    else:
        q, k, v = (torch.randn(rows, heads, head_dim, generator=g).to(dtype) for _ in range(3))
    return (
        q,
        k,
        v,
        cache,
        page_table,
        torch.tensor(row_user, dtype=torch.int64),
        torch.tensor(row_keys, dtype=torch.int64),
        torch.tensor(row_candidate, dtype=torch.bool),
    )


def to_cuda(inputs):
    return tuple(t.cuda() for t in inputs)


def poison_allocator(like: torch.Tensor) -> None:
    """Leaves a NaN-filled block of the output's size in the caching allocator, so that an output
    element the kernel never writes shows up as NaN."""
    torch.full(like.shape, float("nan"), dtype=like.dtype, device="cuda")


def check_close(ops, inputs, alpha: float, inv_scaling: float) -> None:
    expected = ops.hstu_paged_attention(*inputs, alpha, inv_scaling)
    cuda_inputs = to_cuda(inputs)
    poison_allocator(expected)
    actual = ops.hstu_paged_attention(*cuda_inputs, alpha, inv_scaling)
    torch.cuda.synchronize()
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert torch.isfinite(actual).all(), "unwritten or non-finite output elements"
    atol_scale, rtol = TOLERANCES[expected.dtype]
    scale = expected.float().abs().max().item()
    torch.testing.assert_close(actual.cpu().float(), expected.float(), atol=atol_scale * scale, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("head_dim", [32, 64, 128, 48])
def test_matches_cpu(ops, dtype, head_dim):
    page_size = 16
    inputs = make_inputs(users_for(page_size), 2, head_dim, page_size, dtype, seed=head_dim)
    check_close(ops, inputs, alpha=1.0 / math.sqrt(head_dim), inv_scaling=1.0 / 1024)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_short_histories_and_strided_rows(ops, dtype):
    """Few keys per row (one key chunk: the kernel writes the output directly) and q/k/v as
    strided views of one fused projection."""
    page_size = 32
    users = [(0, 1, 4), (31, 2, 3), (200, 5, 9), (500, 0, 40)]
    inputs = make_inputs(users, 4, 128, page_size, dtype, seed=7, fused_qkv=True)
    check_close(ops, inputs, alpha=0.3, inv_scaling=1.0 / 256)


@pytest.mark.parametrize("rows", [40, 100, 190])
def test_block_widths(ops, rows):
    """Tiles of up to 64, 128 and 192 rows: blocks of 4, 8 and 12 warps, one of them partly empty."""
    page_size = 32
    users = [(1500 + 7 * u, rows // 2, rows - rows // 2) for u in range(5)] + [(300, 3, 2)]
    inputs = make_inputs(users, 2, 128, page_size, torch.bfloat16, seed=rows)
    check_close(ops, inputs, alpha=0.2, inv_scaling=1.0 / 2048)


def test_many_users_one_head(ops):
    """More blocks than the device holds at once (no split over keys: the kernel writes the
    output directly), with one head."""
    page_size = 32
    users = [(100 + 31 * (u % 40), 3, 5) for u in range(600)]
    inputs = make_inputs(users, 1, 64, page_size, torch.bfloat16, seed=11)
    check_close(ops, inputs, alpha=0.125, inv_scaling=1.0 / 512)


def test_deterministic(ops):
    page_size = 16
    inputs = to_cuda(make_inputs(users_for(page_size), 2, 128, page_size, torch.bfloat16, seed=3))
    first = ops.hstu_paged_attention(*inputs, 0.1, 1.0 / 1024)
    for _ in range(3):
        assert torch.equal(ops.hstu_paged_attention(*inputs, 0.1, 1.0 / 1024), first)


def test_rejects_bad_indices(ops):
    page_size = 16
    q, k, v, cache, page_table, row_user, row_keys, row_candidate = make_inputs(
        users_for(page_size), 2, 64, page_size, torch.bfloat16, seed=5
    )
    too_many = row_keys.clone()
    too_many[0] = page_table.shape[1] * page_size + 1
    with pytest.raises(RuntimeError, match="paged_attention:"):
        ops.hstu_paged_attention(*to_cuda((q, k, v, cache, page_table, row_user, too_many, row_candidate)), 1.0, 1.0)
    with pytest.raises(RuntimeError, match="paged_attention:"):
        ops.hstu_paged_attention(
            *to_cuda((q, k, v, cache.float(), page_table, row_user, row_keys, row_candidate)), 1.0, 1.0
        )


def test_opcheck(ops):
    page_size = 16
    inputs = to_cuda(make_inputs(users_for(page_size)[:4], 2, 64, page_size, torch.bfloat16, seed=9))
    torch.library.opcheck(
        ops.hstu_paged_attention.default, (*inputs, 0.125, 1.0 / 64), test_utils=("test_schema", "test_faketensor")
    )


def float32_reference(inputs, alpha: float, inv_scaling: float) -> torch.Tensor:
    """HSTU attention in plain float32 PyTorch from the same (upcast) inputs: each row's keys
    gathered from its user's pages, SiLU weights, no normaliser, the candidate's own key added."""
    q, k, v, cache, page_table, row_user, row_keys, row_candidate = (
        t.float() if t.is_floating_point() else t for t in inputs
    )
    page_size = cache.shape[2]
    out = torch.zeros_like(q)
    for r in range(q.shape[0]):
        n = int(row_keys[r])
        if n > 0:
            slots = torch.arange(n)
            pages = page_table[row_user[r], slots // page_size]
            keys = cache[pages, 0, slots % page_size]  # [n, H, dh]
            values = cache[pages, 1, slots % page_size]
            weights = torch.nn.functional.silu(alpha * torch.einsum("hd,nhd->nh", q[r], keys)) * inv_scaling
            out[r] = torch.einsum("nh,nhd->hd", weights, values)
        if row_candidate[r]:
            weight = torch.nn.functional.silu(alpha * (q[r] * k[r]).sum(-1)) * inv_scaling  # [H]
            out[r] += weight[:, None] * v[r]
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_matches_float32_recompute(ops, dtype, head_dim):
    """Every 16-bit path (on Hopper: the wgmma kernel with 1, 2 and 3 consumer warpgroups) against
    the float32 recompute of the same inputs."""
    page_size = 32
    users = [(0, 0, 3), (page_size, 2, 30), (900, 40, 60), (2100, 64, 100), (300, 0, 1)]
    inputs = make_inputs(users, 2, head_dim, page_size, dtype, seed=head_dim + 1)
    alpha, inv_scaling = 1.0 / math.sqrt(head_dim), 1.0 / 1024
    expected = float32_reference(inputs, alpha, inv_scaling)
    actual = ops.hstu_paged_attention(*to_cuda(inputs), alpha, inv_scaling).cpu().float()
    atol_scale, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(actual, expected, atol=atol_scale * expected.abs().max().item(), rtol=rtol)


def unaligned_rows(t: torch.Tensor) -> torch.Tensor:
    """The same values, on the GPU, as rows 4-byte but not 16-byte aligned (a row stride that is no
    multiple of 8). Made on the device: copying such a view there would make it contiguous."""
    rows = t.shape[0]
    wide = torch.zeros(rows, t[0].numel() + 2, dtype=t.dtype, device="cuda")
    wide[:, 2:] = t.reshape(rows, -1).cuda()
    view = wide[:, 2:].unflatten(1, t.shape[1:])
    assert view.stride(0) % 8 != 0
    return view


def test_unaligned_rows(ops):
    """q/k/v rows the Hopper kernel's 16-byte Q copies cannot read: the dispatcher takes the
    mma.sync kernel, with the same results."""
    page_size = 32
    inputs = make_inputs([(700, 10, 20), (40, 3, 5)], 2, 128, page_size, torch.bfloat16, seed=13)
    expected = ops.hstu_paged_attention(*inputs, 0.1, 1.0 / 512)
    q, k, v, *rest = inputs
    actual = ops.hstu_paged_attention(*(unaligned_rows(t) for t in (q, k, v)), *to_cuda(rest), 0.1, 1.0 / 512)
    atol_scale, rtol = TOLERANCES[torch.bfloat16]
    scale = expected.float().abs().max().item()
    torch.testing.assert_close(actual.cpu().float(), expected.float(), atol=atol_scale * scale, rtol=rtol)


def kernels_run(ops, inputs) -> set[str]:
    """The CUDA kernels one call of the op launches."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        ops.hstu_paged_attention(*inputs, 0.1, 1.0 / 256)
        torch.cuda.synchronize()
    return {event.name for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA}


def test_dispatcher_paths(ops):
    """Which kernel serves which input: on Hopper, with a library built with CUTLASS's headers, the
    wgmma kernel for 16-bit inputs of head_dim 64/128 and aligned rows; the mma.sync kernel for
    other 16-bit inputs (and for every 16-bit input elsewhere); the generic one for float32."""
    from kvexport.native.build import cutlass_include_dir

    hopper = torch.cuda.get_device_capability()[0] == 9 and cutlass_include_dir() is not None
    page_size = 32
    users = [(300, 4, 6)]

    def names(head_dim, dtype, unaligned=False):
        q, k, v, *rest = make_inputs(users, 2, head_dim, page_size, dtype, seed=17)
        q, k, v = (unaligned_rows(t) for t in (q, k, v)) if unaligned else to_cuda((q, k, v))
        return " ".join(kernels_run(ops, (q, k, v, *to_cuda(rest))))

    for dtype in (torch.bfloat16, torch.float16):
        for head_dim in (64, 128):
            expected = "attention_sm90_kernel" if hopper else "attention_mma_kernel"
            assert expected in names(head_dim, dtype), (dtype, head_dim)
        assert "attention_mma_kernel" in names(32, dtype)
        assert "attention_mma_kernel" in names(128, dtype, unaligned=True)
    assert "attention_generic_kernel" in names(128, torch.float32)
