// The plan of one batch: where each new row's k/v goes and which cached keys it reads, as the
// attention kernels take it. Built from the users' page lists; knows nothing of tiers or eviction.
#pragma once

#include <ATen/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace kvexport::runtime {

// What begin_batch hands its caller: build_plan_tensors' new tokens and the plan's number of new rows.
struct PlannedBatch {
  at::Tensor new_tokens;  // [2, num_new_prefix_rows] int64 on the host
  int64_t num_rows = 0;
};

// New rows of the model are laid out as [candidates of all users][uncached prefix tokens of all
// users], users in batch order.
struct BatchPlan {
  std::vector<int64_t> user_ids;
  std::vector<int64_t> cached_lengths;                // reused prefix per user
  std::vector<std::vector<int64_t>> uncached_tokens;  // each user's tokens after its cached prefix
  // A user's first rows that read its whole prefix (RuntimeConfig::context_rows_see_prefix).
  int64_t context_rows_see_prefix = 0;
  int64_t num_candidate_rows = 0;
  int64_t num_new_prefix_rows = 0;
  // On the cache's device:
  at::Tensor page_table;     // [B, max_pages] int64, page of each user's j-th page slot
  at::Tensor row_user;       // [N] int64, batch index of each new row
  at::Tensor row_keys;       // [N] int64, cached keys a row reads: position + 1, or the prefix length
                             // (candidates, and contextual rows under context_rows_see_prefix)
  at::Tensor row_candidate;  // [N] bool, true for candidate rows (they also read themselves)
  at::Tensor write_slots;    // [num_new_prefix_rows] int64, slot of each new prefix row in a layer's
                             // cache viewed as [pages * 2 * page_size, heads, head_dim] (k; v is +page_size)
  at::Tensor value_slots;    // [num_new_prefix_rows] int64, write_slots + page_size: where the v rows go
  // For kernels that work on tiles of one user's rows (CUDA): rows grouped by user, and tiles
  // [T, 3] int64 of (user, first index into row_order, row count <= kAttentionTileRows).
  at::Tensor row_order;       // [N] int64
  at::Tensor tiles;           // [T, 3] int64
  int64_t max_row_keys = 0;   // the most cached keys any row reads
  int64_t max_tile_rows = 0;  // the most rows of any tile
};

// Rows per attention tile at most (one user's rows; the CUDA kernel's block: a user with the
// reference shape's 164 new rows fits one, so its cached keys are read once per head).
constexpr int64_t kAttentionTileRows = 192;

// Cuts one user's `count` rows, at indices [first, first + count) of row_order, into tiles of at
// most tile_rows rows: emit(start, rows) for each, in order. Every plan tiles its rows this way.
template <typename F>
void for_each_tile(int64_t first, int64_t count, int64_t tile_rows, const F& emit) {
  for (int64_t start = 0; start < count; start += tile_rows) emit(first + start, std::min(tile_rows, count - start));
}

// Rows grouped by user (stable) and cut into tiles of at most tile_rows rows of one user:
// (row_order, tiles as flat (user, first index into row_order, count) triples).
std::pair<std::vector<int64_t>, std::vector<int64_t>> user_tiles(const std::vector<int64_t>& row_user,
                                                                 int64_t tile_rows);

// The most rows of any tile of user_tiles' flat triples (0 without tiles).
int64_t widest_tile(const std::vector<int64_t>& tiles);

// A step program's plan (docs/design.md 3.9): the rows of build_plan_tensors padded to a bucket,
// so that one captured CUDA graph serves every batch of that bucket. Sizes of its parts, in the
// order they lie in StepPlan::staged.
struct StepLayout {
  int64_t candidate_rows = 0;  // Tp: candidate rows, the batch's real ones first
  int64_t prefix_rows = 0;     // Np: new prefix rows, the batch's real ones first
  int64_t users = 0;           // Bp: rows of the page table
  int64_t pages_per_user = 0;  // its columns
  int64_t tiles = 0;           // TT: attention tiles, the real ones first, then empty ones
  // (enough for any batch of the bucket)
  int64_t real_candidates = 0;  // T: the leading candidate rows that are the batch's
  int64_t rows() const { return candidate_rows + prefix_rows; }
  // int64 parts of StepPlan::staged, each at its offset: candidate ids and positions [Tp] each,
  // new token ids and positions [Np] each, page_table [Bp, pages_per_user], row_user, row_keys,
  // row_candidate [R] each, write_slots, value_slots [Np] each, row_order [R], tiles [TT, 3].
  std::vector<int64_t> sizes() const {
    const int64_t t = candidate_rows, n = prefix_rows, r = rows();
    return {t, t, n, n, users * pages_per_user, r, r, r, n, n, r, 3 * tiles};
  }
  // Where each part starts: every part on a 16-byte boundary (kStepAlign values), as AOTInductor
  // compiles a program's inputs to expect; an input off it is copied on every run.
  static constexpr int64_t kStepAlign = 2;
  std::vector<int64_t> offsets() const {
    std::vector<int64_t> starts;
    int64_t next = 0;
    for (auto size : sizes()) {
      starts.push_back(next);
      next += (size + kStepAlign - 1) / kStepAlign * kStepAlign;
    }
    return starts;
  }
  int64_t numel() const {
    int64_t total = 0;
    for (auto size : sizes()) total += (size + kStepAlign - 1) / kStepAlign * kStepAlign;
    return total;
  }
  // As begin_step returns it, and back: the sizes, then kStepAlign, so that a host never splits a
  // buffer of an op library that aligns its parts otherwise (before kStepAlign, none did).
  std::vector<int64_t> to_vector() const {
    return {candidate_rows, prefix_rows, users, pages_per_user, tiles, real_candidates, kStepAlign};
  }
  static StepLayout from_vector(const std::vector<int64_t>& v) {
    if (v.size() != 7 || v[6] != kStepAlign) {
      throw std::invalid_argument("begin_step's layout is not this version's (" + std::to_string(v.size()) +
                                  " values): the op library was built from other kvexport sources");
    }
    return {v[0], v[1], v[2], v[3], v[4], v[5]};
  }
};

// The fewest candidate rows and prefix rows of a step program's bucket (neither is ever 0 or 1).
constexpr int64_t kMinStepRows = 16;

// The bucket a size is padded to: at least `floor`, then 2^k and the three quarter steps between
// 2^k and 2^(k+1) (so at most a quarter of the rows are padding).
int64_t bucket_size(int64_t size, int64_t floor);

struct StepPlan {
  at::Tensor staged;  // [layout.numel()] int64 on the host (pinned for a GPU runtime)
  StepLayout layout;
};

// The step program's inputs and plan for the batch begin_batch planned (plan's user_ids and
// cached_lengths; user_pages as in build_plan_tensors), padded to buckets (bucket_size: at least
// 16 rows of each kind, the page table max_pages_per_user wide). Padding rows read no keys, belong to no tile and write
// their k/v to `trash_slot` (a slot of a page no user owns). candidate_ids [T] are the batch's candidates; token_ids
// its prefix tokens. Sets plan's row counts (real rows).
StepPlan build_step_plan(BatchPlan& plan, const std::vector<const std::vector<int64_t>*>& user_pages,
                         const std::vector<int64_t>& token_lengths, const std::vector<int64_t>& num_candidates,
                         c10::ArrayRef<int64_t> token_ids, c10::ArrayRef<int64_t> candidate_ids, int64_t page_size,
                         int64_t max_pages_per_user, int64_t trash_slot, at::Device device);

// Fills plan's tensors from its user_ids and cached_lengths; user_pages[b] are user b's pages,
// enough for token_lengths[b] tokens. The tensors land on `device` in one copy. Returns, on the
// host, [2, num_new_prefix_rows] int64: each new prefix row's index in the request's token_ids,
// then its position in its user's prefix (the model selects the new tokens with them).
at::Tensor build_plan_tensors(BatchPlan& plan, const std::vector<const std::vector<int64_t>*>& user_pages,
                              const std::vector<int64_t>& token_lengths, const std::vector<int64_t>& num_candidates,
                              int64_t page_size, at::Device device);

}  // namespace kvexport::runtime
