#include "runtime/batch_plan.h"

#include "runtime/staging.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <numeric>
#include <stdexcept>
#include <string>

namespace kvexport::runtime {

std::pair<std::vector<int64_t>, std::vector<int64_t>> user_tiles(const std::vector<int64_t>& row_user,
                                                                 int64_t tile_rows) {
  // A counting sort: users are batch indices, so each user's rows start at the count of rows of
  // the users before it, and keep their order.
  int64_t num_users = 0;
  for (auto user : row_user) {
    if (user < 0) throw std::invalid_argument("user_tiles: negative batch index " + std::to_string(user));
    num_users = std::max(num_users, user + 1);
  }
  std::vector<int64_t> first(num_users + 1, 0);
  for (auto user : row_user) ++first[user + 1];
  std::partial_sum(first.begin(), first.end(), first.begin());
  std::vector<int64_t> row_order(row_user.size());
  std::vector<int64_t> next(first.begin(), first.end() - 1);
  for (size_t row = 0; row < row_user.size(); ++row) row_order[next[row_user[row]]++] = static_cast<int64_t>(row);
  std::vector<int64_t> tiles;
  for (int64_t user = 0; user < num_users; ++user) {
    for_each_tile(first[user], first[user + 1] - first[user], tile_rows, [&](int64_t start, int64_t count) {
      tiles.insert(tiles.end(), {user, start, count});
    });
  }
  return {std::move(row_order), std::move(tiles)};
}

int64_t widest_tile(const std::vector<int64_t>& tiles) {
  int64_t widest = 0;
  for (size_t i = 2; i < tiles.size(); i += 3) widest = std::max(widest, tiles[i]);
  return widest;
}

namespace {

// A batch's new rows in the runtime's order: its candidates (users in batch order) at row indices
// [0, candidates), its uncached prefix tokens from `prefix_first` (a step program pads the
// candidates to a bucket first). Both plan builders write them with write_rows.
struct RowCounts {
  int64_t candidates = 0, prefix = 0;  // real rows of each kind
  int64_t max_pages = 0;               // the page table's columns
  int64_t tiles = 0;                   // of the real rows, at most kAttentionTileRows rows of one user each
};

// Counts the batch's rows and sets the plan's counts (real rows, the most keys a row reads).
RowCounts count_rows(BatchPlan& plan, const std::vector<int64_t>& token_lengths,
                     const std::vector<int64_t>& num_candidates, int64_t page_size, int64_t min_pages) {
  RowCounts c;
  c.max_pages = min_pages;
  int64_t max_keys = 0;
  for (size_t b = 0; b < plan.user_ids.size(); ++b) {
    const int64_t rows = num_candidates[b] + token_lengths[b] - plan.cached_lengths[b];
    c.max_pages = std::max(c.max_pages, (token_lengths[b] + page_size - 1) / page_size);
    c.candidates += num_candidates[b];
    c.prefix += token_lengths[b] - plan.cached_lengths[b];
    for_each_tile(0, rows, kAttentionTileRows, [&](int64_t, int64_t) { ++c.tiles; });  // write_rows' tiles
    // Candidates read the whole prefix, and no prefix row reads more.
    if (rows > 0) max_keys = std::max(max_keys, token_lengths[b]);
  }
  plan.num_candidate_rows = c.candidates;
  plan.num_new_prefix_rows = c.prefix;
  plan.max_row_keys = max_keys;
  return c;
}

// Where write_rows puts each part, row parts indexed by row. candidate_positions, new_token_ids
// and new_token_index may be null (one plan has no use for them); every other part is written.
struct RowParts {
  int64_t prefix_first = 0;                // row index of the first new prefix row
  int64_t* page_table = nullptr;           // [B, max_pages]
  int64_t* candidate_positions = nullptr;  // [candidates]: the user's prefix length
  int64_t* new_token_ids = nullptr;        // [prefix]: the token of each new prefix row
  int64_t* new_token_index = nullptr;      // [prefix]: its index in the request's token_ids
  int64_t* new_positions = nullptr;        // [prefix]: its position in its user's prefix
  int64_t *row_user = nullptr, *row_keys = nullptr, *row_candidate = nullptr;
  int64_t *write_slots = nullptr, *value_slots = nullptr;  // [prefix]
  int64_t *row_order = nullptr, *tiles = nullptr;          // the real rows grouped by user; [tiles, 3]
};

// One pass over each user's rows. Returns the most rows of any tile.
int64_t write_rows(const BatchPlan& plan, const std::vector<const std::vector<int64_t>*>& user_pages,
                   const std::vector<int64_t>& token_lengths, const std::vector<int64_t>& num_candidates,
                   c10::ArrayRef<int64_t> token_ids, int64_t page_size, const RowCounts& counts, const RowParts& out) {
  int64_t candidate = 0, row = 0, order = 0, tile = 0, widest = 0;
  for (int64_t b = 0, first_token = 0; b < static_cast<int64_t>(plan.user_ids.size());
       first_token += token_lengths[b++]) {
    const auto& pages = *user_pages[b];
    std::copy(pages.begin(), pages.end(), out.page_table + b * counts.max_pages);
    const int64_t length = token_lengths[b], user_first = order;
    for (int64_t t = 0; t < num_candidates[b]; ++t, ++candidate) {
      if (out.candidate_positions) out.candidate_positions[candidate] = length;
      out.row_user[candidate] = b;
      out.row_keys[candidate] = length;
      out.row_candidate[candidate] = 1;
      out.row_order[order++] = candidate;
    }
    for (int64_t p = plan.cached_lengths[b]; p < length; ++p, ++row) {
      const int64_t slot = pages[p / page_size] * 2 * page_size + p % page_size;
      const int64_t index = out.prefix_first + row;
      if (out.new_token_ids) out.new_token_ids[row] = token_ids[first_token + p];
      if (out.new_token_index) out.new_token_index[row] = first_token + p;
      out.new_positions[row] = p;
      out.row_user[index] = b;
      out.row_keys[index] = p < plan.context_rows_see_prefix ? length : p + 1;
      out.row_candidate[index] = 0;
      out.write_slots[row] = slot;
      out.value_slots[row] = slot + page_size;  // a page holds its k rows, then its v rows
      out.row_order[order++] = index;
    }
    for_each_tile(user_first, order - user_first, kAttentionTileRows, [&](int64_t start, int64_t count) {
      out.tiles[3 * tile] = b;
      out.tiles[3 * tile + 1] = start;
      out.tiles[3 * tile + 2] = count;
      widest = std::max(widest, count);
      ++tile;
    });
  }
  return widest;
}

}  // namespace

int64_t bucket_size(int64_t size, int64_t floor) {
  if (size <= floor) return floor;
  int64_t octave = floor;
  while (octave * 2 < size) octave *= 2;
  const int64_t step = std::max<int64_t>(1, octave / 4);
  return (size + step - 1) / step * step;
}

StepPlan build_step_plan(BatchPlan& plan, const std::vector<const std::vector<int64_t>*>& user_pages,
                         const std::vector<int64_t>& token_lengths, const std::vector<int64_t>& num_candidates,
                         c10::ArrayRef<int64_t> token_ids, c10::ArrayRef<int64_t> candidate_ids, int64_t page_size,
                         int64_t max_pages_per_user, int64_t trash_slot, at::Device device) {
  const auto counts = count_rows(plan, token_lengths, num_candidates, page_size, max_pages_per_user);
  StepLayout layout;
  layout.real_candidates = counts.candidates;
  layout.candidate_rows = bucket_size(counts.candidates, kMinStepRows);
  layout.prefix_rows = bucket_size(counts.prefix, kMinStepRows);
  layout.users = bucket_size(static_cast<int64_t>(plan.user_ids.size()), 1);
  layout.pages_per_user = counts.max_pages;
  // Every batch of the bucket fits: a tile ends at a user's last row or after kAttentionTileRows.
  layout.tiles = (layout.rows() + kAttentionTileRows - 1) / kAttentionTileRows + layout.users;

  // The parts are written in place; padding rows stay 0 (they read no keys and belong to no tile)
  // but write their k/v to `trash_slot`, and come last in row_order.
  StepPlan step{staging_buffer(layout.numel(), device), layout};
  int64_t* const buffer = step.staged.data_ptr<int64_t>();
  std::fill_n(buffer, layout.numel(), 0);
  const auto offsets = layout.offsets();
  const auto part = [&](int index) { return buffer + offsets[index]; };
  RowParts out;
  out.prefix_first = layout.candidate_rows;
  out.candidate_positions = part(1);
  out.new_token_ids = part(2);
  out.new_positions = part(3);
  out.page_table = part(4);
  out.row_user = part(5);
  out.row_keys = part(6);
  out.row_candidate = part(7);
  out.write_slots = part(8);
  out.value_slots = part(9);
  out.row_order = part(10);
  out.tiles = part(11);
  std::copy(candidate_ids.begin(), candidate_ids.end(), part(0));
  write_rows(plan, user_pages, token_lengths, num_candidates, token_ids, page_size, counts, out);
  std::fill(out.write_slots + counts.prefix, out.write_slots + layout.prefix_rows, trash_slot);
  std::fill(out.value_slots + counts.prefix, out.value_slots + layout.prefix_rows, trash_slot + page_size);
  int64_t* order = out.row_order + counts.candidates + counts.prefix;
  for (int64_t i = counts.candidates; i < layout.candidate_rows; ++i) *order++ = i;
  for (int64_t i = layout.candidate_rows + counts.prefix; i < layout.rows(); ++i) *order++ = i;
  return step;
}

at::Tensor build_plan_tensors(BatchPlan& plan, const std::vector<const std::vector<int64_t>*>& user_pages,
                              const std::vector<int64_t>& token_lengths, const std::vector<int64_t>& num_candidates,
                              int64_t page_size, at::Device device) {
  const auto num_users = static_cast<int64_t>(plan.user_ids.size());
  const auto counts = count_rows(plan, token_lengths, num_candidates, page_size, 1);
  const int64_t rows = counts.candidates + counts.prefix, prefix = counts.prefix;
  // On the host, where the model selects the new tokens: their index, then their positions.
  auto new_tokens = at::empty({2, prefix}, at::kLong);
  // One host-to-device copy per request, from a staging buffer: every per-request device tensor is
  // a view of one buffer.
  const std::vector<int64_t> sizes = {
      num_users * counts.max_pages, rows, rows, prefix, prefix, rows, 3 * counts.tiles, rows};
  std::vector<int64_t> offsets(sizes.size() + 1, 0);
  std::partial_sum(sizes.begin(), sizes.end(), offsets.begin() + 1);
  auto host = staging_buffer(offsets.back(), device);
  int64_t* const buffer = host.data_ptr<int64_t>();
  std::fill_n(buffer, sizes[0], 0);  // the page table's unused columns
  RowParts out;
  out.prefix_first = counts.candidates;
  out.page_table = buffer + offsets[0];
  out.row_user = buffer + offsets[1];
  out.row_keys = buffer + offsets[2];
  out.write_slots = buffer + offsets[3];
  out.value_slots = buffer + offsets[4];
  out.row_order = buffer + offsets[5];
  out.tiles = buffer + offsets[6];
  out.row_candidate = buffer + offsets[7];
  out.new_token_index = new_tokens.data_ptr<int64_t>();
  out.new_positions = out.new_token_index + prefix;
  plan.max_tile_rows = write_rows(plan, user_pages, token_lengths, num_candidates, {}, page_size, counts, out);
  const auto uploaded = host.to(device, /*non_blocking=*/true);
  const auto view = [&](int index) { return uploaded.narrow(0, offsets[index], sizes[index]); };
  plan.page_table = view(0).view({num_users, counts.max_pages});
  plan.row_user = view(1);
  plan.row_keys = view(2);
  plan.write_slots = view(3);
  plan.value_slots = view(4);
  plan.row_order = view(5);
  plan.tiles = view(6).view({-1, 3});
  plan.row_candidate = view(7).ne(0);
  return new_tokens;
}

}  // namespace kvexport::runtime
