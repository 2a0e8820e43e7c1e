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

// Rows of one user are processed in tiles that share each key and value read from the cache:
// the cache is read once per tile instead of once per row (the kernel is bound by those reads).
constexpr int64_t kTileRows = 16;

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
  const int64_t value_offset = page_size * row_stride;  // v follows k within a page
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
    // scores[j * kTileRows + t]: key j for tile row t, key-major so that the rows' scores of one
    // key share a cache line (row-major rows would sit max_keys floats apart and alias in L1).
    std::vector<float> scores((max_keys + 1) * kTileRows), self_scores(kTileRows);
    std::vector<float> acc(kTileRows * head_dim), q_tile(kTileRows * head_dim);
    for (int64_t item = begin; item < end; ++item) {
      const Tile tile = tiles[item / num_heads];
      const int64_t h = item % num_heads;
      const int64_t* user_pages = pages + users[tile.first_row] * max_pages;
      const int64_t* row_keys_of_tile = keys + tile.first_row;
      int64_t tile_keys = 0;
      for (int64_t t = 0; t < tile.num_rows; ++t) {
        const int64_t r = tile.first_row + t;
        tile_keys = std::max(tile_keys, row_keys_of_tile[t]);
        for (int64_t d = 0; d < head_dim; ++d) {
          q_tile[t * head_dim + d] = static_cast<float>(q_ptr[r * row_stride + h * head_dim + d]);
        }
        self_scores[t] = candidate[r] ? dot(&q_tile[t * head_dim], k_ptr + r * row_stride + h * head_dim, head_dim)
                                      : 0.0f;
      }
      // Keys are visited page by page: no division per key on the hot path.
      auto for_each_key = [&](auto&& visit) {
        for (int64_t first = 0, p = 0; first < tile_keys; first += page_size, ++p) {
          const scalar_t* page = cache_ptr + user_pages[p] * page_stride + h * head_dim;
          const int64_t count = std::min(page_size, tile_keys - first);
          for (int64_t s = 0; s < count; ++s) visit(first + s, page + s * row_stride);
        }
      };
      for_each_key([&](int64_t j, const scalar_t* key) {
        for (int64_t t = 0; t < tile.num_rows; ++t) scores[j * kTileRows + t] = dot(&q_tile[t * head_dim], key, head_dim);
      });
      silu_weights(scores.data(), tile_keys * kTileRows, alpha, inv_scaling_seqlen);
      silu_weights(self_scores.data(), tile.num_rows, alpha, inv_scaling_seqlen);
      std::fill(acc.begin(), acc.end(), 0.0f);
      for_each_key([&](int64_t j, const scalar_t* key) {
        for (int64_t t = 0; t < tile.num_rows; ++t) {
          if (j < row_keys_of_tile[t]) {  // causal: row t reads only its first keys
            accumulate(&acc[t * head_dim], scores[j * kTileRows + t], key + value_offset, head_dim);
          }
        }
      });
      for (int64_t t = 0; t < tile.num_rows; ++t) {
        const int64_t r = tile.first_row + t;
        if (candidate[r]) {
          accumulate(&acc[t * head_dim], self_scores[t], v_ptr + r * row_stride + h * head_dim, head_dim);
        }
        for (int64_t d = 0; d < head_dim; ++d) {
          out_ptr[r * row_stride + h * head_dim + d] = static_cast<scalar_t>(acc[t * head_dim + d]);
        }
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
