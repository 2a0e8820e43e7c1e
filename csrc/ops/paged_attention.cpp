#include "ops/paged_attention.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <vector>

#include "ops/compiled_isa.h"
#include "runtime/parallel.h"

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

// scores[j] <- SiLU(alpha * scores[j]) * inv_scaling_seqlen
inline void silu_weights(float* scores, int64_t n, float alpha, float inv_scaling_seqlen) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    const float x = alpha * scores[j];
    scores[j] = x / (1.0f + exp_approx(-x)) * inv_scaling_seqlen;
  }
}

// Rows of one user are processed in tiles of up to kTileRows rows, and the user's keys in blocks
// of kBlockFloats / head_dim keys converted to float (keys transposed, values row by row). A block
// is read from the cache once per tile and stays in L1/L2 while every row of the tile uses it: no
// buffer of the whole history (megabytes allocated and zeroed per call) and no pass of each row
// over megabytes of L3. A call that runs on the calling thread alone (for_each_item) takes tiles
// of kAloneTileRows: no balance to keep, and each block is then gathered once per 64 rows rather
// than 16 (single thread: 194 -> 155 us for 96 rows over 130 keys at head size 32, 64 -> 33 ms for
// 164 rows over 4000 keys at 128, 533 -> 405 us at 64).
constexpr int64_t kTileRows = 16;
constexpr int64_t kAloneTileRows = 64;
constexpr int64_t kBlockFloats = 8192;  // 32 KiB of keys and 32 KiB of values per block

// One block for one tile, float only (the part worth compiling per ISA). keys_t[d * stride + j] and
// values[j * head_dim + d] hold keys 0..count-1 of the block; row t reads the first limits[t] of
// them (causal rows stop early). acc[t * head_dim + d] += sum_j SiLU(alpha q_t . k_j) * inv * v_j[d].
// scores holds a tile's rows (up to kAloneTileRows) of stride floats.
//
// kHeadDim > 0 (32, 64 or 128) fixes the head size at compile time (blocks of a whole number of
// kKeyChunk keys): the dot products then run in register tiles of kRowGroup rows by kKeyChunk keys
// over the whole head dimension, one load of a key column feeding kRowGroup multiply-adds, and each
// row's weighted sum of values runs in registers over all of its keys, several keys a step into
// sums of their own so that the adds do not wait on each other. Single thread, on the 2-core
// machine: register tiles made 64 and 128 1.25x and 1.41x faster than the row-at-a-time loop below
// (32 then lost); the value sums kept in vector registers made 32 1.43x, 64 1.24x and 128 1.19x
// faster again (benchmarks/RESULTS.md). Any other size (0) takes the row-at-a-time loop, the scores
// summed in memory.
constexpr int64_t kRowGroup = 4;
constexpr int64_t kKeyChunk = 16;
// A vector of kLanes floats (GCC's vector extension: one AVX-512 register, or two AVX2 ones).
constexpr int64_t kLanes = 16;
using Lanes = float __attribute__((vector_size(kLanes * sizeof(float))));

template <int64_t kHeadDim>
inline __attribute__((always_inline)) void dot_tile(const float* q, int64_t rows, const float* keys_t,
                                                    int64_t stride, int64_t keys, float* scores) {
  for (int64_t t0 = 0; t0 < rows; t0 += kRowGroup) {
    const int64_t group = std::min(kRowGroup, rows - t0);
    for (int64_t j0 = 0; j0 < keys; j0 += kKeyChunk) {
      float acc[kRowGroup][kKeyChunk] = {};
      for (int64_t d = 0; d < kHeadDim; ++d) {
        const float* column = keys_t + d * stride + j0;
        for (int64_t r = 0; r < kRowGroup; ++r) {  // rows past `group` read q's scratch, never stored
          const float qd = q[(t0 + r) * kHeadDim + d];
#pragma omp simd
          for (int64_t j = 0; j < kKeyChunk; ++j) acc[r][j] += qd * column[j];
        }
      }
      for (int64_t r = 0; r < group; ++r) std::copy(acc[r], acc[r] + kKeyChunk, scores + (t0 + r) * stride + j0);
    }
  }
}

template <int64_t kHeadDim>
inline __attribute__((always_inline)) void attend_block_impl(const float* q, float* acc, const int64_t* limits,
                                                             int64_t rows, const float* keys_t, int64_t stride,
                                                             const float* values, int64_t runtime_head_dim,
                                                             float alpha, float inv_scaling_seqlen, float* scores) {
  if constexpr (kHeadDim > 0) {
    static_assert(kHeadDim % kLanes == 0, "a fixed head size is a whole number of vectors");
    const int64_t most = *std::max_element(limits, limits + rows);
    if (most <= 0) return;
    // Whole chunks: keys past `count` are stale scratch, finite, and read by no row.
    dot_tile<kHeadDim>(q, rows, keys_t, stride, (most + kKeyChunk - 1) / kKeyChunk * kKeyChunk, scores);
    for (int64_t t = 0; t < rows; ++t) {
      const int64_t count = limits[t];
      if (count <= 0) continue;
      float* weights = scores + t * stride;
      silu_weights(weights, count, alpha, inv_scaling_seqlen);
      // The row's sum as vectors of kLanes floats, unrolled so each stays in a register (as a
      // float array, GCC stored it to the stack and read it back for every key); kKeys keys a step
      // into sums of their own, kKeys * kVectors independent add chains, added up at the end.
      constexpr int64_t kVectors = kHeadDim / kLanes;
      constexpr int64_t kKeys = kVectors >= 8 ? 1 : 8 / kVectors;
      Lanes sum[kKeys][kVectors] = {};
      float* acc_row = acc + t * kHeadDim;
#pragma GCC unroll 8
      for (int64_t c = 0; c < kVectors; ++c) std::memcpy(&sum[0][c], acc_row + c * kLanes, sizeof(Lanes));
      for (int64_t j = 0; j < count; j += kKeys) {
        const int64_t step = std::min(kKeys, count - j);  // the last step may hold fewer keys
#pragma GCC unroll 8
        for (int64_t k = 0; k < kKeys; ++k) {
          if (k >= step) break;
          const float w = weights[j + k];
          const float* value = values + (j + k) * kHeadDim;
#pragma GCC unroll 8
          for (int64_t c = 0; c < kVectors; ++c) {
            Lanes v;
            std::memcpy(&v, value + c * kLanes, sizeof(Lanes));
            sum[k][c] += w * v;
          }
        }
      }
#pragma GCC unroll 8
      for (int64_t c = 0; c < kVectors; ++c) {
#pragma GCC unroll 8
        for (int64_t k = 1; k < kKeys; ++k) sum[0][c] += sum[k][c];
        std::memcpy(acc_row + c * kLanes, &sum[0][c], sizeof(Lanes));
      }
    }
    return;
  }
  const int64_t head_dim = kHeadDim > 0 ? kHeadDim : runtime_head_dim;
  for (int64_t t = 0; t < rows; ++t) {
    const int64_t count = limits[t];
    if (count <= 0) continue;
    const float* q_row = q + t * head_dim;
    float* acc_row = acc + t * head_dim;
    std::fill(scores, scores + count, 0.0f);
    for (int64_t d = 0; d < head_dim; ++d) {  // vectorised over keys: no horizontal reductions
      const float qd = q_row[d];
      const float* column = keys_t + d * stride;
#pragma omp simd
      for (int64_t j = 0; j < count; ++j) scores[j] += qd * column[j];
    }
    silu_weights(scores, count, alpha, inv_scaling_seqlen);
    int64_t j = 0;
    for (; j + 4 <= count; j += 4) {  // four keys per step: independent products, one add chain
      const float *v0 = values + j * head_dim, *v1 = v0 + head_dim, *v2 = v1 + head_dim, *v3 = v2 + head_dim;
      const float w0 = scores[j], w1 = scores[j + 1], w2 = scores[j + 2], w3 = scores[j + 3];
#pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d) acc_row[d] += (w0 * v0[d] + w1 * v1[d]) + (w2 * v2[d] + w3 * v3[d]);
    }
    for (; j < count; ++j) {
      const float w = scores[j];
      const float* value = values + j * head_dim;
#pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d) acc_row[d] += w * value[d];
    }
  }
}

using AttendBlock = void (*)(const float*, float*, const int64_t*, int64_t, const float*, int64_t, const float*,
                             int64_t, float, float, float*);

#define KVEXPORT_ATTEND_BLOCK(name, head_dim)                                                                   \
  KVEXPORT_KERNEL_CLONES void name(const float* q, float* acc, const int64_t* limits, int64_t rows,            \
                                   const float* keys_t, int64_t stride, const float* values, int64_t dh,       \
                                   float alpha, float inv_scaling_seqlen, float* scores) {                     \
    attend_block_impl<head_dim>(q, acc, limits, rows, keys_t, stride, values, dh, alpha, inv_scaling_seqlen,   \
                                scores);                                                                        \
  }
KVEXPORT_ATTEND_BLOCK(attend_block_32, 32)
KVEXPORT_ATTEND_BLOCK(attend_block_64, 64)
KVEXPORT_ATTEND_BLOCK(attend_block_128, 128)
KVEXPORT_ATTEND_BLOCK(attend_block_any, 0)
#undef KVEXPORT_ATTEND_BLOCK

AttendBlock attend_block_for(int64_t head_dim) {
  switch (head_dim) {
    case 32: return attend_block_32;
    case 64: return attend_block_64;
    case 128: return attend_block_128;
    default: return attend_block_any;
  }
}

// Keys first..first+count-1 of one user and head as float: keys_t[d * stride + j], values[j * head_dim + d].
// `head` points at the head's slice of page 0, slot 0; v follows k within a page. Multiversioned
// like attend_block: the conversions vectorise too.
template <typename scalar_t>
KVEXPORT_KERNEL_CLONES void gather_block(const scalar_t* head, const int64_t* user_pages, int64_t first,
                                         int64_t count, int64_t page_size, int64_t page_stride,
                                         int64_t row_stride, int64_t head_dim, int64_t stride, float* keys_t,
                                         float* values) {
  const int64_t value_offset = page_size * row_stride;
  for (int64_t j = 0; j < count;) {  // page by page: one division per page, not per key
    const int64_t position = first + j;
    const int64_t slot = position % page_size;
    const int64_t in_page = std::min(page_size - slot, count - j);
    const scalar_t* key = head + user_pages[position / page_size] * page_stride + slot * row_stride;
    for (int64_t s = 0; s < in_page; ++s, ++j, key += row_stride) {
      for (int64_t d = 0; d < head_dim; ++d) {
        keys_t[d * stride + j] = static_cast<float>(key[d]);
        values[j * head_dim + d] = static_cast<float>(key[value_offset + d]);
      }
    }
  }
}

struct Tile {
  int64_t first_row, num_rows;
};

std::vector<Tile> user_tiles(const int64_t* users, int64_t num_rows, int64_t tile_rows) {
  std::vector<Tile> tiles;
  for (int64_t r = 0; r < num_rows; ++r) {
    if (tiles.empty() || users[r] != users[tiles.back().first_row] || tiles.back().num_rows == tile_rows) {
      tiles.push_back({r, 0});
    }
    ++tiles.back().num_rows;
  }
  return tiles;
}

// Per-thread scratch, kept between calls (one block's keys and values, one tile's rows).
struct Scratch {
  std::vector<float> keys_t, values, scores, q, acc;
  std::vector<int64_t> limits;
};

Scratch& scratch(int64_t block_keys, int64_t head_dim) {
  thread_local Scratch s;
  const auto fit = [](auto& v, int64_t n) {
    if (static_cast<int64_t>(v.size()) < n) v.resize(n);
  };
  fit(s.keys_t, block_keys * head_dim);
  fit(s.values, block_keys * head_dim);
  fit(s.scores, kAloneTileRows * block_keys);
  fit(s.q, kAloneTileRows * head_dim);
  fit(s.acc, kAloneTileRows * head_dim);
  fit(s.limits, kAloneTileRows);
  return s;
}

// The OpenMP thread count the calling thread had before begin_request_threads; 0 outside a request.
thread_local int request_threads = 0;

// Requests with fewer new rows than this (a returning user's few new events and candidates) run
// the package's other kernels on the calling thread. Each of them is tiny at this size, and on a
// busy host every OpenMP region of a two-thread team waits for both threads to be scheduled: a
// time slice per region, dozens of regions per request.
constexpr int64_t kSerialRows = 1024;

// The attention kernel's thread budget: the request's original one, not the serial one above.
int kernel_threads() { return request_threads > 0 ? request_threads : at::get_num_threads(); }

// Below this many (row, key, head) triples a call runs on the calling thread: waking helpers
// costs more than it saves, and on a busy host each parallel region can cost a time slice. At
// 2^16, hstu-bench's cached request at L = 256 (99k triples a layer) went parallel: 1.0 ms idle,
// 8-16 ms with two busy processes on the 2 CPUs; at 2^18 it runs alone: 1.1 ms idle and 1.1 ms
// busy. (2^20 also took L = 1024 alone: +0.7 ms idle, no gain busy.)
constexpr int64_t kInlineWork = 1 << 18;

// Whether a call of `work` (row, key, head) triples runs on the calling thread alone.
bool runs_alone(int64_t work) { return kernel_threads() <= 1 || work < kInlineWork || at::in_parallel_region(); }

// Runs body(i) for i in [0, total) on the calling thread plus up to kernel_threads() - 1 OpenMP
// threads, or on the calling thread alone when `alone` (runs_alone's answer for the call). Items
// are claimed from the end, where a user's costliest tiles are (runtime::for_each_item).
template <typename F>
void for_each_item(int64_t total, bool alone, const F& body) {
  runtime::for_each_item(total, alone ? 1 : kernel_threads(), body);
}

// One call of the kernel: (tile, head) pairs as items, each over all the keys its rows read.
template <typename scalar_t>
class Attention {
 public:
  Attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cache,
            const at::Tensor& page_table, const at::Tensor& row_user, const at::Tensor& row_keys,
            const at::Tensor& row_candidate, float alpha, float inv_scaling_seqlen, at::Tensor& out)
      : num_heads_(q.size(1)), head_dim_(q.size(2)), page_size_(cache.size(2)), row_stride_(num_heads_ * head_dim_),
        page_stride_(2 * page_size_ * row_stride_), max_pages_(page_table.size(1)),
        block_keys_(std::max<int64_t>(16, kBlockFloats / head_dim_)), alpha_(alpha), inv_scaling_(inv_scaling_seqlen),
        q_(q.data_ptr<scalar_t>()), k_(k.data_ptr<scalar_t>()), v_(v.data_ptr<scalar_t>()),
        cache_(cache.data_ptr<scalar_t>()), pages_(page_table.data_ptr<int64_t>()),
        users_(row_user.data_ptr<int64_t>()), keys_(row_keys.data_ptr<int64_t>()),
        candidate_(row_candidate.data_ptr<bool>()), out_(out.data_ptr<scalar_t>()),
        attend_block_(attend_block_for(head_dim_)), alone_(runs_alone(total_work(q.size(0)))),
        tiles_(user_tiles(users_, q.size(0), alone_ ? kAloneTileRows : kTileRows)) {}

  void run() const {
    for_each_item(static_cast<int64_t>(tiles_.size()) * num_heads_, alone_, [&](int64_t pair) { attend(pair); });
  }

 private:
  int64_t total_work(int64_t num_rows) const {
    int64_t work = 0;
    for (int64_t r = 0; r < num_rows; ++r) work += (keys_[r] + 1) * num_heads_;
    return work;
  }

  void attend(int64_t pair) const {
    const Tile& tile = tiles_[pair / num_heads_];
    const int64_t h = pair % num_heads_;
    Scratch& s = scratch(block_keys_, head_dim_);
    const int64_t n = load_q(tile, h, s.q.data());
    std::fill(s.acc.begin(), s.acc.begin() + tile.num_rows * head_dim_, 0.0f);
    accumulate(tile, h, n, s);
    finish(tile, h, s.q.data(), s.acc.data());
  }

  // The tile's rows of head h as float into q (tile rows x head_dim); returns the most keys a row reads.
  int64_t load_q(const Tile& tile, int64_t h, float* q) const {
    int64_t n = 0;
    for (int64_t t = 0; t < tile.num_rows; ++t) {
      const scalar_t* row = q_ + (tile.first_row + t) * row_stride_ + h * head_dim_;
      for (int64_t d = 0; d < head_dim_; ++d) q[t * head_dim_ + d] = static_cast<float>(row[d]);
      n = std::max(n, keys_[tile.first_row + t]);
    }
    return n;
  }

  // s.acc (tile rows x head_dim) += the tile's attention over the first n keys of head h, block by block.
  void accumulate(const Tile& tile, int64_t h, int64_t n, Scratch& s) const {
    const int64_t* user_pages = pages_ + users_[tile.first_row] * max_pages_;
    for (int64_t first = 0; first < n; first += block_keys_) {
      const int64_t count = std::min(block_keys_, n - first);
      gather_block(cache_ + h * head_dim_, user_pages, first, count, page_size_, page_stride_, row_stride_, head_dim_,
                   block_keys_, s.keys_t.data(), s.values.data());
      for (int64_t t = 0; t < tile.num_rows; ++t) {
        s.limits[t] = std::clamp<int64_t>(keys_[tile.first_row + t] - first, 0, count);
      }
      attend_block_(s.q.data(), s.acc.data(), s.limits.data(), tile.num_rows, s.keys_t.data(), block_keys_,
                    s.values.data(), head_dim_, alpha_, inv_scaling_, s.scores.data());
    }
  }

  // Adds each candidate row's attention to its own k/v, then writes the tile's rows of head h.
  void finish(const Tile& tile, int64_t h, const float* q, float* acc) const {
    for (int64_t t = 0; t < tile.num_rows; ++t) {
      const int64_t r = tile.first_row + t, head = r * row_stride_ + h * head_dim_;
      float* acc_row = acc + t * head_dim_;
      if (candidate_[r]) {  // a candidate also reads its own k/v, which is not in the cache
        const float* q_row = q + t * head_dim_;
        float self = 0.0f;
        for (int64_t d = 0; d < head_dim_; ++d) self += q_row[d] * static_cast<float>(k_[head + d]);
        silu_weights(&self, 1, alpha_, inv_scaling_);
        for (int64_t d = 0; d < head_dim_; ++d) acc_row[d] += self * static_cast<float>(v_[head + d]);
      }
      for (int64_t d = 0; d < head_dim_; ++d) out_[head + d] = static_cast<scalar_t>(acc_row[d]);
    }
  }

  const int64_t num_heads_, head_dim_, page_size_, row_stride_, page_stride_, max_pages_, block_keys_;
  const float alpha_, inv_scaling_;
  const scalar_t *q_, *k_, *v_, *cache_;
  const int64_t *pages_, *users_, *keys_;
  const bool* candidate_;
  scalar_t* out_;
  const AttendBlock attend_block_;
  const bool alone_;  // the call runs on the calling thread (runs_alone), in kAloneTileRows tiles
  const std::vector<Tile> tiles_;
};

}  // namespace

void begin_request_threads(int64_t new_rows) {
  if (request_threads == 0) request_threads = at::get_num_threads();  // kept if a request was never ended
  omp_set_num_threads(new_rows < kSerialRows ? 1 : request_threads);
}

void end_request_threads() {
  if (request_threads == 0) return;
  omp_set_num_threads(request_threads);
  request_threads = 0;
}

int64_t check_row_metadata(const at::Tensor& page_table, const at::Tensor& row_user, const at::Tensor& row_keys,
                           int64_t num_pages, int64_t page_size) {
  const int64_t* pages = page_table.data_ptr<int64_t>();
  for (int64_t i = 0; i < page_table.numel(); ++i) {
    TORCH_CHECK(pages[i] >= 0 && pages[i] < num_pages, "paged_attention: page ", pages[i], " outside 0..",
                num_pages - 1);
  }
  const int64_t capacity = page_table.size(1) * page_size;
  int64_t max_keys = 0;
  for (int64_t r = 0; r < row_user.numel(); ++r) {
    const int64_t user = row_user.data_ptr<int64_t>()[r], num_keys = row_keys.data_ptr<int64_t>()[r];
    TORCH_CHECK(user >= 0 && user < page_table.size(0), "paged_attention: row ", r, " user ", user, " outside 0..",
                page_table.size(0) - 1);
    TORCH_CHECK(num_keys >= 0 && num_keys <= capacity, "paged_attention: row ", r, " reads ", num_keys,
                " keys, the page table holds ", capacity);
    max_keys = std::max(max_keys, num_keys);
  }
  return max_keys;
}

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
  check_row_metadata(pt, users, keys, cache.size(0), cache.size(2));
  auto out = at::empty_like(qc);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention_cpu", [&] {
    Attention<scalar_t>(qc, kc, vc, cc, pt, users, keys, candidate, static_cast<float>(alpha),
                        static_cast<float>(inv_scaling_seqlen), out)
        .run();
  });
  return out;
}

}  // namespace kvexport::ops

namespace {
constexpr auto kIsaDescription = kvexport::ops::isa::describe();
}  // namespace

// What this library was compiled for (compiled_isa.h); also found in the .so file by its marker.
extern "C" __attribute__((visibility("default"))) const char* kvexport_ops_isa() { return kIsaDescription.data(); }
