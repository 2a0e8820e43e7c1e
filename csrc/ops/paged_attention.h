// HSTU attention (docs/design.md §1.3 step 3) of new rows over a paged k/v cache.
#pragma once

#include <ATen/Tensor.h>

namespace kvexport::ops {

// q, k, v [N, H, dh]: the new rows. cache [pages, 2, page_size, H, dh]: one layer of the cache.
// page_table [B, max_pages]; row_user [N]; row_keys [N] (cached keys each row reads, in
// position order); row_candidate [N] (candidate rows also read their own k/v).
// out[r] = sum_j SiLU(alpha * q_r . k_j) * inv_scaling_seqlen * v_j over those keys.
at::Tensor paged_attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cache,
                               const at::Tensor& page_table, const at::Tensor& row_user, const at::Tensor& row_keys,
                               const at::Tensor& row_candidate, double alpha, double inv_scaling_seqlen);

}  // namespace kvexport::ops
