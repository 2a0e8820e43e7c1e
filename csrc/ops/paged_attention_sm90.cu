// The Hopper path of the CUDA attention (sm_90a): the same function as attention_mma_kernel in
// paged_attention_cuda.cu, out[r] = sum_j SiLU(alpha q_r . k_j) * inv_scaling_seqlen * v_j over the
// row's cached keys, for one tile of a user's rows x one head x one chunk of keys per block.
//
// Warp-specialised, as FlashAttention-3 lays out this class of kernel:
// - warpgroup 0 is the producer: it follows the user's page table and copies blocks of 64 keys (K
//   and V) into a ring of shared-memory stages with cp.async, key by key (a page's 32 keys of one
//   head are 256-byte rows 1 KB apart), each thread signalling the stage's "full" mbarrier when
//   its copies land;
// - warpgroups 1..kConsumers each own 64 query rows of the tile (Q in shared memory) and run both
//   products on the tensor cores with wgmma: S = Q K^T (both operands in shared memory), then
//   P = SiLU(alpha S) masked per row and rounded to the input dtype in registers, and O += P V with
//   P as the register operand; O stays in registers. A block's P V stays in flight while the next
//   block's scores are computed; a consumer warp signals the stage's "empty" mbarrier once both its
//   products are done, and the producer refills it.
// - The consumer warpgroups take turns on the tensor cores (ping-pong through named barriers):
//   one group's SiLU runs while the other groups' products run.
// Without softmax there is no running maximum or normaliser: key chunks are independent, and
// their fp32 partial sums are added in chunk order by the caller (deterministic).
#include "ops/attention_cuda_math.cuh"
#include "ops/paged_attention_sm90.h"

#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/numeric_types.h>
#include <cute/tensor.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <climits>

namespace kvexport::ops::sm90 {

namespace {

using namespace cute;

constexpr int kBlockKeys = 64;  // keys per shared-memory stage and per score tile
constexpr int kStages = 4;
constexpr int kWarpgroupThreads = 128;
constexpr int kRowsPerConsumer = 64;                   // wgmma's M
constexpr int64_t kMaxRowKeys = INT_MAX - kBlockKeys;  // key indices stay in int
// Named barriers: 0 is __syncthreads; 1..3 one per consumer (Q staged); 4..6 the ping-pong turns.
constexpr int kQBarrier = 1;
constexpr int kTurnBarrier = 4;
constexpr int kBlockBarrier = 7;  // the whole block, reached from the producer's and the consumers' code

// The CUDA type of a CUTLASS element (the math helpers take CUDA's types).
template <typename E>
using CudaType = std::conditional_t<std::is_same_v<E, cutlass::bfloat16_t>, __nv_bfloat16, __half>;

template <typename E, int kDim, int kConsumers>
struct Config {
  static_assert(kDim == 64 || kDim == 128, "head_dim 64 or 128");
  static constexpr int kThreads = kWarpgroupThreads * (kConsumers + 1);
  static constexpr int kTileRows = kRowsPerConsumer * kConsumers;
  // Registers a thread after the split (setmaxnreg): the producer needs few, the consumers hold
  // O (kDim / 2 fp32), S (32 fp32) and P (16 registers). Per block at most 64K registers.
  static constexpr int kProducerRegs = kConsumers == 3 ? 56 : 40;
  static constexpr int kConsumerRegs = kConsumers == 3 ? 152 : 232;
  static_assert(kConsumers == 1 || kWarpgroupThreads * (kProducerRegs + kConsumers * kConsumerRegs) <= 65536);

  // 128-byte swizzled layouts, as wgmma reads them. K is the B operand of S = Q K^T with the head
  // dims contiguous (K-major); V is the B operand of O = P V with the head dims (its N) contiguous
  // (MN-major): both hold a key's dims in one 16-byte-granular row, so the producer's 16-byte
  // copies land whole.
  using LayoutQ = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<E>{}, Shape<Int<kRowsPerConsumer>, Int<kDim>>{}));
  using LayoutK =
      decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<E>{}, Shape<Int<kBlockKeys>, Int<kDim>, Int<kStages>>{}));
  using LayoutV =
      decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<E>{}, Shape<Int<kDim>, Int<kBlockKeys>, Int<kStages>>{}));

  using MmaS = decltype(make_tiled_mma(
      GMMA::ss_op_selector<E, E, float, Shape<Int<kRowsPerConsumer>, Int<kBlockKeys>, Int<kDim>>>()));
  using MmaO = decltype(make_tiled_mma(
      GMMA::rs_op_selector<E, E, float, Shape<Int<kRowsPerConsumer>, Int<kDim>, Int<kBlockKeys>>, GMMA::Major::K,
                           GMMA::Major::MN>()));

  struct Storage {
    alignas(1024) E q[kConsumers][cosize_v<LayoutQ>];
    alignas(1024) E k[cosize_v<LayoutK>];
    alignas(1024) E v[cosize_v<LayoutV>];
    alignas(8) uint64_t full[kStages];
    alignas(8) uint64_t empty[kStages];
    int64_t tile_row[kTileRows];
    int tile_keys[kTileRows];
  };
  static constexpr int kSmemBytes = int(sizeof(Storage));
};

__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(cute::cast_smem_ptr_to_uint(dst)), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
}

// The accumulator fragment of S (64 x 64, fp32) read as the register A operand of O = P V
// (64 x 16 per k-step): per thread the accumulator's values ((2, 2, 8 column groups), 1, 1) are the
// A fragment's ((2, 2, 2), 1, 4 k-steps) in the same order, pairs of column groups making one k-step.
template <typename Layout>
__device__ __forceinline__ auto accumulator_as_operand_a(Layout layout) {
  auto values = logical_divide(get<0>(layout), Shape<Underscore, Underscore, _2>{});  // (2, 2, (2, 4))
  return make_layout(make_layout(get<0>(values), get<1>(values), get<2, 0>(values)), get<1>(layout),
                     coalesce(make_layout(get<2, 1>(values), get<2>(layout))));
}

// A barrier of the whole block that the producer and the consumers reach from their own code.
template <typename Cfg>
__device__ __forceinline__ void sync_block() {
  cutlass::arch::NamedBarrier::sync(Cfg::kThreads, kBlockBarrier);
}

// The keys this block reads for one tile: [start, end), in num_blocks blocks of kBlockKeys.
struct ChunkKeys {
  int start, end, num_blocks;
};

__device__ __forceinline__ ChunkKeys chunk_keys(const AttentionParams& p, int tile_max) {
  const int chunk = blockIdx.z;
  const int start = chunk * p.chunk_keys;
  const int end = chunk == p.chunks - 1 ? tile_max : min(tile_max, start + p.chunk_keys);
  return {start, end, start < end ? (end - start + kBlockKeys - 1) / kBlockKeys : 0};
}

// One tile's rows into shared memory; returns the widest row's key count (all threads).
template <typename Cfg>
__device__ __forceinline__ int stage_tile_rows(typename Cfg::Storage& smem, const AttentionParams& p, int64_t first,
                                               int64_t count, int64_t base) {
  if (threadIdx.x < Cfg::kTileRows) {
    const int64_t i = base + threadIdx.x;
    const int64_t row = i < count ? p.row_order[first + i] : -1;
    smem.tile_row[threadIdx.x] = row;
    smem.tile_keys[threadIdx.x] = row < 0 ? 0 : int(p.row_keys[row] < kMaxRowKeys ? p.row_keys[row] : kMaxRowKeys);
  }
  sync_block<Cfg>();
  int lane_max = 0;
  for (int i = threadIdx.x % 32; i < Cfg::kTileRows; i += 32) lane_max = max(lane_max, smem.tile_keys[i]);
  return __reduce_max_sync(0xffffffffu, lane_max);
}

// The producer: keys [start, start + num_blocks * kBlockKeys) of the user's pages, block by block,
// into the ring of stages; keys at or past `end` are zero-filled (P = 0 never meets stale values).
template <typename E, typename Cfg>
__device__ __forceinline__ void produce(typename Cfg::Storage& smem, const AttentionParams& p, const E* cache,
                                        const int64_t* pages, int start, int end, int num_blocks, int& iteration) {
  constexpr int kDim = decltype(size<1>(typename Cfg::LayoutK{}))::value;
  constexpr int kPieces = kDim / 8;  // 16-byte pieces of one token's head slice
  constexpr int kKeysPerPass = kWarpgroupThreads / kPieces;
  Tensor k_s = make_tensor(make_smem_ptr(smem.k), typename Cfg::LayoutK{});  // (key, dim, stage)
  Tensor v_s = make_tensor(make_smem_ptr(smem.v), typename Cfg::LayoutV{});  // (dim, key, stage)
  const int thread = threadIdx.x % kWarpgroupThreads;
  const int piece = thread % kPieces;
  const int64_t token_stride = int64_t(p.heads) * kDim;
  const int64_t page_stride = 2 * p.page_size * token_stride;
  const int64_t value_offset = p.page_size * token_stride;
  constexpr int kPasses = kBlockKeys / kKeysPerPass;
  for (int b = 0; b < num_blocks; ++b, ++iteration) {
    const int stage = iteration % kStages;
    // Every key's page-table entry first, while the stage may still be in use: each cp.async is a
    // compiler barrier, so an entry read between two of them would wait its own round trip.
    const int first_key = start + b * kBlockKeys;
    int64_t offset[kPasses];
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) {
      const int j = first_key + thread / kPieces + pass * kKeysPerPass;
      offset[pass] = j < end ? pages[j / p.page_size] * page_stride + (j % p.page_size) * token_stride : -1;
    }
    // A fresh barrier counts as released in the phase before its first: the first round never waits.
    cutlass::arch::ClusterBarrier::wait(&smem.empty[stage], ((iteration / kStages) & 1) ^ 1);
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) {
      const int key = thread / kPieces + pass * kKeysPerPass;
      const bool valid = offset[pass] >= 0;
      const E* const src = valid ? cache + offset[pass] + 8 * piece : cache;
      cp_async_16(&k_s(key, 8 * piece, stage), src, valid);
      cp_async_16(&v_s(8 * piece, key, stage), valid ? src + value_offset : cache, valid);
    }
    cutlass::arch::cpasync_barrier_arrive_noinc(&smem.full[stage]);
  }
}

// Q's 64 rows of this consumer into shared memory, zero for rows past the tile.
template <typename E, typename Cfg>
__device__ __forceinline__ void stage_q(typename Cfg::Storage& smem, const AttentionParams& p, int consumer, int h) {
  constexpr int kDim = decltype(size<1>(typename Cfg::LayoutQ{}))::value;
  constexpr int kPieces = kDim / 8;
  Tensor q_s = make_tensor(make_smem_ptr(smem.q[consumer]), typename Cfg::LayoutQ{});  // (row, dim)
  const int thread = threadIdx.x % kWarpgroupThreads;
  const E* const q = static_cast<const E*>(p.q);
#pragma unroll
  for (int i = thread; i < kRowsPerConsumer * kPieces; i += kWarpgroupThreads) {
    const int r = i / kPieces, piece = i % kPieces;
    const int64_t row = smem.tile_row[kRowsPerConsumer * consumer + r];
    uint4 bits = make_uint4(0u, 0u, 0u, 0u);
    if (row >= 0) bits = *reinterpret_cast<const uint4*>(q + row * p.q_stride + h * kDim + 8 * piece);
    *reinterpret_cast<uint4*>(&q_s(r, 8 * piece)) = bits;
  }
  // The tensor cores read Q through the async proxy: order the plain stores before them.
  cutlass::arch::fence_view_async_shared();
  cutlass::arch::NamedBarrier::sync(kWarpgroupThreads, kQBarrier + consumer);
}

// The epilogue: O * inv_scaling_seqlen plus, with one chunk, the candidates' own key in fp32 from
// the inputs; with several chunks fp32 partial sums (the caller adds them and the self term).
// Thread values come in pairs of adjacent dims of one row; a row's dims spread over the 4 lanes of
// a lane group (lanes 4 g .. 4 g + 3), as in mma.sync's accumulator layout.
template <typename E, int kDim, typename Acc, typename Coord>
__device__ __forceinline__ void write_output(const AttentionParams& p, const Acc& o_acc, const Coord& out_coord,
                                             const int64_t* tile_row, int h) {
  using T = CudaType<E>;
  const int r0 = get<0>(out_coord(0));
  const int64_t rows[2] = {tile_row[r0], tile_row[r0 + 8]};
  if (p.chunks == 1) {
    bool self[2];
    float dot[2] = {0.0f, 0.0f};
    const T* const q = static_cast<const T*>(p.q);
    const T* const k = static_cast<const T*>(p.k);
    const T* const v = static_cast<const T*>(p.v);
#pragma unroll
    for (int half = 0; half < 2; ++half) self[half] = rows[half] >= 0 && p.row_candidate[rows[half]];
    CUTE_UNROLL
    for (int i = 0; i < size(o_acc); i += 2) {
      const int half = get<0>(out_coord(i)) == r0 ? 0 : 1;
      if (self[half]) {
        const int d = h * kDim + get<1>(out_coord(i));
        const float2 qv = unpack2<T>(load_pair(q + rows[half] * p.q_stride + d));
        const float2 kv = unpack2<T>(load_pair(k + rows[half] * p.k_stride + d));
        dot[half] += qv.x * kv.x + qv.y * kv.y;
      }
    }
    float weight[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      dot[half] += __shfl_xor_sync(0xffffffffu, dot[half], 1);
      dot[half] += __shfl_xor_sync(0xffffffffu, dot[half], 2);
      weight[half] = self[half] ? silu(p.alpha * dot[half]) * p.inv_scaling : 0.0f;
    }
    CUTE_UNROLL
    for (int i = 0; i < size(o_acc); i += 2) {
      const int half = get<0>(out_coord(i)) == r0 ? 0 : 1;
      if (rows[half] < 0) continue;
      const int d = get<1>(out_coord(i));
      float o0 = o_acc(i) * p.inv_scaling, o1 = o_acc(i + 1) * p.inv_scaling;
      if (self[half]) {
        const float2 vv = unpack2<T>(load_pair(v + rows[half] * p.v_stride + h * kDim + d));
        o0 += weight[half] * vv.x;
        o1 += weight[half] * vv.y;
      }
      T* const o = static_cast<T*>(p.out) + (rows[half] * p.heads + h) * kDim + d;
      *reinterpret_cast<uint32_t*>(o) = pack2<T>(o0, o1);
    }
  } else {
    const int chunk = blockIdx.z;
    CUTE_UNROLL
    for (int i = 0; i < size(o_acc); i += 2) {
      const int half = get<0>(out_coord(i)) == r0 ? 0 : 1;
      if (rows[half] < 0) continue;
      float* const o = p.partial + ((chunk * p.rows + rows[half]) * p.heads + h) * kDim + get<1>(out_coord(i));
      *reinterpret_cast<float2*>(o) = make_float2(o_acc(i) * p.inv_scaling, o_acc(i + 1) * p.inv_scaling);
    }
  }
}

// Where a block's user, rows and keys are.
struct Tile {
  int64_t first, count;
  const int64_t* pages;
};

__device__ __forceinline__ Tile block_tile(const AttentionParams& p) {
  const int64_t* const t = p.tiles + 3 * int64_t(blockIdx.x);
  return {t[1], t[2], p.page_table + t[0] * p.max_pages};
}

// The producer warpgroup's whole part of the block.
template <typename E, typename Cfg>
__device__ void producer_main(typename Cfg::Storage& smem, const AttentionParams& p) {
  constexpr int kDim = decltype(size<1>(typename Cfg::LayoutK{}))::value;
  const Tile tile = block_tile(p);
  const E* const cache = static_cast<const E*>(p.cache) + blockIdx.y * kDim;
  int iteration = 0;
  for (int64_t base = 0; base < tile.count; base += Cfg::kTileRows) {
    const ChunkKeys keys = chunk_keys(p, stage_tile_rows<Cfg>(smem, p, tile.first, tile.count, base));
    produce<E, Cfg>(smem, p, cache, tile.pages, keys.start, keys.end, keys.num_blocks, iteration);
    sync_block<Cfg>();  // tile_row and tile_keys are rewritten for the next rows
  }
}

// One consumer warpgroup's part: its 64 rows of every tile base, all of the block's keys.
template <typename E, typename Cfg>
__device__ void consumer_main(typename Cfg::Storage& smem, const AttentionParams& p, int consumer) {
  using T = CudaType<E>;
  constexpr int kDim = decltype(size<1>(typename Cfg::LayoutK{}))::value;
  constexpr int kConsumers = Cfg::kTileRows / kRowsPerConsumer;
  const Tile tile = block_tile(p);
  const int h = blockIdx.y;
  const int thread = threadIdx.x % kWarpgroupThreads;
  const int rows_base = kRowsPerConsumer * consumer;

  typename Cfg::MmaS mma_s;
  typename Cfg::MmaO mma_o;
  auto thr_s = mma_s.get_slice(thread);
  auto thr_o = mma_o.get_slice(thread);
  Tensor q_s = make_tensor(make_smem_ptr(smem.q[consumer]), typename Cfg::LayoutQ{});
  Tensor k_s = make_tensor(make_smem_ptr(smem.k), typename Cfg::LayoutK{});
  Tensor v_s = make_tensor(make_smem_ptr(smem.v), typename Cfg::LayoutV{});
  Tensor q_frag = thr_s.make_fragment_A(thr_s.partition_A(q_s));  // (MMA, 1, dim steps)
  Tensor k_frag = thr_s.make_fragment_B(thr_s.partition_B(k_s));  // (MMA, 1, dim steps, stage)
  Tensor v_frag = thr_o.make_fragment_B(thr_o.partition_B(v_s));  // (MMA, 1, key steps, stage)
  // (row, key) of each score this thread holds, and (row, dim) of each output value.
  Tensor score_coord = thr_s.partition_C(make_identity_tensor(Shape<Int<kRowsPerConsumer>, Int<kBlockKeys>>{}));
  Tensor out_coord = thr_o.partition_C(make_identity_tensor(Shape<Int<kRowsPerConsumer>, Int<kDim>>{}));
  const int r0 = get<0>(score_coord(0));  // each thread holds scores of rows r0 and r0 + 8

  // The first turn on the tensor cores is consumer 0's, as if the last consumer had just had one.
  if constexpr (kConsumers > 1) {
    if (consumer == kConsumers - 1) cutlass::arch::NamedBarrier::arrive(2 * kWarpgroupThreads, kTurnBarrier);
  }
  int iteration = 0;
  for (int64_t base = 0; base < tile.count; base += Cfg::kTileRows) {
    const ChunkKeys keys = chunk_keys(p, stage_tile_rows<Cfg>(smem, p, tile.first, tile.count, base));
    // With one chunk every block writes its rows' output (rows without keys included); with
    // several, the caller reads only the chunks that hold some of a row's keys.
    if (p.chunks == 1 || keys.start < keys.end) {
      stage_q<E, Cfg>(smem, p, consumer, h);
      const int limit0 = min(smem.tile_keys[rows_base + r0], keys.end);
      const int limit1 = min(smem.tile_keys[rows_base + r0 + 8], keys.end);
      int lane_max = 0;
      for (int i = thread % 32; i < kRowsPerConsumer; i += 32) lane_max = max(lane_max, smem.tile_keys[rows_base + i]);
      // The same for the whole warpgroup: all of it runs a block's products, or none of it.
      const int consumer_end = min(__reduce_max_sync(0xffffffffu, lane_max), keys.end);

      Tensor o_acc = partition_fragment_C(mma_o, Shape<Int<kRowsPerConsumer>, Int<kDim>>{});
      clear(o_acc);
      Tensor s_acc = partition_fragment_C(mma_s, Shape<Int<kRowsPerConsumer>, Int<kBlockKeys>>{});
      Tensor p_reg = make_tensor<E>(s_acc.layout());
      Tensor p_frag = make_tensor(p_reg.data(), accumulator_as_operand_a(p_reg.layout()));
      // A block's P V stays in flight until the next block's scores are waited on (wgmma groups
      // complete in order), so the tensor cores run it while this warpgroup waits for the next
      // stage; `pending` is its stage, released once it is done.
      int pending = -1;
      const auto release = [&](int done_stage) {
        // This warp no longer reads the stage.
        if (thread % 32 == 0) cutlass::arch::ClusterBarrier::arrive(&smem.empty[done_stage]);
      };
      for (int b = 0; b < keys.num_blocks; ++b, ++iteration) {
        const int stage = iteration % kStages;
        const int first_key = keys.start + b * kBlockKeys;
        cutlass::arch::ClusterBarrier::wait(&smem.full[stage], (iteration / kStages) & 1);
        // The stage was written through the generic proxy (cp.async); wgmma reads it through the
        // async proxy.
        cutlass::arch::fence_view_async_shared();
        if constexpr (kConsumers > 1) {
          cutlass::arch::NamedBarrier::sync(2 * kWarpgroupThreads, kTurnBarrier + consumer);
        }
        if (first_key < consumer_end) {
          warpgroup_fence_operand(s_acc);
          warpgroup_arrive();
          mma_s.accumulate_ = GMMA::ScaleOut::Zero;
          CUTE_UNROLL
          for (int step = 0; step < size<2>(q_frag); ++step) {
            cute::gemm(mma_s, q_frag(_, _, step), k_frag(_, _, step, stage), s_acc);
            mma_s.accumulate_ = GMMA::ScaleOut::One;
          }
          warpgroup_commit_batch();
          // The next consumer's turn: its products queue behind these while this one runs SiLU.
          if constexpr (kConsumers > 1) {
            cutlass::arch::NamedBarrier::arrive(2 * kWarpgroupThreads, kTurnBarrier + (consumer + 1) % kConsumers);
          }
          warpgroup_wait<0>();  // these scores, and the previous block's P V
          warpgroup_fence_operand(s_acc);
          if (pending >= 0) release(pending);

          // P = SiLU(alpha S), masked per row, rounded to the input dtype: the A operand of P V.
          // inv_scaling_seqlen is applied to O once at the end: P stays O(1). Where both of this
          // thread's rows read the whole block, no key is masked.
          if (first_key + kBlockKeys <= min(limit0, limit1)) {
            CUTE_UNROLL
            for (int i = 0; i < size(s_acc); ++i) p_reg(i) = E(silu_weight<T>(p.alpha * s_acc(i)));
          } else {
            CUTE_UNROLL
            for (int i = 0; i < size(s_acc); ++i) {
              const int j = first_key + get<1>(score_coord(i));
              const int limit = get<0>(score_coord(i)) == r0 ? limit0 : limit1;
              p_reg(i) = E(j < limit ? silu_weight<T>(p.alpha * s_acc(i)) : 0.0f);
            }
          }
          warpgroup_fence_operand(o_acc);
          warpgroup_arrive();
          CUTE_UNROLL
          for (int step = 0; step < size<2>(p_frag); ++step) {
            cute::gemm(mma_o, p_frag(_, _, step), v_frag(_, _, step, stage), o_acc);
          }
          warpgroup_commit_batch();
          pending = stage;
        } else {
          if constexpr (kConsumers > 1) {
            cutlass::arch::NamedBarrier::arrive(2 * kWarpgroupThreads, kTurnBarrier + (consumer + 1) % kConsumers);
          }
          release(stage);
        }
      }
      warpgroup_wait<0>();
      warpgroup_fence_operand(o_acc);
      if (pending >= 0) release(pending);
      write_output<E, kDim>(p, o_acc, out_coord, smem.tile_row + rows_base, h);
    }
    sync_block<Cfg>();  // tile_row, tile_keys and Q are rewritten for the next rows
  }
}

template <typename E, int kDim, int kConsumers>
__global__ void __launch_bounds__(Config<E, kDim, kConsumers>::kThreads, 1)
    attention_sm90_kernel(const __grid_constant__ AttentionParams p) {
  using Cfg = Config<E, kDim, kConsumers>;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  auto& smem = *reinterpret_cast<typename Cfg::Storage*>(smem_raw);
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      cutlass::arch::ClusterBarrier::init(&smem.full[s], kWarpgroupThreads);  // every producer thread's copies
      cutlass::arch::ClusterBarrier::init(&smem.empty[s], 4 * kConsumers);    // every consumer warp
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();
  const int warpgroup = threadIdx.x / kWarpgroupThreads;
  if (warpgroup == 0) {
    if constexpr (kConsumers > 1) cutlass::arch::warpgroup_reg_dealloc<Cfg::kProducerRegs>();
    producer_main<E, Cfg>(smem, p);
  } else {
    if constexpr (kConsumers > 1) cutlass::arch::warpgroup_reg_alloc<Cfg::kConsumerRegs>();
    consumer_main<E, Cfg>(smem, p, warpgroup - 1);
  }
}

// ---------------------------------------------------------------------------------------------
// Host side.

constexpr int kMaxDevices = 64;

template <typename E, int kDim, int kConsumers>
cudaError_t prepare(int device, int64_t* blocks) {
  static std::array<std::atomic<int64_t>, kMaxDevices> cached{};
  if (device < kMaxDevices) {
    if (const int64_t known = cached[device].load(std::memory_order_relaxed); known > 0) {
      *blocks = known;
      return cudaSuccess;
    }
  }
  using Cfg = Config<E, kDim, kConsumers>;
  const auto kernel = attention_sm90_kernel<E, kDim, kConsumers>;
  int per_sm = 0, sms = 0;
  cudaError_t status = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes);
  if (status == cudaSuccess) {
    status = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, Cfg::kThreads, Cfg::kSmemBytes);
  }
  if (status == cudaSuccess) status = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (status != cudaSuccess) return status;
  *blocks = std::max<int64_t>(int64_t(per_sm) * sms, 1);
  if (device < kMaxDevices) cached[device].store(*blocks, std::memory_order_relaxed);
  return cudaSuccess;
}

template <typename E, int kDim, int kConsumers>
cudaError_t launch_kernel(const AttentionParams& p, int64_t num_tiles, cudaStream_t stream) {
  using Cfg = Config<E, kDim, kConsumers>;
  attention_sm90_kernel<E, kDim, kConsumers>
      <<<dim3(unsigned(num_tiles), unsigned(p.heads), unsigned(p.chunks)), Cfg::kThreads, Cfg::kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

// Calls f.template operator()<E, kDim, kConsumers>() for the run-time choice.
template <typename F>
cudaError_t dispatch(Element element, int head_dim, int consumers, F&& f) {
  const auto by_consumers = [&]<typename E, int kDim>() {
    switch (consumers) {
      case 1:
        return f.template operator()<E, kDim, 1>();
      case 2:
        return f.template operator()<E, kDim, 2>();
      default:
        return f.template operator()<E, kDim, 3>();
    }
  };
  const auto by_dim = [&]<typename E>() {
    return head_dim == 64 ? by_consumers.template operator()<E, 64>() : by_consumers.template operator()<E, 128>();
  };
  return element == Element::kBFloat16 ? by_dim.template operator()<cutlass::bfloat16_t>()
                                       : by_dim.template operator()<cutlass::half_t>();
}

}  // namespace

bool supports_head_dim(int head_dim) {
  return head_dim == 64 || head_dim == 128;
}

int consumers_for(int64_t max_tile_rows) {
  return max_tile_rows <= kRowsPerConsumer ? 1 : max_tile_rows <= 2 * kRowsPerConsumer ? 2 : 3;
}

cudaError_t resident_blocks(Element element, int head_dim, int consumers, int device, int64_t* blocks) {
  return dispatch(element, head_dim, consumers,
                  [&]<typename E, int kDim, int kConsumers>() { return prepare<E, kDim, kConsumers>(device, blocks); });
}

cudaError_t launch(const AttentionParams& p, Element element, int64_t num_tiles, int consumers, cudaStream_t stream) {
  return dispatch(element, p.head_dim, consumers, [&]<typename E, int kDim, int kConsumers>() {
    return launch_kernel<E, kDim, kConsumers>(p, num_tiles, stream);
  });
}

}  // namespace kvexport::ops::sm90
