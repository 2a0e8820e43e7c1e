// The arguments of the CUDA attention kernels (paged_attention_cuda.cu, paged_attention_sm90.cu),
// plain data so that both translation units (one of them built without torch's headers) share them.
#pragma once

#include <cstdint>

namespace kvexport::ops {

struct AttentionParams {
  const void *q, *k, *v;
  int64_t q_stride, k_stride, v_stride;  // elements between consecutive rows
  const void* cache;                     // [pages, 2, page_size, heads, head_dim], contiguous
  const int64_t* page_table;             // [users, max_pages]
  const int64_t* row_keys;
  const bool* row_candidate;
  const int64_t *row_order, *tiles;  // the runtime's plan (runtime::user_tiles)
  void* out;                         // [rows, heads, head_dim], q's dtype
  float* partial;                    // [chunks, rows, heads, head_dim]; only when chunks > 1
  int64_t rows, max_pages;
  int heads, head_dim, page_size;
  int chunks, chunk_keys;  // chunk c holds keys [c * chunk_keys, (c + 1) * chunk_keys); the last one all the rest
  int64_t split_tiles;     // host only: the tiles that hold rows, for sizing the split over keys
  float alpha, inv_scaling;
};

}  // namespace kvexport::ops
