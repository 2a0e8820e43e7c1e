// HSTU attention over the paged k/v cache on CUDA devices (the CPU kernel, paged_attention.h, is
// the reference). Built only when the torch that CMake finds has CUDA (KVEXPORT_WITH_CUDA).
#pragma once

#include <ATen/Tensor.h>

#include <c10/core/Device.h>

#include <cstdint>
#include <string>
#include <utility>

namespace kvexport::ops {

// CUDA device `index`'s compute capability ("major.minor") and name (-1: the current device);
// empty strings when this host has no such device.
std::pair<std::string, std::string> cuda_device_info(c10::DeviceIndex index);

// q, k, v [N, H, dh] (rows may be strided, each row's [H, dh] dense); cache [pages, 2, page_size, H, dh]
// (contiguous); page_table [B, max_pages] int64; row_keys [N] int64; row_candidate [N] bool;
// row_order [N] and tiles [T, 3] int64 as the runtime's plan lays them out (runtime::user_tiles).
// max_keys: an upper bound of row_keys, known on the host (BatchPlan::max_row_keys); it only
// sizes the split over keys. max_tile_rows: the widest tile's row count (BatchPlan::max_tile_rows);
// it only picks the block's width. A row that reads more keys or a wider tile is still computed
// in full. split_tiles: how many tiles hold rows, when tiles has empty ones at its end (a step
// program's plan, padded for a bucket); it sizes the split over keys as the real tiles need. 0:
// every tile.
// Runs on the current stream; never synchronises with the host. Output [N, H, dh] in q's dtype.
at::Tensor paged_attention_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cache,
                                const at::Tensor& page_table, const at::Tensor& row_keys,
                                const at::Tensor& row_candidate, const at::Tensor& row_order, const at::Tensor& tiles,
                                int64_t max_keys, int64_t max_tile_rows, int64_t split_tiles, double alpha,
                                double inv_scaling_seqlen);

}  // namespace kvexport::ops
