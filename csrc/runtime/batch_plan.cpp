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
    for (int64_t start = first[user]; start < first[user + 1]; start += tile_rows) {
      tiles.insert(tiles.end(), {user, start, std::min(tile_rows, first[user + 1] - start)});
    }
  }
  return {std::move(row_order), std::move(tiles)};
}

int64_t widest_tile(const std::vector<int64_t>& tiles) {
  int64_t widest = 0;
  for (size_t i = 2; i < tiles.size(); i += 3) widest = std::max(widest, tiles[i]);
  return widest;
}

namespace {

// A batch's new rows in the runtime's order ([candidates of all users][uncached prefix tokens of
// all users], users in batch order), as host vectors.
struct PlanRows {
  int64_t max_pages = 1;
  std::vector<int64_t> page_table;  // [B, max_pages]
  std::vector<int64_t> row_user, row_keys, row_candidate, write_slots;
  std::vector<int64_t> new_index, new_position;  // of each new prefix row, in the request's tokens
};

PlanRows collect_rows(const BatchPlan& plan, const std::vector<const std::vector<int64_t>*>& user_pages,
                      const std::vector<int64_t>& token_lengths, const std::vector<int64_t>& num_candidates,
                      int64_t page_size, int64_t max_pages) {
  const auto num_users = static_cast<int64_t>(plan.user_ids.size());
  PlanRows r;
  r.max_pages = max_pages;
  for (auto length : token_lengths) r.max_pages = std::max(r.max_pages, (length + page_size - 1) / page_size);
  r.page_table.assign(num_users * r.max_pages, 0);
  for (int64_t b = 0; b < num_users; ++b) {
    const auto& pages = *user_pages[b];
    std::copy(pages.begin(), pages.end(), r.page_table.begin() + b * r.max_pages);
    for (int64_t t = 0; t < num_candidates[b]; ++t) {
      r.row_user.push_back(b);
      r.row_keys.push_back(token_lengths[b]);
      r.row_candidate.push_back(1);
    }
  }
  for (int64_t b = 0, first_token = 0; b < num_users; first_token += token_lengths[b++]) {
    const auto& pages = *user_pages[b];
    for (int64_t p = plan.cached_lengths[b]; p < token_lengths[b]; ++p) {
      r.row_user.push_back(b);
      r.row_keys.push_back(p < plan.context_rows_see_prefix ? token_lengths[b] : p + 1);
      r.row_candidate.push_back(0);
      r.write_slots.push_back(pages[p / page_size] * 2 * page_size + p % page_size);
      r.new_index.push_back(first_token + p);
      r.new_position.push_back(p);
    }
  }
  return r;
}

void count_rows(BatchPlan& plan, const PlanRows& r) {
  plan.num_new_prefix_rows = static_cast<int64_t>(r.write_slots.size());
  plan.num_candidate_rows = static_cast<int64_t>(r.row_user.size()) - plan.num_new_prefix_rows;
  plan.max_row_keys = r.row_keys.empty() ? 0 : *std::max_element(r.row_keys.begin(), r.row_keys.end());
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
                         c10::ArrayRef<int64_t> token_ids, c10::ArrayRef<int64_t> candidate_ids,
                         int64_t page_size, int64_t max_pages_per_user, int64_t trash_slot,
                         at::Device device) {
  // The same rows as collect_rows, written straight into their parts of the staged buffer: each
  // part is one pass over the users, with no intermediate vectors (this runs on every request,
  // serial with the device, before a CUDA graph can be replayed).
  const auto num_users = static_cast<int64_t>(plan.user_ids.size());
  std::vector<int64_t> new_rows(num_users);
  int64_t max_pages = max_pages_per_user, candidates = 0, prefix = 0, max_keys = 0;
  for (int64_t b = 0; b < num_users; ++b) {
    max_pages = std::max(max_pages, (token_lengths[b] + page_size - 1) / page_size);
    new_rows[b] = token_lengths[b] - plan.cached_lengths[b];
    candidates += num_candidates[b];
    prefix += new_rows[b];
    // Candidates read the whole prefix, and no prefix row reads more.
    if (num_candidates[b] > 0 || new_rows[b] > 0) max_keys = std::max(max_keys, token_lengths[b]);
  }
  plan.num_candidate_rows = candidates;
  plan.num_new_prefix_rows = prefix;
  plan.max_row_keys = max_keys;

  StepLayout layout;
  layout.real_candidates = candidates;
  layout.candidate_rows = bucket_size(candidates, kMinStepRows);
  layout.prefix_rows = bucket_size(prefix, kMinStepRows);
  layout.users = bucket_size(num_users, 1);
  layout.pages_per_user = max_pages;
  // Every batch of the bucket fits: a tile ends at a user's last row or after kAttentionTileRows.
  layout.tiles = (layout.rows() + kAttentionTileRows - 1) / kAttentionTileRows + layout.users;

  StepPlan step{staging_buffer(layout.numel(), device), layout};
  int64_t* const buffer = step.staged.data_ptr<int64_t>();
  std::fill_n(buffer, layout.numel(), 0);  // padding and the gaps between parts
  const auto offsets = layout.offsets();
  const auto part = [&](int index) { return buffer + offsets[index]; };
  const int64_t tp = layout.candidate_rows;  // a prefix row's index in the row parts is tp + its index
  int64_t *cand_ids = part(0), *cand_pos = part(1), *new_ids = part(2), *new_pos = part(3);
  int64_t *page_table = part(4), *row_user = part(5), *row_keys = part(6), *row_candidate = part(7);
  int64_t *write_slots = part(8), *value_slots = part(9), *row_order = part(10), *tiles = part(11);

  std::copy(candidate_ids.begin(), candidate_ids.end(), cand_ids);
  std::fill(write_slots + prefix, write_slots + layout.prefix_rows, trash_slot);
  std::fill(value_slots + prefix, value_slots + layout.prefix_rows, trash_slot + page_size);
  int64_t cand = 0, row = 0, order = 0, tile = 0;
  for (int64_t b = 0, first_token = 0; b < num_users; first_token += token_lengths[b++]) {
    const auto& pages = *user_pages[b];
    std::copy(pages.begin(), pages.end(), page_table + b * max_pages);
    const int64_t length = token_lengths[b], user_first = order;
    for (int64_t t = 0; t < num_candidates[b]; ++t, ++cand) {
      cand_pos[cand] = length;
      row_user[cand] = b;
      row_keys[cand] = length;
      row_candidate[cand] = 1;
      row_order[order++] = cand;
    }
    for (int64_t p = plan.cached_lengths[b]; p < length; ++p, ++row) {
      const int64_t slot = pages[p / page_size] * 2 * page_size + p % page_size;
      new_ids[row] = token_ids[first_token + p];
      new_pos[row] = p;
      row_user[tp + row] = b;
      row_keys[tp + row] = p < plan.context_rows_see_prefix ? length : p + 1;
      write_slots[row] = slot;
      value_slots[row] = slot + page_size;  // a page holds its k rows, then its v rows
      row_order[order++] = tp + row;
    }
    for (int64_t start = 0; start < order - user_first; start += kAttentionTileRows, ++tile) {
      tiles[3 * tile] = b;
      tiles[3 * tile + 1] = user_first + start;
      tiles[3 * tile + 2] = std::min(kAttentionTileRows, order - user_first - start);
    }
  }
  // The padding rows, after the real ones: candidates', then prefix rows'.
  for (int64_t i = candidates; i < tp; ++i) row_order[order++] = i;
  for (int64_t i = tp + prefix; i < layout.rows(); ++i) row_order[order++] = i;
  return step;
}

at::Tensor build_plan_tensors(BatchPlan& plan, const std::vector<const std::vector<int64_t>*>& user_pages,
                        const std::vector<int64_t>& token_lengths, const std::vector<int64_t>& num_candidates,
                        int64_t page_size, at::Device device) {
  const auto num_users = static_cast<int64_t>(plan.user_ids.size());
  const auto r = collect_rows(plan, user_pages, token_lengths, num_candidates, page_size, 1);
  count_rows(plan, r);
  const auto num_new = plan.num_new_prefix_rows;
  // On the host, where the model selects the new tokens: their index, then their positions.
  auto new_tokens = at::empty({2, num_new}, at::kLong);
  std::copy(r.new_index.begin(), r.new_index.end(), new_tokens.data_ptr<int64_t>());
  std::copy(r.new_position.begin(), r.new_position.end(), new_tokens.data_ptr<int64_t>() + num_new);
  const auto [row_order, tiles] = user_tiles(r.row_user, kAttentionTileRows);
  plan.max_tile_rows = widest_tile(tiles);
  // One host-to-device copy per request, from a staging buffer: every per-request device tensor is
  // a view of one buffer.
  std::vector<int64_t> value_slots(r.write_slots);
  for (auto& slot : value_slots) slot += page_size;  // a page holds its k rows, then its v rows
  const std::vector<const std::vector<int64_t>*> parts = {
      &r.page_table, &r.row_user, &r.row_keys, &r.write_slots, &value_slots, &row_order, &tiles, &r.row_candidate};
  int64_t total = 0;
  for (const auto* part : parts) total += static_cast<int64_t>(part->size());
  auto host = staging_buffer(total, device);
  int64_t* cursor = host.data_ptr<int64_t>();
  for (const auto* part : parts) cursor = std::copy(part->begin(), part->end(), cursor);
  const auto uploaded = host.to(device, /*non_blocking=*/true);
  int64_t offset = 0;
  const auto next = [&](size_t count) {
    auto view = uploaded.narrow(0, offset, static_cast<int64_t>(count));
    offset += static_cast<int64_t>(count);
    return view;
  };
  plan.page_table = next(r.page_table.size()).view({num_users, r.max_pages});
  plan.row_user = next(r.row_user.size());
  plan.row_keys = next(r.row_keys.size());
  plan.write_slots = next(r.write_slots.size());
  plan.value_slots = next(value_slots.size());
  plan.row_order = next(row_order.size());
  plan.tiles = next(tiles.size()).view({-1, 3});
  plan.row_candidate = next(r.row_candidate.size()).ne(0);
  return new_tokens;
}

}  // namespace kvexport::runtime
