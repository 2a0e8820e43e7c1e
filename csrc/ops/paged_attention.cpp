#include "ops/paged_attention.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <type_traits>
#include <cmath>
#include <vector>

namespace kvexport::ops {

namespace {

// The loops below are written for `#pragma omp simd` (-fopenmp-simd): the reductions vectorise
// without -ffast-math. expf does not vectorise without -ffast-math (glibc declares its vector
// variants only then), so SiLU uses exp2 by range reduction and a degree-7 polynomial: relative
// error below 1e-7 on the whole float range, far inside the package tolerances.
inline float exp_approx(float x) {
  const float clamped = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  const float t = clamped * 1.44269504088896341f;  // x * log2(e)
  constexpr float kRound = 12582912.0f;             // 1.5 * 2^23: adding it rounds to an integer
  const float n = (t + kRound) - kRound;
  const float f = (t - n) * 0.693147180559945309f;  // e^f with f in [-ln2/2, ln2/2]
  float p = 1.0f / 5040.0f;
  p = p * f + 1.0f / 720.0f;
  p = p * f + 1.0f / 120.0f;
  p = p * f + 1.0f / 24.0f;
  p = p * f + 1.0f / 6.0f;
  p = p * f + 0.5f;
  p = p * f + 1.0f;
  p = p * f + 1.0f;
  const int32_t exponent = (static_cast<int32_t>(n) + 127) << 23;  // 2^n as a float's bits
  return p * std::bit_cast<float>(exponent);
}

template <typename scalar_t>
inline float dot(const float* q, const scalar_t* k, int64_t n) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t d = 0; d < n; ++d) sum += q[d] * static_cast<float>(k[d]);
  return sum;
}

template <typename scalar_t>
inline void accumulate(float* acc, float weight, const scalar_t* value, int64_t n) {
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) acc[d] += weight * static_cast<float>(value[d]);
}

// scores[j] <- SiLU(alpha * scores[j]) * inv_scaling_seqlen
inline void silu_weights(float* scores, int64_t n, float alpha, float inv_scaling_seqlen) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    const float x = alpha * scores[j];
    scores[j] = x / (1.0f + exp_approx(-x)) * inv_scaling_seqlen;
  }
}

// Rows of one user are processed in tiles that share one gather of the user's keys and values:
// the cache is read once per tile instead of once per row.
constexpr int64_t kTileRows = 16;

// Keys 0..n-1 of one user and head, as float: keys_t[d * n + j] (transposed) and
// values[j * head_dim + d]. `head` points at the head's slice of page 0, slot 0.
template <typename scalar_t>
void gather_keys_values(const scalar_t* head, const int64_t* user_pages, int64_t n, int64_t page_size,
                        int64_t page_stride, int64_t row_stride, int64_t head_dim, float* keys_t, float* values) {
  const int64_t value_offset = page_size * row_stride;  // v follows k within a page
  for (int64_t first = 0, p = 0; first < n; first += page_size, ++p) {  // page by page: no division per key
    const scalar_t* page = head + user_pages[p] * page_stride;
    const int64_t count = std::min(page_size, n - first);
    for (int64_t s = 0; s < count; ++s) {
      const scalar_t* key = page + s * row_stride;
      for (int64_t d = 0; d < head_dim; ++d) {
        keys_t[d * n + first + s] = static_cast<float>(key[d]);
        values[(first + s) * head_dim + d] = static_cast<float>(key[value_offset + d]);
      }
    }
  }
}

struct Tile {
  int64_t first_row, num_rows;
};

std::vector<Tile> user_tiles(const int64_t* users, int64_t num_rows) {
  std::vector<Tile> tiles;
  for (int64_t r = 0; r < num_rows; ++r) {
    if (tiles.empty() || users[r] != users[tiles.back().first_row] || tiles.back().num_rows == kTileRows) {
      tiles.push_back({r, 0});
    }
    ++tiles.back().num_rows;
  }
  return tiles;
}

// kHeadDim > 0 fixes the head size at compile time (fully unrolled dot products); 0 = any size.
template <typename scalar_t, int64_t kHeadDim>
void attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cache,
            const at::Tensor& page_table, const at::Tensor& row_user, const at::Tensor& row_keys,
            const at::Tensor& row_candidate, float alpha, float inv_scaling_seqlen, at::Tensor& out) {
  const int64_t num_rows = q.size(0), num_heads = q.size(1);
  const int64_t head_dim = kHeadDim > 0 ? kHeadDim : q.size(2);
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
  const int64_t max_keys = num_rows ? *std::max_element(keys, keys + num_rows) : 0;
  const auto tiles = user_tiles(users, num_rows);

  at::parallel_for(0, static_cast<int64_t>(tiles.size()) * num_heads, 1, [&](int64_t begin, int64_t end) {
    // Per tile and head, the user's keys are gathered transposed (keys_t[d * n + j]) and its values
    // row by row (values[j * dh + d]), as float. Scores then vectorise over keys and outputs over
    // head_dim, with no horizontal reductions and no per-key latency chain.
    std::vector<float> keys_t(head_dim * max_keys), values(max_keys * head_dim);
    std::vector<float> scores(max_keys), acc(head_dim), q_row(head_dim), k_row(head_dim);
    for (int64_t item = begin; item < end; ++item) {
      const Tile tile = tiles[item / num_heads];
      const int64_t h = item % num_heads;
      const int64_t* user_pages = pages + users[tile.first_row] * max_pages;
      const int64_t n = *std::max_element(keys + tile.first_row, keys + tile.first_row + tile.num_rows);
      gather_keys_values(cache_ptr + h * head_dim, user_pages, n, page_size, page_stride, row_stride, head_dim,
                         keys_t.data(), values.data());
      for (int64_t t = 0; t < tile.num_rows; ++t) {
        const int64_t r = tile.first_row + t, num_keys = keys[r];
        const int64_t head = r * row_stride + h * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) q_row[d] = static_cast<float>(q_ptr[head + d]);
        std::fill(scores.begin(), scores.begin() + num_keys, 0.0f);
        for (int64_t d = 0; d < head_dim; ++d) {
          const float qd = q_row[d];
          const float* column = &keys_t[d * n];
#pragma omp simd
          for (int64_t j = 0; j < num_keys; ++j) scores[j] += qd * column[j];
        }
        silu_weights(scores.data(), num_keys, alpha, inv_scaling_seqlen);
        std::fill(acc.begin(), acc.end(), 0.0f);
        int64_t j = 0;
        for (; j + 4 <= num_keys; j += 4) {  // four keys per step: independent products, one add chain
          const float *v0 = &values[j * head_dim], *v1 = v0 + head_dim, *v2 = v1 + head_dim, *v3 = v2 + head_dim;
          const float w0 = scores[j], w1 = scores[j + 1], w2 = scores[j + 2], w3 = scores[j + 3];
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) acc[d] += (w0 * v0[d] + w1 * v1[d]) + (w2 * v2[d] + w3 * v3[d]);
        }
        for (; j < num_keys; ++j) accumulate(acc.data(), scores[j], &values[j * head_dim], head_dim);
        if (candidate[r]) {  // a candidate also reads its own k/v, which is not in the cache
          for (int64_t d = 0; d < head_dim; ++d) k_row[d] = static_cast<float>(k_ptr[head + d]);
          float self = dot(q_row.data(), k_row.data(), head_dim);
          silu_weights(&self, 1, alpha, inv_scaling_seqlen);
          accumulate(acc.data(), self, v_ptr + head, head_dim);
        }
        for (int64_t d = 0; d < head_dim; ++d) out_ptr[head + d] = static_cast<scalar_t>(acc[d]);
      }
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
  TORCH_CHECK(pt.dim() == 2, "paged_attention: page_table must be [B, max_pages], got ", pt.sizes());
  TORCH_CHECK(cache.device() == q.device(), "paged_attention: cache on ", cache.device(), ", q on ", q.device());
  const int64_t num_pages = cache.size(0);
  for (int64_t i = 0; i < pt.numel(); ++i) {
    const int64_t page = pt.data_ptr<int64_t>()[i];
    TORCH_CHECK(page >= 0 && page < num_pages, "paged_attention: page ", page, " outside 0..", num_pages - 1);
  }
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
    const auto run = [&](auto head_dim) {
      attend<scalar_t, decltype(head_dim)::value>(qc, kc, vc, cc, pt, users, keys, candidate,
                                                  static_cast<float>(alpha), static_cast<float>(inv_scaling_seqlen),
                                                  out);
    };
    switch (q.size(2)) {
      case 32: run(std::integral_constant<int64_t, 32>{}); break;
      case 64: run(std::integral_constant<int64_t, 64>{}); break;
      case 128: run(std::integral_constant<int64_t, 128>{}); break;
      default: run(std::integral_constant<int64_t, 0>{});
    }
  });
  return out;
}

}  // namespace kvexport::ops
