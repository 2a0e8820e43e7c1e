// The plan of one batch: where each new row's k/v goes and which cached keys it reads, as the
// attention kernels take it. Built from the users' page lists; knows nothing of tiers or eviction.
#pragma once

#include <ATen/Tensor.h>

#include <cstdint>
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
  std::vector<int64_t> cached_lengths;  // reused prefix per user
  std::vector<std::vector<int64_t>> uncached_tokens;  // each user's tokens after its cached prefix
  int64_t num_candidate_rows = 0;
  int64_t num_new_prefix_rows = 0;
  // On the cache's device:
  at::Tensor page_table;     // [B, max_pages] int64, page of each user's j-th page slot
  at::Tensor row_user;       // [N] int64, batch index of each new row
  at::Tensor row_keys;       // [N] int64, cached keys a row reads: position + 1, or the prefix length
  at::Tensor row_candidate;  // [N] bool, true for candidate rows (they also read themselves)
  at::Tensor write_slots;    // [num_new_prefix_rows] int64, slot of each new prefix row in a layer's
                             // cache viewed as [pages * 2 * page_size, heads, head_dim] (k; v is +page_size)
  at::Tensor value_slots;    // [num_new_prefix_rows] int64, write_slots + page_size: where the v rows go
  // For kernels that work on tiles of one user's rows (CUDA): rows grouped by user, and tiles
  // [T, 3] int64 of (user, first index into row_order, row count <= kAttentionTileRows).
  at::Tensor row_order;  // [N] int64
  at::Tensor tiles;      // [T, 3] int64
  int64_t max_row_keys = 0;   // the most cached keys any row reads
  int64_t max_tile_rows = 0;  // the most rows of any tile
};

// Rows per attention tile at most (one user's rows; the CUDA kernel's block: a user with the
// reference shape's 164 new rows fits one, so its cached keys are read once per head).
constexpr int64_t kAttentionTileRows = 192;

// Rows grouped by user (stable) and cut into tiles of at most tile_rows rows of one user:
// (row_order, tiles as flat (user, first index into row_order, count) triples).
std::pair<std::vector<int64_t>, std::vector<int64_t>> user_tiles(const std::vector<int64_t>& row_user,
                                                                 int64_t tile_rows);

// The most rows of any tile of user_tiles' flat triples (0 without tiles).
int64_t widest_tile(const std::vector<int64_t>& tiles);

// Fills plan's tensors from its user_ids and cached_lengths; user_pages[b] are user b's pages,
// enough for token_lengths[b] tokens. The tensors land on `device` in one copy. Returns, on the
// host, [2, num_new_prefix_rows] int64: each new prefix row's index in the request's token_ids,
// then its position in its user's prefix (the model selects the new tokens with them).
at::Tensor build_plan_tensors(BatchPlan& plan, const std::vector<const std::vector<int64_t>*>& user_pages,
                        const std::vector<int64_t>& token_lengths, const std::vector<int64_t>& num_candidates,
                        int64_t page_size, at::Device device);

}  // namespace kvexport::runtime
