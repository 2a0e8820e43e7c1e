#include "ops/paged_attention.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <dirent.h>
#include <fcntl.h>
#if defined(__F16C__)
#include <immintrin.h>
#endif
#include <omp.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <type_traits>
#include <vector>

#include "ops/compiled_isa.h"
#include "runtime/fp8_pages.h"
#include "runtime/parallel.h"

namespace kvexport::ops {

namespace {

// The loops below are written for `#pragma omp simd` (-fopenmp-simd) or on GCC vectors: the
// reductions vectorise without -ffast-math. expf does not vectorise without -ffast-math (glibc
// declares its vector variants only then), so SiLU uses exp2 by range reduction and a degree-7
// polynomial: relative error below 1e-7 on the whole float range, far inside the package
// tolerances. exp_approx takes a float or a vector of floats (the same operations lane by lane).
template <typename V>
struct IntLanes {
  using type = decltype(V{} < V{});  // a vector's comparisons give lanes of int32
};
template <>
struct IntLanes<float> {
  using type = int32_t;
};

template <typename V>
inline __attribute__((always_inline)) V exp_approx(V x) {
  using Int = typename IntLanes<V>::type;
  const V zero = {};
  V clamped = x < -87.0f ? zero - 87.0f : x;
  clamped = clamped > 88.0f ? zero + 88.0f : clamped;
  const V t = clamped * 1.44269504088896341f;  // x * log2(e)
  constexpr float kRound = 12582912.0f;        // 1.5 * 2^23: adding it rounds to an integer
  const V n = (t + kRound) - kRound;
  const V f = (t - n) * 0.693147180559945309f;  // e^f with f in [-ln2/2, ln2/2]
  V p = zero + 1.0f / 5040.0f;
  p = p * f + 1.0f / 720.0f;
  p = p * f + 1.0f / 120.0f;
  p = p * f + 1.0f / 24.0f;
  p = p * f + 1.0f / 6.0f;
  p = p * f + 0.5f;
  p = p * f + 1.0f;
  p = p * f + 1.0f;
  Int whole;
  if constexpr (std::is_same_v<V, float>) {
    whole = static_cast<int32_t>(n);
  } else {
    whole = __builtin_convertvector(n, Int);
  }
  const Int exponent = (whole + 127) << 23;  // 2^n as a float's bits
  V scale;
  std::memcpy(&scale, &exponent, sizeof(V));
  return p * scale;
}

// SiLU(alpha * x) * inv_scaling_seqlen, of a float or lane by lane.
template <typename V>
inline __attribute__((always_inline)) V silu_weight(V x, float alpha, float inv_scaling_seqlen) {
  const V scaled = alpha * x;
  return scaled / (1.0f + exp_approx(-scaled)) * inv_scaling_seqlen;
}

// scores[j] <- SiLU(alpha * scores[j]) * inv_scaling_seqlen. The kernels for fixed head sizes
// apply silu_weight to vectors instead: without AVX-512 masks the vectoriser leaves this loop's
// clamps as branches, one per score.
inline void silu_weights(float* scores, int64_t n, float alpha, float inv_scaling_seqlen) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) scores[j] = silu_weight(scores[j], alpha, inv_scaling_seqlen);
}

// Rows of one user are processed in tiles of up to kTileRows rows, and the user's keys in blocks
// of kBlockFloats / head_dim keys. A block is read from the cache once per tile and stays in L1/L2
// while every row of the tile uses it: no buffer of the whole history (megabytes allocated and
// zeroed per call) and no pass of each row over megabytes of L3. A float32 cache is read where it
// lies (a block is a list of key and value rows); another dtype's block is converted to float rows
// first. A call that runs on the calling thread alone (for_each_item) takes tiles of
// kAloneTileRows: no balance to keep, and each block is then read once per 64 rows rather than 16,
// a quarter of the block reads.
constexpr int64_t kTileRows = 16;
constexpr int64_t kAloneTileRows = 64;
constexpr int64_t kBlockFloats = 8192;  // 32 KiB of keys and 32 KiB of values per block
// A vector of kLanes floats (GCC's vector extension), the rows of a tile a register holds: 16 where
// the kernel runs with AVX-512 (wide_vectors), else 8. (16-float vectors on AVX2 take two registers
// each, more than its 16 registers hold for a tile: the tile would spill to memory.)
template <int64_t kLanes>
struct Lanes;
template <>
struct Lanes<8> {
  using type = float __attribute__((vector_size(8 * sizeof(float))));
};
template <>
struct Lanes<16> {
  using type = float __attribute__((vector_size(16 * sizeof(float))));
};
// Keys a step of the dot products: each key's value broadcast into its own sum.
constexpr int64_t kKeyGroup = 8;

// The keys of one block: key j's head_dim floats at keys[j], its value's at values[j]. The lists
// run kKeyGroup - 1 entries past the block's keys, repeating its last key (read, never used).
struct Block {
  const float* const* keys;
  const float* const* values;
};

// One block for one tile, float only (the part worth compiling per ISA). q holds the tile's rows
// (rows x head_dim) and q_t the same transposed (head_dim x kAloneTileRows, zero past `rows`); row t
// reads the first limits[t] keys of the block (causal rows stop early). acc, transposed like q_t:
// acc[d * kAloneTileRows + t] += sum_j SiLU(alpha q_t . k_j) * inv * v_j[d]. scores holds the
// block's weights by key, then row: scores[j * kAloneTileRows + t].
//
// kHeadDim > 0 (32, 64 or 128) fixes the head size at compile time. Both products are register
// tiles vectorised over kLanes rows of the tile: the dot products over kKeyGroup keys at a time
// (one load of q_t's column feeds kKeyGroup multiply-adds, each with a key's entry broadcast from
// the row it lies in), the weighted sums over 8 entries of the values at a time (one load of a
// key's weights for 8 multiply-adds). So neither the keys nor the cache are transposed, and keys a
// row does not read are given weight 0 rather than skipped. Any other size (0) takes a
// row-at-a-time loop.
template <int64_t kHeadDim, int64_t kLanes>
inline __attribute__((always_inline)) void attend_block_impl(const float* q, const float* q_t, float* acc,
                                                             const int64_t* limits, int64_t rows, Block block,
                                                             int64_t runtime_head_dim, float alpha,
                                                             float inv_scaling_seqlen, float* scores) {
  const int64_t most = *std::max_element(limits, limits + rows);
  if (most <= 0) return;
  if constexpr (kHeadDim > 0) {
    using Vector = typename Lanes<kLanes>::type;
    static_assert(sizeof(Vector) == kLanes * sizeof(float));
    const int64_t vector_rows = (rows + kLanes - 1) / kLanes * kLanes;
    for (int64_t t0 = 0; t0 < vector_rows; t0 += kLanes) {
      for (int64_t j0 = 0; j0 < most; j0 += kKeyGroup) {
        Vector dots[kKeyGroup] = {};
        for (int64_t d = 0; d < kHeadDim; ++d) {
          Vector column;
          std::memcpy(&column, q_t + d * kAloneTileRows + t0, sizeof(Vector));
#pragma GCC unroll 8
          for (int64_t i = 0; i < kKeyGroup; ++i) dots[i] += column * block.keys[j0 + i][d];
        }
#pragma GCC unroll 8
        for (int64_t i = 0; i < kKeyGroup; ++i) {
          std::memcpy(scores + (j0 + i) * kAloneTileRows + t0, &dots[i], sizeof(Vector));
        }
      }
    }
    for (int64_t j = 0; j < most; ++j) {
      for (int64_t t0 = 0; t0 < vector_rows; t0 += kLanes) {
        Vector x;
        std::memcpy(&x, scores + j * kAloneTileRows + t0, sizeof(Vector));
        x = silu_weight(x, alpha, inv_scaling_seqlen);
        std::memcpy(scores + j * kAloneTileRows + t0, &x, sizeof(Vector));
      }
    }
    // Keys a row does not read weigh nothing (rows past `rows` already do: their q is zero), so
    // that the weighted sums run over whole vectors of rows too.
    for (int64_t t = 0; t < rows; ++t) {
      for (int64_t j = std::max<int64_t>(limits[t], 0); j < most; ++j) scores[j * kAloneTileRows + t] = 0.0f;
    }
    // acc's columns += the weights' columns times each value's entries: kDims entries of the
    // values a step, each broadcast into its own sum of kLanes rows.
    constexpr int64_t kDims = 8;
    static_assert(kHeadDim % kDims == 0, "a fixed head size is a whole number of steps");
    for (int64_t t0 = 0; t0 < vector_rows; t0 += kLanes) {
      for (int64_t d0 = 0; d0 < kHeadDim; d0 += kDims) {
        Vector sums[kDims];
#pragma GCC unroll 8
        for (int64_t i = 0; i < kDims; ++i) std::memcpy(&sums[i], acc + (d0 + i) * kAloneTileRows + t0, sizeof(Vector));
        for (int64_t j = 0; j < most; ++j) {
          Vector weights;
          std::memcpy(&weights, scores + j * kAloneTileRows + t0, sizeof(Vector));
          const float* value = block.values[j] + d0;
#pragma GCC unroll 8
          for (int64_t i = 0; i < kDims; ++i) sums[i] += weights * value[i];
        }
#pragma GCC unroll 8
        for (int64_t i = 0; i < kDims; ++i) std::memcpy(acc + (d0 + i) * kAloneTileRows + t0, &sums[i], sizeof(Vector));
      }
    }
    return;
  }
  const int64_t head_dim = runtime_head_dim;
  for (int64_t t = 0; t < rows; ++t) {
    const int64_t count = limits[t];
    const float* q_row = q + t * head_dim;
    for (int64_t j = 0; j < count; ++j) {
      const float* key = block.keys[j];
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < head_dim; ++d) dot += q_row[d] * key[d];
      scores[j] = dot;
    }
    silu_weights(scores, count, alpha, inv_scaling_seqlen);
    for (int64_t j = 0; j < count; ++j) {
      const float w = scores[j];
      const float* value = block.values[j];
      for (int64_t d = 0; d < head_dim; ++d) acc[d * kAloneTileRows + t] += w * value[d];
    }
  }
}

using AttendBlock = void (*)(const float*, const float*, float*, const int64_t*, int64_t, Block, int64_t, float, float,
                             float*);

#define KVEXPORT_ATTEND_BLOCK(name, head_dim, lanes)                                                                  \
  KVEXPORT_KERNEL_CLONES void name(const float* q, const float* q_t, float* acc, const int64_t* limits, int64_t rows, \
                                   Block block, int64_t dh, float alpha, float inv_scaling_seqlen, float* scores) {   \
    attend_block_impl<head_dim, lanes>(q, q_t, acc, limits, rows, block, dh, alpha, inv_scaling_seqlen, scores);      \
  }
KVEXPORT_ATTEND_BLOCK(attend_block_32, 32, 8)
KVEXPORT_ATTEND_BLOCK(attend_block_64, 64, 8)
KVEXPORT_ATTEND_BLOCK(attend_block_128, 128, 8)
KVEXPORT_ATTEND_BLOCK(attend_block_32_wide, 32, 16)
KVEXPORT_ATTEND_BLOCK(attend_block_64_wide, 64, 16)
KVEXPORT_ATTEND_BLOCK(attend_block_128_wide, 128, 16)
KVEXPORT_ATTEND_BLOCK(attend_block_any, 0, 8)
#undef KVEXPORT_ATTEND_BLOCK

// Whether 16-float vectors are one register where the kernel runs: the library is compiled for
// AVX-512, or its kernels are multiversioned and this CPU takes the x86-64-v4 clone.
bool wide_vectors() {
#if defined(__AVX512F__)
  return true;
#elif KVEXPORT_KERNEL_MULTIVERSIONED
  static const bool wide = __builtin_cpu_supports("x86-64-v4");
  return wide;
#else
  return false;
#endif
}

AttendBlock attend_block_for(int64_t head_dim) {
  const bool wide = wide_vectors();
  switch (head_dim) {
    case 32:
      return wide ? attend_block_32_wide : attend_block_32;
    case 64:
      return wide ? attend_block_64_wide : attend_block_64;
    case 128:
      return wide ? attend_block_128_wide : attend_block_128;
    default:
      return attend_block_any;
  }
}

// Asks for the cache lines of bytes [row, row + bytes) ahead of their use. A user's next page lies
// anywhere in the cache (pages are taken as they come free), where no hardware prefetcher, which
// follows strides, looks: a gather asks for the next page's rows while it reads the current one's,
// a page of rows ahead. Without it a gather waits on each row's first load.
inline __attribute__((always_inline)) void prefetch_bytes(const void* row, int64_t bytes) {
  constexpr uintptr_t kLine = 64;
  const uintptr_t begin = reinterpret_cast<uintptr_t>(row), end = begin + bytes;
  for (uintptr_t line = begin & ~(kLine - 1); line < end; line += kLine) {
    __builtin_prefetch(reinterpret_cast<const void*>(line));
  }
}

// The rows of keys first..first+count-1 of one user and head into keys[j] and values[j], then
// kKeyGroup - 1 more entries repeating the last key; the tile reads num_keys keys in all (the next
// page is prefetched if it holds any of them). `head` points at the head's slice of page 0, slot 0;
// v follows k within a page. A float cache is read in place; any other dtype is converted into
// `converted` (2 * count rows of head_dim floats). Multiversioned like attend_block: the
// conversions vectorise.
template <typename scalar_t>
KVEXPORT_KERNEL_CLONES void gather_block(const scalar_t* head, const int64_t* user_pages, int64_t first, int64_t count,
                                         int64_t num_keys, int64_t page_size, int64_t page_stride, int64_t row_stride,
                                         int64_t head_dim, const float** keys, const float** values, float* converted) {
  const int64_t value_offset = page_size * row_stride, row_bytes = head_dim * sizeof(scalar_t);
  for (int64_t j = 0; j < count;) {  // page by page: one division per page, not per key
    const int64_t position = first + j;
    const int64_t slot = position % page_size;
    const int64_t in_page = std::min(page_size - slot, count - j);
    const scalar_t* key = head + user_pages[position / page_size] * page_stride + slot * row_stride;
    const int64_t next_page = position / page_size + 1;
    const scalar_t* next =
        next_page * page_size < num_keys ? head + user_pages[next_page] * page_stride + slot * row_stride : nullptr;
    for (int64_t s = 0; s < in_page; ++s, ++j, key += row_stride) {
      if (next != nullptr) {
        prefetch_bytes(next + s * row_stride, row_bytes);
        prefetch_bytes(next + s * row_stride + value_offset, row_bytes);
      }
      if constexpr (std::is_same_v<scalar_t, float>) {
        keys[j] = key;
        values[j] = key + value_offset;
      } else {
        float* k_row = converted + 2 * j * head_dim;
        float* v_row = k_row + head_dim;
        for (int64_t d = 0; d < head_dim; ++d) {
          k_row[d] = static_cast<float>(key[d]);
          v_row[d] = static_cast<float>(key[value_offset + d]);
        }
        keys[j] = k_row;
        values[j] = v_row;
      }
    }
  }
  for (int64_t i = 1; i < kKeyGroup; ++i) {
    keys[count - 1 + i] = keys[count - 1];
    values[count - 1 + i] = values[count - 1];
  }
}

// n e4m3 bytes as floats times their row's power-of-two scale (the byte `scale_byte`), each value
// exactly as runtime/fp8_pages.h decodes it: its table's float times the scale, in one rounding
// (NaN bytes, which the cache never stores, decode as 480 times the scale).
// With F16C (x86-64-v3 and up), sixteen at a time: a byte's magnitude fields moved up 7 bits are a
// half's exponent and top mantissa bits (sign-extending the byte to 16 bits and clearing bit 14
// leaves its sign in the half's), a half whose value is the byte's times 2^-8, subnormals
// included; the hardware converts it to float exactly, and one multiply by 2^8 * scale, a power of
// two, rounds as the table's float times the scale does. That factor is a float for every scale
// up to 2^119, so for every row whose values stay below 448 * 2^119 (about 3e38). Other rows, a
// row's last n % 16, and builds without F16C take the loop below, in integer arithmetic the
// vectoriser takes: a normal byte's fields moved into a float's with the exponent bias raised
// from 7 to 127, a subnormal's mantissa times 2^-9, picked by mask (a conditional keeps the loop
// scalar: a mispredicted branch per value).
inline __attribute__((always_inline)) void decode_e4m3(const uint8_t* bytes, int64_t n, uint8_t scale_byte,
                                                       float* out) {
  const float scale = runtime::fp8::scale_of(scale_byte);
  int64_t d = 0;
#if defined(__F16C__)
  const float half_scale = scale * 256.0f;
  if (std::isfinite(half_scale)) {
    const __m256 factor = _mm256_set1_ps(half_scale);
    const __m256i half_fields = _mm256_set1_epi16(static_cast<int16_t>(0xBF80));
    for (; d + 16 <= n; d += 16) {
      const __m128i chunk = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + d));
      const __m256i halves = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(chunk), 7), half_fields);
      _mm256_storeu_ps(out + d, _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(halves)), factor));
      _mm256_storeu_ps(out + d + 8, _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(halves, 1)), factor));
    }
  }
#endif
#pragma omp simd
  for (int64_t i = d; i < n; ++i) {
    const uint32_t byte = bytes[i], magnitude = byte & 0x7Fu;
    const uint32_t normal = (magnitude << 20) + (120u << 23);
    const uint32_t subnormal =
        std::bit_cast<uint32_t>(static_cast<float>(static_cast<int32_t>(magnitude)) * 0.001953125f);
    const uint32_t is_normal = 0u - static_cast<uint32_t>(magnitude >= 8);
    const uint32_t bits = (normal & is_normal) | (subnormal & ~is_normal) | (byte & 0x80u) << 24;
    out[i] = std::bit_cast<float>(bits) * scale;
  }
}

// gather_block for FP8 pages (runtime/fp8_pages.h): the keys' and values' e4m3 bytes of head h,
// decoded with their row's power-of-two scale into `converted`, as a bfloat16 block is converted.
// `cache` is one layer's pages [pages, page_bytes].
KVEXPORT_KERNEL_CLONES void gather_fp8_block(const uint8_t* cache, const runtime::fp8::PageLayout& layout, int64_t h,
                                             const int64_t* user_pages, int64_t first, int64_t count, int64_t num_keys,
                                             const float** keys, const float** values, float* converted) {
  const int64_t page_size = layout.page_size, head_dim = layout.head_dim, row_bytes = layout.row_bytes();
  const int64_t value_rows = page_size * row_bytes, value_scales = page_size * layout.num_heads;
  for (int64_t j = 0; j < count;) {  // page by page: one division per page, not per key
    const int64_t position = first + j;
    const int64_t slot = position % page_size;
    const int64_t in_page = std::min(page_size - slot, count - j);
    const uint8_t* page = cache + user_pages[position / page_size] * layout.page_bytes();
    const uint8_t* key = page + slot * row_bytes + h * head_dim;
    const uint8_t* scale = page + layout.data_bytes() + slot * layout.num_heads + h;
    const int64_t next_page = position / page_size + 1;
    const uint8_t* next = nullptr;
    if (next_page * page_size < num_keys) {
      next = cache + user_pages[next_page] * layout.page_bytes();
      prefetch_bytes(next + layout.data_bytes(), layout.rows_per_page() * layout.num_heads);  // its scales
      next += slot * row_bytes + h * head_dim;
    }
    for (int64_t s = 0; s < in_page; ++s, ++j, key += row_bytes, scale += layout.num_heads) {
      if (next != nullptr) {
        prefetch_bytes(next + s * row_bytes, head_dim);
        prefetch_bytes(next + s * row_bytes + value_rows, head_dim);
      }
      float* k_row = converted + 2 * j * head_dim;
      float* v_row = k_row + head_dim;
      decode_e4m3(key, head_dim, scale[0], k_row);
      decode_e4m3(key + value_rows, head_dim, scale[value_scales], v_row);
      keys[j] = k_row;
      values[j] = v_row;
    }
  }
  for (int64_t i = 1; i < kKeyGroup; ++i) {
    keys[count - 1 + i] = keys[count - 1];
    values[count - 1 + i] = values[count - 1];
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

// Per-thread scratch, kept between calls (one block's key lists and converted rows, one tile's rows).
struct Scratch {
  std::vector<const float*> keys, values;
  std::vector<float> converted, scores, q, q_t, acc;
  std::vector<int64_t> limits;
};

Scratch& scratch(int64_t block_keys, int64_t head_dim) {
  thread_local Scratch s;
  const auto fit = [](auto& v, int64_t n) {
    if (static_cast<int64_t>(v.size()) < n) v.resize(n);
  };
  fit(s.keys, block_keys + kKeyGroup);
  fit(s.values, block_keys + kKeyGroup);
  fit(s.converted, 2 * block_keys * head_dim);
  fit(s.scores, kAloneTileRows * (block_keys + kKeyGroup));
  fit(s.q, kAloneTileRows * head_dim);
  fit(s.q_t, kAloneTileRows * head_dim);
  fit(s.acc, kAloneTileRows * head_dim);
  fit(s.limits, kAloneTileRows);
  return s;
}

// The OpenMP thread count the calling thread had before begin_request_threads; 0 outside a request.
thread_local int request_threads = 0;
// Of those, the threads the request uses: fewer when other work keeps the CPUs busy (free_cpus).
thread_local int request_budget = 0;

// Requests with fewer new rows than this (a returning user's few new events and candidates) run
// the package's other kernels on the calling thread. Each of them is tiny at this size, and on a
// busy host every OpenMP region of a two-thread team waits for both threads to be scheduled: a
// time slice per region, dozens of regions per request.
constexpr int64_t kSerialRows = 1024;

// The attention kernel's thread budget: the request's, not the serial one above.
int kernel_threads() {
  return request_threads > 0 ? request_budget : at::get_num_threads();
}

// This process's threads that are running or ready to run now (state R in
// /proc/self/task/TID/stat): the calling thread, helpers still spinning after a region, and any
// other thread of the host's; -1 when the directory cannot be read.
long own_runnable_threads() {
  DIR* tasks = opendir("/proc/self/task");
  if (tasks == nullptr) return -1;
  long runnable = 0;
  char path[64], stat[256];
  while (const dirent* task = readdir(tasks)) {
    if (task->d_name[0] == '.') continue;
    std::snprintf(path, sizeof path, "/proc/self/task/%s/stat", task->d_name);
    const int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;  // ended meanwhile
    const ssize_t length = read(fd, stat, sizeof stat - 1);
    close(fd);
    if (length <= 0) continue;
    stat[length] = '\0';
    // "TID (NAME) STATE ...": NAME may hold ")" itself, the last one ends it.
    const char* name_end = std::strrchr(stat, ')');
    if (name_end != nullptr && name_end[1] == ' ' && name_end[2] == 'R') ++runnable;
  }
  closedir(tasks);
  return runnable;
}

// How many of a team of `threads` the host's CPUs can run now: `threads` on an idle host, 1 when
// every CPU of this process's affinity is taken. On a host with a busy process per CPU, a team of
// two is a scheduler round trip per OpenMP region; one thread is not slowed more than its fair
// share (benchmarks/RESULTS.md, contention). Linux's count of the tasks running or ready to run at
// this instant (/proc/loadavg's fourth field) includes this thread, and may include helpers still
// spinning after an earlier region: neither counts as other work. While that count fits in this
// process's CPUs nothing is taken; past it, this process's own runnable threads are counted
// (own_runnable_threads, a file per thread, read only then) and the rest is other work, taken as
// spread evenly over the online CPUs: its share of ours is what is taken.
int free_cpus(int threads) {
  FILE* file = std::fopen("/proc/loadavg", "r");
  if (file == nullptr) return threads;
  double one, five, fifteen;
  long running = 0, tasks = 0;
  const int read = std::fscanf(file, "%lf %lf %lf %ld/%ld", &one, &five, &fifteen, &running, &tasks);
  std::fclose(file);
  cpu_set_t allowed;
  static const long online = sysconf(_SC_NPROCESSORS_ONLN);
  if (read != 5 || online <= 0 || sched_getaffinity(0, sizeof allowed, &allowed) != 0) return threads;
  const long ours = CPU_COUNT(&allowed);
  if (running <= ours) return static_cast<int>(std::min<long>(ours, threads));
  const long own = own_runnable_threads();
  const long others = std::max(0L, running - (own > 0 ? own : threads)) * ours / online;
  return static_cast<int>(std::clamp<long>(ours - others, 1, threads));
}

// Below this many (row, key, head) triples a call runs on the calling thread: waking helpers
// costs more than it saves, and on a busy host each parallel region can wait a time slice for its
// helpers. 2^18 keeps a cached request of a few hundred history tokens on the calling thread
// (hstu-bench's at L = 256: 99k triples a layer), where such waits would cost more than the split
// gains; a history of a thousand tokens has work enough to share.
constexpr int64_t kInlineWork = 1 << 18;

// Whether a call of `work` (row, key, head) triples runs on the calling thread alone.
bool runs_alone(int64_t work) {
  return kernel_threads() <= 1 || work < kInlineWork || at::in_parallel_region();
}

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
      : num_heads_(q.size(1)),
        head_dim_(q.size(2)),
        fp8_(cache.scalar_type() == at::kByte ? runtime::fp8::PageLayout::of_pages(cache.size(1), num_heads_, head_dim_)
                                              : runtime::fp8::PageLayout{}),
        page_size_(fp8_.page_size > 0 ? fp8_.page_size : cache.size(2)),
        row_stride_(num_heads_ * head_dim_),
        page_stride_(2 * page_size_ * row_stride_),
        max_pages_(page_table.size(1)),
        block_keys_(std::max<int64_t>(16, kBlockFloats / head_dim_)),
        alpha_(alpha),
        inv_scaling_(inv_scaling_seqlen),
        q_stride_(q.stride(0)),
        k_stride_(k.stride(0)),
        v_stride_(v.stride(0)),
        q_(q.data_ptr<scalar_t>()),
        k_(k.data_ptr<scalar_t>()),
        v_(v.data_ptr<scalar_t>()),
        cache_(fp8_.page_size > 0 ? nullptr : cache.data_ptr<scalar_t>()),
        fp8_cache_(fp8_.page_size > 0 ? cache.data_ptr<uint8_t>() : nullptr),
        pages_(page_table.data_ptr<int64_t>()),
        users_(row_user.data_ptr<int64_t>()),
        keys_(row_keys.data_ptr<int64_t>()),
        candidate_(row_candidate.data_ptr<bool>()),
        out_(out.data_ptr<scalar_t>()),
        attend_block_(attend_block_for(head_dim_)),
        alone_(runs_alone(total_work(q.size(0)))),
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
    const int64_t n = load_q(tile, h, s.q.data(), s.q_t.data());
    std::fill(s.acc.begin(), s.acc.begin() + head_dim_ * kAloneTileRows, 0.0f);
    accumulate(tile, h, n, s);
    finish(tile, h, s.q.data(), s.acc.data());
  }

  // The tile's rows of head h as float into q (tile rows x head_dim) and transposed into q_t
  // (head_dim x kAloneTileRows, zero past the tile's rows); returns the most keys a row reads.
  int64_t load_q(const Tile& tile, int64_t h, float* q, float* q_t) const {
    int64_t n = 0;
    std::fill(q_t, q_t + head_dim_ * kAloneTileRows, 0.0f);
    for (int64_t t = 0; t < tile.num_rows; ++t) {
      const scalar_t* row = q_ + (tile.first_row + t) * q_stride_ + h * head_dim_;
      for (int64_t d = 0; d < head_dim_; ++d) {
        q[t * head_dim_ + d] = static_cast<float>(row[d]);
        q_t[d * kAloneTileRows + t] = q[t * head_dim_ + d];
      }
      n = std::max(n, keys_[tile.first_row + t]);
    }
    return n;
  }

  // s.acc (head_dim x kAloneTileRows, transposed) += the tile's attention over the first n keys of head h, block by
  // block.
  void accumulate(const Tile& tile, int64_t h, int64_t n, Scratch& s) const {
    const int64_t* user_pages = pages_ + users_[tile.first_row] * max_pages_;
    for (int64_t first = 0; first < n; first += block_keys_) {
      const int64_t count = std::min(block_keys_, n - first);
      if (fp8_cache_ != nullptr) {
        gather_fp8_block(fp8_cache_, fp8_, h, user_pages, first, count, n, s.keys.data(), s.values.data(),
                         s.converted.data());
      } else {
        gather_block(cache_ + h * head_dim_, user_pages, first, count, n, page_size_, page_stride_, row_stride_,
                     head_dim_, s.keys.data(), s.values.data(), s.converted.data());
      }
      for (int64_t t = 0; t < tile.num_rows; ++t) {
        s.limits[t] = std::clamp<int64_t>(keys_[tile.first_row + t] - first, 0, count);
      }
      attend_block_(s.q.data(), s.q_t.data(), s.acc.data(), s.limits.data(), tile.num_rows,
                    Block{s.keys.data(), s.values.data()}, head_dim_, alpha_, inv_scaling_, s.scores.data());
    }
  }

  // Adds each candidate row's attention to its own k/v, then writes the tile's rows of head h.
  void finish(const Tile& tile, int64_t h, const float* q, float* acc) const {
    for (int64_t t = 0; t < tile.num_rows; ++t) {
      const int64_t r = tile.first_row + t, head = h * head_dim_;
      if (candidate_[r]) {  // a candidate also reads its own k/v, which is not in the cache
        const float* q_row = q + t * head_dim_;
        const scalar_t *k_row = k_ + r * k_stride_ + head, *v_row = v_ + r * v_stride_ + head;
        float self = 0.0f;
        for (int64_t d = 0; d < head_dim_; ++d) self += q_row[d] * static_cast<float>(k_row[d]);
        silu_weights(&self, 1, alpha_, inv_scaling_);
        for (int64_t d = 0; d < head_dim_; ++d) acc[d * kAloneTileRows + t] += self * static_cast<float>(v_row[d]);
      }
      scalar_t* out_row = out_ + r * row_stride_ + head;
      for (int64_t d = 0; d < head_dim_; ++d) out_row[d] = static_cast<scalar_t>(acc[d * kAloneTileRows + t]);
    }
  }

  const int64_t num_heads_, head_dim_;
  const runtime::fp8::PageLayout fp8_;  // FP8 pages' layout; page_size 0 for a cache in scalar_t
  const int64_t page_size_, row_stride_, page_stride_, max_pages_, block_keys_;
  const float alpha_, inv_scaling_;
  const int64_t q_stride_, k_stride_, v_stride_;  // between rows of q, k, v (row_stride_ when contiguous)
  const scalar_t *q_, *k_, *v_, *cache_;
  const uint8_t* fp8_cache_;
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
  request_budget = request_threads > 1 ? free_cpus(request_threads) : request_threads;
  omp_set_num_threads(new_rows < kSerialRows ? 1 : request_budget);
}

bool end_request_threads() {
  if (request_threads == 0) return false;
  const bool fewer = request_budget < request_threads;
  omp_set_num_threads(request_threads);
  request_threads = 0;
  request_budget = 0;
  return fewer;
}

at::Tensor rows_in_place(const at::Tensor& t) {
  return t.dim() == 3 && t.stride(2) == 1 && t.stride(1) == t.size(2) ? t : t.contiguous();
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
  const bool fp8 = cache.scalar_type() == at::kByte;  // FP8 pages [pages, page_bytes] (runtime/fp8_pages.h)
  if (fp8) {
    const int64_t row_bytes = 2 * q.size(1) * (q.size(2) + 1);
    TORCH_CHECK(cache.dim() == 2 && cache.size(1) > 0 && cache.size(1) % row_bytes == 0, "paged_attention: FP8 pages ",
                cache.sizes(), " are not [pages, page_size * ", row_bytes, "] for q ", q.sizes());
  } else {
    TORCH_CHECK(cache.dim() == 5 && cache.size(1) == 2 && cache.size(3) == q.size(1) && cache.size(4) == q.size(2),
                "paged_attention: cache ", cache.sizes(), " does not fit q ", q.sizes());
    TORCH_CHECK(q.scalar_type() == cache.scalar_type(), "paged_attention: q dtype ", q.scalar_type(),
                " != cache dtype ", cache.scalar_type());
  }
  const int64_t page_size = fp8 ? cache.size(1) / (2 * q.size(1) * (q.size(2) + 1)) : cache.size(2);
  TORCH_CHECK(row_user.size(0) == q.size(0) && row_keys.size(0) == q.size(0) && row_candidate.size(0) == q.size(0),
              "paged_attention: row metadata has ", row_user.size(0), " rows, q has ", q.size(0));
  TORCH_CHECK(q.device().is_cpu(), "paged_attention: this kernel runs on CPU, got ", q.device());
  const auto qc = rows_in_place(q), kc = rows_in_place(k), vc = rows_in_place(v), cc = cache.contiguous();
  const auto pt = page_table.to(at::kLong).contiguous();
  const auto users = row_user.to(at::kLong).contiguous(), keys = row_keys.to(at::kLong).contiguous();
  const auto candidate = row_candidate.to(at::kBool).contiguous();
  TORCH_CHECK(pt.dim() == 2, "paged_attention: page_table must be [B, max_pages], got ", pt.sizes());
  TORCH_CHECK(cache.device() == q.device(), "paged_attention: cache on ", cache.device(), ", q on ", q.device());
  check_row_metadata(pt, users, keys, cache.size(0), page_size);
  auto out = at::empty(q.sizes(), q.options());
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
extern "C" __attribute__((visibility("default"))) const char* kvexport_ops_isa() {
  return kIsaDescription.data();
}
