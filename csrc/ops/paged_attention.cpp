#include "ops/paged_attention.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

namespace kvexport::ops {

namespace {

inline float silu(float x) { return x / (1.0f + std::exp(-x)); }

template <typename scalar_t>
inline float dot(const scalar_t* a, const scalar_t* b, int64_t n) {
  float sum = 0.0f;
  for (int64_t d = 0; d < n; ++d) sum += static_cast<float>(a[d]) * static_cast<float>(b[d]);
  return sum;
}

template <typename scalar_t>
inline void accumulate(float* acc, float weight, const scalar_t* value, int64_t n) {
  for (int64_t d = 0; d < n; ++d) acc[d] += weight * static_cast<float>(value[d]);
}

template <typename scalar_t>
void attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cache,
            const at::Tensor& page_table, const at::Tensor& row_user, const at::Tensor& row_keys,
            const at::Tensor& row_candidate, float alpha, float inv_scaling_seqlen, at::Tensor& out) {
  const int64_t num_rows = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t page_size = cache.size(2);
  const int64_t row_stride = num_heads * head_dim;  // between rows of q/k/v/out and slots of a page
  const int64_t page_stride = 2 * page_size * row_stride;
  const int64_t max_pages = page_table.size(1);
  const scalar_t* q_ptr = q.data_ptr<scalar_t>();
  const scalar_t* k_ptr = k.data_ptr<scalar_t>();
  const scalar_t* v_ptr = v.data_ptr<scalar_t>();
  const scalar_t* cache_ptr = cache.data_ptr<scalar_t>();
  const int64_t* pages = page_table.data_ptr<int64_t>();
  const int64_t* users = row_user.data_ptr<int64_t>();
  const int64_t* keys = row_keys.data_ptr<int64_t>();
  const bool* candidate = row_candidate.data_ptr<bool>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();

  at::parallel_for(0, num_rows * num_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(head_dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / num_heads, h = item % num_heads;
      const scalar_t* q_row = q_ptr + r * row_stride + h * head_dim;
      const int64_t* user_pages = pages + users[r] * max_pages;
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t j = 0; j < keys[r]; ++j) {
        const scalar_t* slot = cache_ptr + user_pages[j / page_size] * page_stride + (j % page_size) * row_stride +
                               h * head_dim;
        const float weight = silu(alpha * dot(q_row, slot, head_dim)) * inv_scaling_seqlen;
        accumulate(acc.data(), weight, slot + page_size * row_stride, head_dim);
      }
      if (candidate[r]) {
        const scalar_t* k_row = k_ptr + r * row_stride + h * head_dim;
        const float weight = silu(alpha * dot(q_row, k_row, head_dim)) * inv_scaling_seqlen;
        accumulate(acc.data(), weight, v_ptr + r * row_stride + h * head_dim, head_dim);
      }
      scalar_t* out_row = out_ptr + r * row_stride + h * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) out_row[d] = static_cast<scalar_t>(acc[d]);
    }
  });
}

}  // namespace

at::Tensor paged_attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cache,
                               const at::Tensor& page_table, const at::Tensor& row_user, const at::Tensor& row_keys,
                               const at::Tensor& row_candidate, double alpha, double inv_scaling_seqlen) {
  TORCH_CHECK(q.dim() == 3 && q.sizes() == k.sizes() && q.sizes() == v.sizes(), "paged_attention: q ", q.sizes(),
              ", k ", k.sizes(), ", v ", v.sizes(), " must be equal [N, H, dh]");
  TORCH_CHECK(cache.dim() == 5 && cache.size(1) == 2 && cache.size(3) == q.size(1) && cache.size(4) == q.size(2),
              "paged_attention: cache ", cache.sizes(), " does not fit q ", q.sizes());
  TORCH_CHECK(q.scalar_type() == cache.scalar_type(), "paged_attention: q dtype ", q.scalar_type(),
              " != cache dtype ", cache.scalar_type());
  TORCH_CHECK(row_user.size(0) == q.size(0) && row_keys.size(0) == q.size(0) && row_candidate.size(0) == q.size(0),
              "paged_attention: row metadata has ", row_user.size(0), " rows, q has ", q.size(0));
  TORCH_CHECK(q.device().is_cpu(), "paged_attention: this kernel runs on CPU, got ", q.device());
  const auto qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous(), cc = cache.contiguous();
  const auto pt = page_table.to(at::kLong).contiguous();
  const auto users = row_user.to(at::kLong).contiguous(), keys = row_keys.to(at::kLong).contiguous();
  const auto candidate = row_candidate.to(at::kBool).contiguous();
  const int64_t capacity = pt.size(1) * cache.size(2);
  for (int64_t r = 0; r < q.size(0); ++r) {
    const int64_t user = users.data_ptr<int64_t>()[r], num_keys = keys.data_ptr<int64_t>()[r];
    TORCH_CHECK(user >= 0 && user < pt.size(0), "paged_attention: row ", r, " user ", user, " outside 0..",
                pt.size(0) - 1);
    TORCH_CHECK(num_keys >= 0 && num_keys <= capacity, "paged_attention: row ", r, " reads ", num_keys,
                " keys, the page table holds ", capacity);
  }
  auto out = at::empty_like(qc);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention_cpu", [&] {
    attend<scalar_t>(qc, kc, vc, cc, pt, users, keys, candidate, static_cast<float>(alpha),
                     static_cast<float>(inv_scaling_seqlen), out);
  });
  return out;
}

}  // namespace kvexport::ops
