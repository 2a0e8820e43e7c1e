// HSTU attention (docs/design.md §1.3 step 3) of new rows over a paged k/v cache, and the threading
// of a request's kernels.
#pragma once

#include <ATen/Tensor.h>

#include <cstdint>

namespace kvexport::ops {

// q, k, v [N, H, dh]: the new rows (any stride between rows, rows_in_place). cache [pages, 2, page_size, H, dh]: one
// layer of the cache. page_table [B, max_pages]; row_user [N]; row_keys [N] (cached keys each row reads, in position
// order); row_candidate [N] (candidate rows also read their own k/v). out[r] = sum_j SiLU(alpha * q_r . k_j) *
// inv_scaling_seqlen * v_j over those keys.
at::Tensor paged_attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cache,
                               const at::Tensor& page_table, const at::Tensor& row_user, const at::Tensor& row_keys,
                               const at::Tensor& row_candidate, double alpha, double inv_scaling_seqlen);

// t [N, H, dh] itself when each row's H x dh values are contiguous, whatever the stride between rows
// (the model's q, k and v are column slices of one projection), else a contiguous copy: what the
// CPU kernel and the cache stores read without copying.
at::Tensor rows_in_place(const at::Tensor& t);

// The checks the pure ops make on the host before reading the cache through the metadata:
// page_table [B, max_pages], row_user [N] and row_keys [N] (contiguous int64 on the CPU) index only
// pages of the cache and keys the table holds. Returns the most keys a row reads.
int64_t check_row_metadata(const at::Tensor& page_table, const at::Tensor& row_user, const at::Tensor& row_keys,
                           int64_t num_pages, int64_t page_size);

// A request's threads, set on the thread that runs it (begin_batch) and restored when it ends
// (end_batch, abort_batch). A request with few new rows runs every other OpenMP region of the
// package (Inductor's kernels, ATen's parallel ops) on the calling thread; paged_attention_cpu
// keeps the thread's original budget. Under CPU contention a region of a two-thread team costs a
// scheduler round trip, and a cached request has dozens of tiny ones (benchmarks/RESULTS.md).
// When other processes keep the CPUs busy, the request uses fewer threads than the thread has
// (every region, the attention kernel's too). end_request_threads returns whether it did.
void begin_request_threads(int64_t new_rows);
bool end_request_threads();

}  // namespace kvexport::ops
