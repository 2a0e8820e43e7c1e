// HSTU attention over the paged k/v cache on CUDA devices. Same function as paged_attention_cpu:
// out[r] = sum_j SiLU(alpha q_r . k_j) * inv_scaling_seqlen * v_j over the row's cached keys (and
// its own k/v for candidates), accumulated in fp32.
//
// Three kernels compute it:
// - on Hopper GPUs (sm_90) with bf16/fp16 and head_dim 64/128, the warp-specialised wgmma kernel of
//   paged_attention_sm90.cu (when the library was built with CUTLASS's headers), with the same
//   split over keys and combine_kernel as below;
// - attention_mma_kernel (bf16/fp16, head_dim 32/64/128; every other GPU): a block is one tile of one user's rows
//   (up to 192: 4, 8 or 12 warps of 16 rows, as many as the widest tile of the batch needs) x one
//   head x one chunk of keys, so that every row of a user reads each cached key from memory once.
//   Blocks of 64 keys are copied from the user's pages into shared memory (cp.async, a pipeline
//   of 2 to 4 stages) and multiplied on the tensor cores (mma.sync m16n8k16, fp32 accumulation),
//   32 keys at a time: S = Q K^T stays in registers, P = SiLU(alpha S) is rounded to bf16/fp16
//   and O += P V. Without softmax, key chunks are
//   independent: when tiles x heads alone would not fill the GPU, the grid's third dimension
//   splits each user's keys into chunks, each chunk writes fp32 partial sums, and combine_kernel
//   adds them in chunk order (deterministic) with the candidates' self term and casts.
// - attention_generic_kernel (everything else: float32, other head sizes): one warp per
//   (row, head), lanes over head_dim, keys one by one, exact fp32.
#include "ops/attention_cuda_math.cuh"
#include "ops/attention_cuda_params.h"
#include "ops/paged_attention_cuda.h"
#ifdef KVEXPORT_WITH_SM90
#include "ops/paged_attention_sm90.h"
#endif
#include "ops/paged_attention.h"
#include "runtime/kv_runtime.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <climits>
#include <cstdint>
#include <limits>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#error "paged_attention_cuda.cu needs sm_80 or newer (cp.async, ldmatrix, bf16 mma.sync)"
#endif

namespace kvexport::ops {

namespace {

using Params = AttentionParams;

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

// ---------------------------------------------------------------------------------------------
// Tensor-core path.

constexpr int kBlockKeys = 64;                         // keys per shared-memory stage
constexpr int kSubKeys = 32;                           // keys per score tile in registers
constexpr int64_t kMaxRowKeys = INT_MAX - kBlockKeys;  // key indices stay in int
static_assert(runtime::kAttentionTileRows == 192, "the widest block is 12 warps of 16 rows");

// A block of kWarps warps, 16 rows each (the mma's M). 168 registers a thread: 4 warps fit 3
// blocks on a multiprocessor, with 2 stages each; 8 or 12 warps fit one, which then takes 4.
template <int kDim, int kWarps>
struct MmaShape {
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kTileRows = 16 * kWarps;
  static constexpr int kStages = kWarps == 4 ? 2 : 4;
  // Shared-memory rows are padded by 16 bytes: the 8 row addresses of one ldmatrix then fall in
  // 8 different 16-byte bank groups (no conflicts).
  static constexpr int kPitch = kDim + 8;
  static constexpr int kStage = 2 * kBlockKeys * kPitch;   // K block then V block, in elements
  static constexpr int kSmemBytes = kStages * kStage * 2;  // 16-bit elements
};

__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared, bypassing L1; zero-filled (nothing read) when !valid.
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_address(dst)), "l"(src), "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_address(p))
               : "memory");
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_address(p))
               : "memory");
}

// d += a (16x16, row-major) * b (16x8, column-major), fp32 accumulators.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);
template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma_16816<__half>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Grid (tiles, heads, chunks). Fragment layouts are those of mma.m16n8k16 (PTX ISA): lane = 4 g + t
// holds rows g and g + 8, columns 2t and 2t + 1 of each 8-column accumulator tile.
template <typename T, int kDim, int kWarps>
__global__ void __launch_bounds__(32 * kWarps) attention_mma_kernel(const Params p) {
  using Shape = MmaShape<kDim, kWarps>;
  constexpr int kThreads = Shape::kThreads;
  constexpr int kTileRows = Shape::kTileRows;
  constexpr int kStages = Shape::kStages;
  constexpr int kPitch = Shape::kPitch;
  constexpr int kSteps = kDim / 16;  // k-steps of Q K^T, pairs of 8-wide tiles of P V
  constexpr int kPieces = kDim / 8;  // 16-byte pieces of one token's head slice
  constexpr int kKeysPerPass = kThreads / kPieces;
  constexpr int kPasses = (kBlockKeys + kKeysPerPass - 1) / kKeysPerPass;
  static_assert(kDim % 16 == 0 && kThreads % kPieces == 0);

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* const smem = reinterpret_cast<T*>(smem_raw);
  __shared__ int64_t tile_row[kTileRows];
  __shared__ int tile_keys[kTileRows];

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int h = blockIdx.y, chunk = blockIdx.z;
  const int64_t user = p.tiles[3 * int64_t(blockIdx.x)];
  const int64_t first = p.tiles[3 * int64_t(blockIdx.x) + 1];
  const int64_t count = p.tiles[3 * int64_t(blockIdx.x) + 2];
  const int64_t* pages = p.page_table + user * p.max_pages;
  const int64_t token_stride = int64_t(p.heads) * kDim;  // between slots of a page
  const int64_t page_stride = 2 * p.page_size * token_stride;
  const int64_t value_offset = p.page_size * token_stride;
  const T* const cache = static_cast<const T*>(p.cache) + h * kDim;
  const T* const q = static_cast<const T*>(p.q);
  const T* const k = static_cast<const T*>(p.k);
  const T* const v = static_cast<const T*>(p.v);

  for (int64_t base = 0; base < count; base += kTileRows) {
    if (threadIdx.x < kTileRows) {
      const int64_t i = base + threadIdx.x;
      const int64_t row = i < count ? p.row_order[first + i] : -1;
      tile_row[threadIdx.x] = row;
      tile_keys[threadIdx.x] = row < 0 ? 0 : int(p.row_keys[row] < kMaxRowKeys ? p.row_keys[row] : kMaxRowKeys);
    }
    __syncthreads();
    int lane_max = 0;
#pragma unroll
    for (int i = lane; i < kTileRows; i += 32) lane_max = max(lane_max, tile_keys[i]);
    const int tile_max = __reduce_max_sync(0xffffffffu, lane_max);
    const int warp_max = __reduce_max_sync(0xffffffffu, tile_keys[16 * warp + lane % 16]);
    const int start = chunk * p.chunk_keys;
    const int end = chunk == p.chunks - 1 ? tile_max : min(tile_max, start + p.chunk_keys);
    // With one chunk every block writes its rows' output (rows without keys included); with
    // several, combine_kernel reads only the chunks that hold some of a row's keys.
    if (p.chunks == 1 || start < end) {
      const int64_t row0 = tile_row[16 * warp + g], row1 = tile_row[16 * warp + g + 8];
      const int limit0 = min(tile_keys[16 * warp + g], end), limit1 = min(tile_keys[16 * warp + g + 8], end);
      const int warp_end = min(warp_max, end);

      // This warp's 16 rows of Q as A fragments, kept in registers for the whole chunk.
      uint32_t qf[kSteps][4];
      const T* const q0 = q + (row0 < 0 ? 0 : row0 * p.q_stride) + h * kDim + 2 * t;
      const T* const q1 = q + (row1 < 0 ? 0 : row1 * p.q_stride) + h * kDim + 2 * t;
#pragma unroll
      for (int s = 0; s < kSteps; ++s) {
        qf[s][0] = row0 >= 0 ? load_pair(q0 + 16 * s) : 0u;
        qf[s][1] = row1 >= 0 ? load_pair(q1 + 16 * s) : 0u;
        qf[s][2] = row0 >= 0 ? load_pair(q0 + 16 * s + 8) : 0u;
        qf[s][3] = row1 >= 0 ? load_pair(q1 + 16 * s + 8) : 0u;
      }
      float acc[2 * kSteps][4];
#pragma unroll
      for (int n = 0; n < 2 * kSteps; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;

      // Keys [first_key, first_key + kBlockKeys) of the user's pages into stage `stage`; keys at
      // or past `end` are zero-filled, so that P = 0 never meets a stale (possibly NaN) value.
      const int piece = threadIdx.x % kPieces;
      const auto load_block = [&](int stage, int first_key) {
        T* const k_s = smem + stage * Shape::kStage;
        T* const v_s = k_s + kBlockKeys * kPitch;
        // Every key's page-table entry first: each cp.async is a compiler barrier, so an entry read
        // between two of them would wait its own round trip.
        int64_t offset[kPasses];
#pragma unroll
        for (int pass = 0; pass < kPasses; ++pass) {
          const int key = threadIdx.x / kPieces + pass * kKeysPerPass;
          const int j = first_key + key;
          const bool valid = key < kBlockKeys && j < end;
          offset[pass] = valid ? pages[j / p.page_size] * page_stride + (j % p.page_size) * token_stride : -1;
        }
#pragma unroll
        for (int pass = 0; pass < kPasses; ++pass) {
          const int key = threadIdx.x / kPieces + pass * kKeysPerPass;
          if (kBlockKeys % kKeysPerPass != 0 && key >= kBlockKeys) break;
          const bool valid = offset[pass] >= 0;
          const T* const src = valid ? cache + offset[pass] + 8 * piece : cache;
          cp_async_16(k_s + key * kPitch + 8 * piece, src, valid);
          cp_async_16(v_s + key * kPitch + 8 * piece, valid ? src + value_offset : cache, valid);
        }
      };

      // The pipeline: kStages - 1 blocks in flight while one is computed. Every thread commits one
      // group per block (empty past the last), so "all but the newest kStages - 2 groups have
      // landed" means block b has.
      const int num_blocks = start < end ? (end - start + kBlockKeys - 1) / kBlockKeys : 0;
#pragma unroll
      for (int b = 0; b < kStages - 1; ++b) {
        if (b < num_blocks) load_block(b, start + b * kBlockKeys);
        cp_async_commit();
      }
      for (int b = 0; b < num_blocks; ++b) {
        const int first_key = start + b * kBlockKeys;
        cp_async_wait<kStages - 2>();
        // Block b is visible to every thread, and every thread is done with block b - 1, whose
        // stage the next load refills.
        __syncthreads();
        if (b + kStages - 1 < num_blocks) {
          load_block((b + kStages - 1) % kStages, first_key + (kStages - 1) * kBlockKeys);
        }
        cp_async_commit();
        if (first_key < warp_end) {
          const T* const k_s = smem + (b % kStages) * Shape::kStage;
          const T* const v_s = k_s + kBlockKeys * kPitch;
          // 32 keys at a time: fewer score registers live at once.
#pragma unroll
          for (int sub = 0; sub < kBlockKeys / kSubKeys; ++sub) {
            const int key0 = kSubKeys * sub;
            // S = Q K^T: 16 rows x 32 keys, as 4 accumulator tiles of 8 keys.
            float s[4][4];
#pragma unroll
            for (int n = 0; n < 4; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
            for (int step = 0; step < kSteps; ++step) {
#pragma unroll
              for (int pair = 0; pair < 2; ++pair) {
                // Matrices: keys +0..7 / +8..15 x dims +0..7 / +8..15 of this step: B of two key tiles.
                uint32_t kb[4];
                ldmatrix_x4(kb, k_s + (key0 + 16 * pair + (lane & 7) + ((lane >> 4) << 3)) * kPitch + 16 * step +
                                    ((lane >> 3) & 1) * 8);
                mma_16816<T>(s[2 * pair], qf[step], kb[0], kb[1]);
                mma_16816<T>(s[2 * pair + 1], qf[step], kb[2], kb[3]);
              }
            }
            // P = SiLU(alpha S), masked per row, as A fragments (16 rows x 16 keys each) of P V.
            // inv_scaling_seqlen is applied to O once at the end: P stays O(1), clear of fp16's
            // subnormal range.
            uint32_t pf[2][4];
#pragma unroll
            for (int n = 0; n < 4; ++n) {
              const int j = first_key + key0 + 8 * n + 2 * t;
              const float w0 = j < limit0 ? silu_weight<T>(p.alpha * s[n][0]) : 0.0f;
              const float w1 = j + 1 < limit0 ? silu_weight<T>(p.alpha * s[n][1]) : 0.0f;
              const float w2 = j < limit1 ? silu_weight<T>(p.alpha * s[n][2]) : 0.0f;
              const float w3 = j + 1 < limit1 ? silu_weight<T>(p.alpha * s[n][3]) : 0.0f;
              pf[n / 2][2 * (n % 2)] = pack2<T>(w0, w1);
              pf[n / 2][2 * (n % 2) + 1] = pack2<T>(w2, w3);
            }
            // O += P V: V's rows are keys, so its B fragments come transposed (ldmatrix .trans).
#pragma unroll
            for (int kk = 0; kk < 2; ++kk) {
#pragma unroll
              for (int pair = 0; pair < kSteps; ++pair) {
                uint32_t vb[4];
                ldmatrix_x4_trans(vb, v_s + (key0 + 16 * kk + (lane & 7) + ((lane >> 3) & 1) * 8) * kPitch + 16 * pair +
                                          (lane >> 4) * 8);
                mma_16816<T>(acc[2 * pair], pf[kk], vb[0], vb[1]);
                mma_16816<T>(acc[2 * pair + 1], pf[kk], vb[2], vb[3]);
              }
            }
          }
        }
      }
      cp_async_wait<0>();  // no copy may land in shared memory the next rows reuse

      // Epilogue. Thread (g, t) holds dims 8 n + 2 t, +1 of rows g (acc[n][0..1]) and g + 8
      // (acc[n][2..3]); its Q fragments hold q at exactly those dims.
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int64_t row = half == 0 ? row0 : row1;
        if (p.chunks == 1) {
          // The candidate's own key, in fp32 from the inputs: a dot product over the 4 lanes of the row.
          const bool self = row >= 0 && p.row_candidate[row];
          const T* const k_row = k + (self ? row * p.k_stride : 0) + h * kDim + 2 * t;
          const T* const v_row = v + (self ? row * p.v_stride : 0) + h * kDim + 2 * t;
          float dot = 0.0f;
          if (self) {
#pragma unroll
            for (int n = 0; n < 2 * kSteps; ++n) {
              const float2 qv = unpack2<T>(qf[n / 2][2 * (n % 2) + half]);
              const float2 kv = unpack2<T>(load_pair(k_row + 8 * n));
              dot += qv.x * kv.x + qv.y * kv.y;
            }
          }
          dot += __shfl_xor_sync(0xffffffffu, dot, 1);
          dot += __shfl_xor_sync(0xffffffffu, dot, 2);
          if (row >= 0) {
            const float w = self ? silu(p.alpha * dot) * p.inv_scaling : 0.0f;
            T* const o = static_cast<T*>(p.out) + (row * p.heads + h) * kDim + 2 * t;
#pragma unroll
            for (int n = 0; n < 2 * kSteps; ++n) {
              float o0 = acc[n][2 * half] * p.inv_scaling, o1 = acc[n][2 * half + 1] * p.inv_scaling;
              if (self) {
                const float2 vv = unpack2<T>(load_pair(v_row + 8 * n));
                o0 += w * vv.x;
                o1 += w * vv.y;
              }
              *reinterpret_cast<uint32_t*>(o + 8 * n) = pack2<T>(o0, o1);
            }
          }
        } else if (row >= 0) {
          float* const o = p.partial + ((chunk * p.rows + row) * p.heads + h) * kDim + 2 * t;
#pragma unroll
          for (int n = 0; n < 2 * kSteps; ++n) {
            *reinterpret_cast<float2*>(o + 8 * n) =
                make_float2(acc[n][2 * half] * p.inv_scaling, acc[n][2 * half + 1] * p.inv_scaling);
          }
        }
      }
    }
    __syncthreads();  // tile_row and tile_keys are rewritten for the next 64 rows
  }
}

// Adds the key chunks' partial sums in chunk order and the candidates' self term. Each thread
// owns 4 adjacent dims of one (row, head), kDim / 4 threads to an item (a power of two that
// divides the warp): 16-byte loads of the partial sums, kChunkBatch of them in flight before
// they are added, still one after another in chunk order (deterministic, and the same sums as
// adding them one by one).
constexpr int kChunkBatch = 8;

template <typename T, int kDim>
__global__ void combine_kernel(const Params p) {
  constexpr int kGroup = kDim / 4;  // threads of one (row, head)
  static_assert(kGroup <= 32 && 32 % kGroup == 0);
  const int64_t thread = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t item = thread / kGroup;
  const int d = 4 * int(thread % kGroup);
  // Whole groups are in or out together: the shuffles below stay within live lanes.
  if (item >= p.rows * p.heads) return;
  const int64_t row = item / p.heads;
  const int h = int(item % p.heads);
  const int64_t keys = p.row_keys[row];
  const int64_t chunks_read = (keys + p.chunk_keys - 1) / p.chunk_keys;
  const int used = keys <= 0 ? 0 : int(chunks_read < p.chunks ? chunks_read : p.chunks);
  const bool self = p.row_candidate[row];
  const unsigned group_mask = kGroup == 32 ? 0xffffffffu : ((1u << kGroup) - 1) << (threadIdx.x % 32 / kGroup * kGroup);
  float w = 0.0f;
  if (self) {
    const T* const q_row = static_cast<const T*>(p.q) + row * p.q_stride + h * kDim + d;
    const T* const k_row = static_cast<const T*>(p.k) + row * p.k_stride + h * kDim + d;
    const float2 q01 = unpack2<T>(load_pair(q_row)), q23 = unpack2<T>(load_pair(q_row + 2));
    const float2 k01 = unpack2<T>(load_pair(k_row)), k23 = unpack2<T>(load_pair(k_row + 2));
    float dot = q01.x * k01.x + q01.y * k01.y + q23.x * k23.x + q23.y * k23.y;
#pragma unroll
    for (int offset = kGroup / 2; offset > 0; offset /= 2) dot += __shfl_xor_sync(group_mask, dot, offset);
    w = silu(p.alpha * dot) * p.inv_scaling;
  }
  const int64_t chunk_stride = p.rows * p.heads * kDim;
  const float* const partial = p.partial + item * kDim + d;
  const auto add = [](float4& sum, const float4& x) {
    sum.x += x.x;
    sum.y += x.y;
    sum.z += x.z;
    sum.w += x.w;
  };
  float4 sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  int c = 0;
  for (; c + kChunkBatch <= used; c += kChunkBatch) {
    float4 batch[kChunkBatch];
#pragma unroll
    for (int i = 0; i < kChunkBatch; ++i) batch[i] = *reinterpret_cast<const float4*>(partial + (c + i) * chunk_stride);
#pragma unroll
    for (int i = 0; i < kChunkBatch; ++i) add(sum, batch[i]);
  }
  for (; c < used; ++c) add(sum, *reinterpret_cast<const float4*>(partial + c * chunk_stride));
  if (self) {
    const T* const v_row = static_cast<const T*>(p.v) + row * p.v_stride + h * kDim + d;
    const float2 v01 = unpack2<T>(load_pair(v_row)), v23 = unpack2<T>(load_pair(v_row + 2));
    sum.x += w * v01.x;
    sum.y += w * v01.y;
    sum.z += w * v23.x;
    sum.w += w * v23.y;
  }
  T* const o = static_cast<T*>(p.out) + item * kDim + d;
  *reinterpret_cast<uint2*>(o) = make_uint2(pack2<T>(sum.x, sum.y), pack2<T>(sum.z, sum.w));
}

// ---------------------------------------------------------------------------------------------
// Generic path: one warp per (row, head), lanes over head_dim; the row's q and accumulator live
// in shared memory, each lane touching only its own dims.

constexpr int kGenericWarps = 8;
constexpr int kGenericRowGroups = 8;  // grid.z: rows of a tile spread over 8 blocks of 8 warps

template <typename T>
__device__ __forceinline__ void attend_key(const float* q_s, float* acc_s, const T* key, const T* value, int dim,
                                           int lane, float alpha, float inv_scaling) {
  float dot = 0.0f;
  for (int d = lane; d < dim; d += 32) dot += q_s[d] * to_float(key[d]);
  const float w = silu(alpha * warp_sum(dot)) * inv_scaling;
  for (int d = lane; d < dim; d += 32) acc_s[d] += w * to_float(value[d]);
}

template <typename T>
__global__ void __launch_bounds__(32 * kGenericWarps) attention_generic_kernel(const Params p) {
  extern __shared__ float generic_smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int dim = p.head_dim, h = blockIdx.y;
  float* const q_s = generic_smem + 2 * warp * dim;
  float* const acc_s = q_s + dim;
  const int64_t user = p.tiles[3 * int64_t(blockIdx.x)];
  const int64_t first = p.tiles[3 * int64_t(blockIdx.x) + 1];
  const int64_t count = p.tiles[3 * int64_t(blockIdx.x) + 2];
  const int64_t* pages = p.page_table + user * p.max_pages;
  const int64_t token_stride = int64_t(p.heads) * dim;
  const int64_t page_stride = 2 * p.page_size * token_stride;
  const int64_t value_offset = p.page_size * token_stride;
  const T* const cache = static_cast<const T*>(p.cache) + h * dim;
  for (int64_t i = int64_t(blockIdx.z) * kGenericWarps + warp; i < count; i += int64_t(gridDim.z) * kGenericWarps) {
    const int64_t row = p.row_order[first + i];
    const int64_t keys = p.row_keys[row];
    const T* const q_row = static_cast<const T*>(p.q) + row * p.q_stride + h * dim;
    for (int d = lane; d < dim; d += 32) {
      q_s[d] = to_float(q_row[d]);
      acc_s[d] = 0.0f;
    }
    for (int64_t page_first = 0; page_first < keys; page_first += p.page_size) {  // page by page
      const T* const page = cache + pages[page_first / p.page_size] * page_stride;
      const int64_t in_page = keys - page_first < p.page_size ? keys - page_first : p.page_size;
      for (int64_t slot = 0; slot < in_page; ++slot) {
        const T* const key = page + slot * token_stride;
        attend_key(q_s, acc_s, key, key + value_offset, dim, lane, p.alpha, p.inv_scaling);
      }
    }
    if (p.row_candidate[row]) {
      attend_key(q_s, acc_s, static_cast<const T*>(p.k) + row * p.k_stride + h * dim,
                 static_cast<const T*>(p.v) + row * p.v_stride + h * dim, dim, lane, p.alpha, p.inv_scaling);
    }
    T* const o = static_cast<T*>(p.out) + (row * p.heads + h) * dim;
    for (int d = lane; d < dim; d += 32) o[d] = from_float<T>(acc_s[d]);
  }
}

// ---------------------------------------------------------------------------------------------
// Host side.

constexpr int64_t kMinChunkKeys = 256;  // a chunk streams at least 4 key blocks: Q loads and the epilogue amortise
constexpr int64_t kChunkOverhead = 2;   // a block's Q loads and epilogue, in key blocks' time
constexpr int kMaxDevices = 64;

// Prepares attention_mma_kernel<T, kDim, kWarps> on `device` (the current device) once: allows
// its dynamic shared memory, which is a per-device attribute, and returns how many of its blocks
// are resident on the whole device at once. Cached per device, so a launch makes no driver call
// for either; a race only repeats the idempotent calls.
template <typename T, int kDim, int kWarps>
int64_t resident_blocks(int device) {
  static std::array<std::atomic<int64_t>, kMaxDevices> cached{};
  if (device < kMaxDevices) {
    if (const int64_t known = cached[device].load(std::memory_order_relaxed); known > 0) return known;
  }
  int per_sm = 0, sms = 0;
  using Shape = MmaShape<kDim, kWarps>;
  const auto kernel = attention_mma_kernel<T, kDim, kWarps>;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Shape::kSmemBytes));
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, Shape::kThreads, Shape::kSmemBytes));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const int64_t blocks = std::max<int64_t>(int64_t(per_sm) * sms, 1);
  if (device < kMaxDevices) cached[device].store(blocks, std::memory_order_relaxed);
  return blocks;
}

bool aligned(const void* p, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

// Splits the keys into chunks for the fewest waves of key blocks: with `slots` resident blocks, a
// split into c chunks of ceil(max_keys / c) keys runs ceil(work c / slots) waves (work = tiles x
// heads), each as long as its blocks' key blocks plus kChunkOverhead (Q loads, the epilogue). A
// partial last wave costs a whole wave, so the time estimate is waves x (chunk blocks +
// overhead); the least wins, ties to fewer chunks (less workspace to combine). Chunks hold at
// least kMinChunkKeys keys. Sets p.chunks, p.chunk_keys and p.partial: enough tiles alone (large
// batches) need no split and no workspace. Returns the workspace (undefined with one chunk).
at::Tensor split_keys(Params& p, int64_t slots, int64_t max_keys, const at::Tensor& q) {
  const int64_t work = p.split_tiles * p.heads;
  const int64_t keys = std::max<int64_t>(max_keys, 1);
  const int64_t most = std::min<int64_t>(std::max<int64_t>(1, keys / kMinChunkKeys), 2 * slots);
  const auto split = [&](int64_t c) {
    const int64_t chunk_keys = ((keys + c - 1) / c + kBlockKeys - 1) / kBlockKeys * kBlockKeys;
    return std::pair<int64_t, int64_t>{(keys + chunk_keys - 1) / chunk_keys, chunk_keys};
  };
  int64_t chunks = 1, chunk_keys = split(1).second, best = std::numeric_limits<int64_t>::max();
  for (int64_t c = 1; c <= most; ++c) {
    const auto [n, width] = split(c);
    const int64_t waves = (work * n + slots - 1) / slots;
    const int64_t time = waves * (width / kBlockKeys + kChunkOverhead);
    if (time < best) best = time, chunks = n, chunk_keys = width;
  }
  TORCH_CHECK(chunks <= 65535 && chunk_keys <= std::numeric_limits<int>::max() / 2, "paged_attention: ", max_keys,
              " keys are too many");
  p.chunks = int(chunks);
  p.chunk_keys = int(chunk_keys);
  at::Tensor partial;
  if (chunks > 1) {
    partial = at::empty({chunks, p.rows, p.heads, p.head_dim}, q.options().dtype(at::kFloat));
    p.partial = partial.data_ptr<float>();
  }
  return partial;
}

template <typename T, int kDim>
void launch_combine(const Params& p, cudaStream_t stream) {
  constexpr int kCombineThreads = 256;
  static_assert(kCombineThreads % (kDim / 4) == 0, "a block holds whole (row, head) groups");
  const int64_t threads = p.rows * p.heads * (kDim / 4);
  const int64_t blocks = (threads + kCombineThreads - 1) / kCombineThreads;
  combine_kernel<T, kDim><<<unsigned(blocks), kCombineThreads, 0, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T, int kDim, int kWarps>
void launch_mma(Params p, int64_t num_tiles, int64_t max_keys, const at::Tensor& q, cudaStream_t stream) {
  using Shape = MmaShape<kDim, kWarps>;
  const auto kernel = attention_mma_kernel<T, kDim, kWarps>;
  const at::Tensor partial = split_keys(p, resident_blocks<T, kDim, kWarps>(q.get_device()), max_keys, q);
  kernel<<<dim3(unsigned(num_tiles), unsigned(p.heads), unsigned(p.chunks)), Shape::kThreads, Shape::kSmemBytes,
           stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (p.chunks > 1) launch_combine<T, kDim>(p, stream);
}

#ifdef KVEXPORT_WITH_SM90
// The Hopper kernel (paged_attention_sm90.cu), with the same split over keys and combine.
template <typename T, int kDim>
void launch_sm90(Params p, int64_t num_tiles, int64_t max_keys, int64_t max_tile_rows, const at::Tensor& q,
                 cudaStream_t stream) {
  const auto element = std::is_same_v<T, __nv_bfloat16> ? sm90::Element::kBFloat16 : sm90::Element::kHalf;
  const int consumers = sm90::consumers_for(max_tile_rows);
  int64_t slots = 0;
  C10_CUDA_CHECK(sm90::resident_blocks(element, kDim, consumers, q.get_device(), &slots));
  const at::Tensor partial = split_keys(p, slots, max_keys, q);
  C10_CUDA_CHECK(sm90::launch(p, element, num_tiles, consumers, stream));
  if (p.chunks > 1) launch_combine<T, kDim>(p, stream);
}

// Takes the batch when the device is a Hopper GPU (compute capability 9.x) and the shape is the
// Hopper kernel's: head_dim 64 or 128, Q rows 16-byte aligned (it stages Q in 16-byte pieces).
template <typename T>
bool try_launch_sm90(const Params& p, int64_t num_tiles, int64_t max_keys, int64_t max_tile_rows, const at::Tensor& q,
                     cudaStream_t stream) {
  if (at::cuda::getDeviceProperties(q.get_device())->major != 9 || !sm90::supports_head_dim(p.head_dim) ||
      !aligned(p.q, 16) || p.q_stride % 8 != 0) {
    return false;
  }
  if (p.head_dim == 64) {
    launch_sm90<T, 64>(p, num_tiles, max_keys, max_tile_rows, q, stream);
  } else {
    launch_sm90<T, 128>(p, num_tiles, max_keys, max_tile_rows, q, stream);
  }
  return true;
}
#else
template <typename T>
bool try_launch_sm90(const Params&, int64_t, int64_t, int64_t, const at::Tensor&, cudaStream_t) {
  return false;
}
#endif

template <typename T>
void launch_generic(const Params& p, int64_t num_tiles, cudaStream_t stream) {
  const auto kernel = attention_generic_kernel<T>;
  const int64_t smem = int64_t(2) * kGenericWarps * p.head_dim * sizeof(float);
  if (smem > 48 * 1024) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  }
  kernel<<<dim3(unsigned(num_tiles), unsigned(p.heads), kGenericRowGroups), 32 * kGenericWarps, size_t(smem), stream>>>(
      p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// As many warps as the widest tile needs: narrow tiles keep small blocks, several to a
// multiprocessor.
template <typename T, int kDim>
void launch_mma_rows(const Params& p, int64_t num_tiles, int64_t max_keys, int64_t max_tile_rows, const at::Tensor& q,
                     cudaStream_t stream) {
  if (max_tile_rows <= 64) {
    launch_mma<T, kDim, 4>(p, num_tiles, max_keys, q, stream);
  } else if (max_tile_rows <= 128) {
    launch_mma<T, kDim, 8>(p, num_tiles, max_keys, q, stream);
  } else {
    launch_mma<T, kDim, 12>(p, num_tiles, max_keys, q, stream);
  }
}

template <typename T>
bool try_launch_mma(const Params& p, int64_t num_tiles, int64_t max_keys, int64_t max_tile_rows, const at::Tensor& q,
                    cudaStream_t stream) {
  switch (p.head_dim) {
    case 32:
      launch_mma_rows<T, 32>(p, num_tiles, max_keys, max_tile_rows, q, stream);
      return true;
    case 64:
      launch_mma_rows<T, 64>(p, num_tiles, max_keys, max_tile_rows, q, stream);
      return true;
    case 128:
      launch_mma_rows<T, 128>(p, num_tiles, max_keys, max_tile_rows, q, stream);
      return true;
    default:
      return false;
  }
}

// q, k, v may be row slices of a wider tensor (the model's fused projection): rows strided, each
// row's [H, dh] dense. Any other layout is copied.
at::Tensor dense_rows(const at::Tensor& t) {
  const bool dense = (t.size(2) <= 1 || t.stride(2) == 1) && (t.size(1) <= 1 || t.stride(1) == t.size(2));
  return dense ? t : t.contiguous();
}

}  // namespace

at::Tensor paged_attention_cuda(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                                const at::Tensor& cache, const at::Tensor& page_table, const at::Tensor& row_keys,
                                const at::Tensor& row_candidate, const at::Tensor& row_order, const at::Tensor& tiles,
                                int64_t max_keys, int64_t max_tile_rows, int64_t split_tiles, double alpha,
                                double inv_scaling_seqlen) {
  TORCH_CHECK(q_in.dim() == 3 && q_in.sizes() == k_in.sizes() && q_in.sizes() == v_in.sizes(), "paged_attention: q ",
              q_in.sizes(), ", k ", k_in.sizes(), ", v ", v_in.sizes(), " must be equal [N, H, dh]");
  TORCH_CHECK(cache.dim() == 5 && cache.size(1) == 2 && cache.size(3) == q_in.size(1) &&
                  cache.size(4) == q_in.size(2) && cache.size(2) > 0,
              "paged_attention: cache ", cache.sizes(), " does not fit q ", q_in.sizes());
  TORCH_CHECK(k_in.scalar_type() == q_in.scalar_type() && v_in.scalar_type() == q_in.scalar_type() &&
                  cache.scalar_type() == q_in.scalar_type(),
              "paged_attention: q, k, v and cache must have one dtype, got ", q_in.scalar_type(), ", ",
              k_in.scalar_type(), ", ", v_in.scalar_type(), ", ", cache.scalar_type());
  const auto dtype = q_in.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "paged_attention: dtype must be float32, bfloat16 or float16, got ", dtype);
  const int64_t rows = q_in.size(0);
  TORCH_CHECK(page_table.dim() == 2 && page_table.scalar_type() == at::kLong,
              "paged_attention: page_table must be [B, max_pages] int64, got ", page_table.sizes(), " ",
              page_table.scalar_type());
  TORCH_CHECK(row_keys.dim() == 1 && row_keys.size(0) == rows && row_keys.scalar_type() == at::kLong,
              "paged_attention: row_keys must be [N] int64, got ", row_keys.sizes(), " ", row_keys.scalar_type());
  TORCH_CHECK(row_candidate.dim() == 1 && row_candidate.size(0) == rows && row_candidate.scalar_type() == at::kBool,
              "paged_attention: row_candidate must be [N] bool, got ", row_candidate.sizes(), " ",
              row_candidate.scalar_type());
  TORCH_CHECK(row_order.dim() == 1 && row_order.size(0) == rows && tiles.dim() == 2 && tiles.size(1) == 3,
              "paged_attention: row_order ", row_order.sizes(), " and tiles ", tiles.sizes(),
              " must be [N] and [T, 3]");
  TORCH_CHECK(row_order.scalar_type() == at::kLong && tiles.scalar_type() == at::kLong,
              "paged_attention: row_order and tiles must be int64, got ", row_order.scalar_type(), " and ",
              tiles.scalar_type());
  TORCH_CHECK(rows == 0 || tiles.size(0) > 0, "paged_attention: no tiles for ", rows, " rows");
  TORCH_CHECK(q_in.is_cuda(), "paged_attention: this kernel runs on CUDA, got ", q_in.device());
  for (const at::Tensor* t : {&k_in, &v_in, &cache, &page_table, &row_keys, &row_candidate, &row_order, &tiles}) {
    TORCH_CHECK(t->device() == q_in.device(), "paged_attention: every input must be on ", q_in.device(), ", got ",
                t->device());
  }
  for (const at::Tensor* t : {&cache, &page_table, &row_keys, &row_candidate, &row_order, &tiles}) {
    TORCH_CHECK(t->is_contiguous(), "paged_attention: cache, page_table and the row tensors must be contiguous");
  }
  TORCH_CHECK(q_in.size(1) <= 65535 && tiles.size(0) <= std::numeric_limits<int32_t>::max(),
              "paged_attention: too many heads or tiles");
  TORCH_CHECK(max_keys >= 0 && max_tile_rows >= 0, "paged_attention: max_keys and max_tile_rows must be >= 0, got ",
              max_keys, " and ", max_tile_rows);

  const c10::cuda::CUDAGuard guard(q_in.device());
  const auto q = dense_rows(q_in), k = dense_rows(k_in), v = dense_rows(v_in);
  auto out = at::empty({rows, q.size(1), q.size(2)}, q.options());
  if (out.numel() == 0) return out;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  Params p{};
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.q_stride = q.stride(0);
  p.k_stride = k.stride(0);
  p.v_stride = v.stride(0);
  p.cache = cache.data_ptr();
  p.page_table = page_table.data_ptr<int64_t>();
  p.row_keys = row_keys.data_ptr<int64_t>();
  p.row_candidate = row_candidate.data_ptr<bool>();
  p.row_order = row_order.data_ptr<int64_t>();
  p.tiles = tiles.data_ptr<int64_t>();
  p.out = out.data_ptr();
  p.rows = rows;
  p.max_pages = page_table.size(1);
  p.heads = int(q.size(1));
  p.head_dim = int(q.size(2));
  p.page_size = int(cache.size(2));
  p.chunks = 1;
  p.chunk_keys = 1;
  p.alpha = float(alpha);
  p.inv_scaling = float(inv_scaling_seqlen);
  const int64_t num_tiles = tiles.size(0);
  p.split_tiles = split_tiles > 0 ? std::min(split_tiles, num_tiles) : num_tiles;

  // The tensor-core kernel reads q/k/v in pairs (4-byte aligned rows) and the cache in 16-byte pieces.
  const bool pairs_aligned = aligned(p.q, 4) && aligned(p.k, 4) && aligned(p.v, 4) && p.q_stride % 2 == 0 &&
                             p.k_stride % 2 == 0 && p.v_stride % 2 == 0;
  const bool mma_ok = pairs_aligned && aligned(p.cache, 16);
  switch (dtype) {
    case at::kBFloat16:
      if (!(mma_ok && (try_launch_sm90<__nv_bfloat16>(p, num_tiles, max_keys, max_tile_rows, q, stream) ||
                       try_launch_mma<__nv_bfloat16>(p, num_tiles, max_keys, max_tile_rows, q, stream)))) {
        launch_generic<__nv_bfloat16>(p, num_tiles, stream);
      }
      break;
    case at::kHalf:
      if (!(mma_ok && (try_launch_sm90<__half>(p, num_tiles, max_keys, max_tile_rows, q, stream) ||
                       try_launch_mma<__half>(p, num_tiles, max_keys, max_tile_rows, q, stream)))) {
        launch_generic<__half>(p, num_tiles, stream);
      }
      break;
    default:
      launch_generic<float>(p, num_tiles, stream);
      break;
  }
  return out;
}

std::pair<std::string, std::string> cuda_device_info(c10::DeviceIndex index) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();  // no driver or no device: not an error of later CUDA calls
    return {};
  }
  int device = index;
  if (index < 0) C10_CUDA_CHECK(cudaGetDevice(&device));
  if (device >= count) return {};
  cudaDeviceProp prop{};
  C10_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  return {std::to_string(prop.major) + "." + std::to_string(prop.minor), prop.name};
}

namespace {

// kvexport::hstu_paged_attention on CUDA: the pure op, for tests and benchmarks. Unlike the
// runtime's path it reads the row metadata on the host (a synchronising copy) to build the tiles
// and to check every index, as the CPU kernel does.
at::Tensor hstu_paged_attention_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                     const at::Tensor& cache, const at::Tensor& page_table, const at::Tensor& row_user,
                                     const at::Tensor& row_keys, const at::Tensor& row_candidate, double alpha,
                                     double inv_scaling_seqlen) {
  TORCH_CHECK(q.dim() == 3 && cache.dim() == 5, "paged_attention: q must be [N, H, dh] and cache 5-D, got ", q.sizes(),
              " and ", cache.sizes());
  TORCH_CHECK(row_user.dim() == 1 && row_user.size(0) == q.size(0) && row_keys.dim() == 1 &&
                  row_keys.size(0) == q.size(0) && row_candidate.dim() == 1 && row_candidate.size(0) == q.size(0),
              "paged_attention: row metadata has ", row_user.sizes(), ", ", row_keys.sizes(), ", ",
              row_candidate.sizes(), " rows, q has ", q.size(0));
  TORCH_CHECK(page_table.dim() == 2, "paged_attention: page_table must be [B, max_pages], got ", page_table.sizes());
  const auto users = row_user.to(at::kCPU, at::kLong).contiguous();
  const auto keys = row_keys.to(at::kCPU, at::kLong).contiguous();
  const auto pages = page_table.to(at::kCPU, at::kLong).contiguous();
  const int64_t max_keys = check_row_metadata(pages, users, keys, cache.size(0), cache.size(2));
  // The runtime's tiling of the rows, uploaded in one copy.
  auto [row_order, tiles] = runtime::user_tiles({users.data_ptr<int64_t>(), users.data_ptr<int64_t>() + users.numel()},
                                                runtime::kAttentionTileRows);
  const auto num_rows = static_cast<int64_t>(row_order.size());
  const int64_t max_tile_rows = runtime::widest_tile(tiles);
  row_order.insert(row_order.end(), tiles.begin(), tiles.end());
  const auto uploaded = at::tensor(row_order, at::kLong).to(q.device());
  return paged_attention_cuda(q, k, v, cache.contiguous(), page_table.to(at::kLong).contiguous(),
                              row_keys.to(at::kLong).contiguous(), row_candidate.to(at::kBool).contiguous(),
                              uploaded.narrow(0, 0, num_rows),
                              uploaded.narrow(0, num_rows, uploaded.size(0) - num_rows).view({-1, 3}), max_keys,
                              max_tile_rows, /*split_tiles=*/0, alpha, inv_scaling_seqlen);
}

}  // namespace

}  // namespace kvexport::ops

TORCH_LIBRARY_IMPL(kvexport, CUDA, m) {
  m.impl("hstu_paged_attention", &kvexport::ops::hstu_paged_attention_cuda);
}
