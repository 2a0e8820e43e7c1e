#include "runtime/batch_plan.h"

#include "runtime/staging.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <numeric>

namespace kvexport::runtime {

std::pair<std::vector<int64_t>, std::vector<int64_t>> user_tiles(const std::vector<int64_t>& row_user,
                                                                 int64_t tile_rows) {
  std::vector<int64_t> row_order(row_user.size());
  std::iota(row_order.begin(), row_order.end(), 0);
  std::stable_sort(row_order.begin(), row_order.end(),
                   [&](int64_t a, int64_t b) { return row_user[a] < row_user[b]; });
  std::vector<int64_t> tiles;
  for (size_t first = 0; first < row_order.size();) {
    const int64_t user = row_user[row_order[first]];
    size_t end = first;
    while (end < row_order.size() && row_user[row_order[end]] == user &&
           static_cast<int64_t>(end - first) < tile_rows) {
      ++end;
    }
    tiles.insert(tiles.end(), {user, static_cast<int64_t>(first), static_cast<int64_t>(end - first)});
    first = end;
  }
  return {std::move(row_order), std::move(tiles)};
}

int64_t widest_tile(const std::vector<int64_t>& tiles) {
  int64_t widest = 0;
  for (size_t i = 2; i < tiles.size(); i += 3) widest = std::max(widest, tiles[i]);
  return widest;
}

at::Tensor build_plan_tensors(BatchPlan& plan, const std::vector<const std::vector<int64_t>*>& user_pages,
                        const std::vector<int64_t>& token_lengths, const std::vector<int64_t>& num_candidates,
                        int64_t page_size, at::Device device) {
  const auto num_users = static_cast<int64_t>(plan.user_ids.size());
  int64_t max_pages = 1;
  for (auto length : token_lengths) max_pages = std::max(max_pages, (length + page_size - 1) / page_size);
  std::vector<int64_t> page_table(num_users * max_pages, 0);
  std::vector<int64_t> row_user, row_keys, write_slots;
  std::vector<uint8_t> row_candidate;
  for (int64_t b = 0; b < num_users; ++b) {
    const auto& pages = *user_pages[b];
    std::copy(pages.begin(), pages.end(), page_table.begin() + b * max_pages);
    for (int64_t t = 0; t < num_candidates[b]; ++t) {
      row_user.push_back(b);
      row_keys.push_back(token_lengths[b]);
      row_candidate.push_back(1);
    }
  }
  plan.num_candidate_rows = static_cast<int64_t>(row_user.size());
  int64_t num_new = 0;
  for (int64_t b = 0; b < num_users; ++b) num_new += token_lengths[b] - plan.cached_lengths[b];
  // On the host, where the model selects the new tokens: their index, then their positions.
  auto new_tokens = at::empty({2, num_new}, at::kLong);
  int64_t* new_index = new_tokens.data_ptr<int64_t>();
  int64_t* new_position = new_index + num_new;
  for (int64_t b = 0, first_token = 0; b < num_users; first_token += token_lengths[b++]) {
    const auto& pages = *user_pages[b];
    for (int64_t p = plan.cached_lengths[b]; p < token_lengths[b]; ++p) {
      row_user.push_back(b);
      row_keys.push_back(p + 1);
      row_candidate.push_back(0);
      write_slots.push_back(pages[p / page_size] * 2 * page_size + p % page_size);
      *new_index++ = first_token + p;
      *new_position++ = p;
    }
  }
  plan.num_new_prefix_rows = static_cast<int64_t>(write_slots.size());
  plan.max_row_keys = row_keys.empty() ? 0 : *std::max_element(row_keys.begin(), row_keys.end());
  const auto [row_order, tiles] = user_tiles(row_user, kAttentionTileRows);
  plan.max_tile_rows = widest_tile(tiles);
  // One host-to-device copy per request, from a staging buffer: every per-request device tensor is
  // a view of one buffer.
  std::vector<int64_t> value_slots(write_slots);
  for (auto& slot : value_slots) slot += page_size;  // a page holds its k rows, then its v rows
  const std::vector<const std::vector<int64_t>*> parts = {
      &page_table, &row_user, &row_keys, &write_slots, &value_slots, &row_order, &tiles};
  int64_t total = static_cast<int64_t>(row_candidate.size());
  for (const auto* part : parts) total += static_cast<int64_t>(part->size());
  auto host = staging_buffer(total, device);
  int64_t* cursor = host.data_ptr<int64_t>();
  for (const auto* part : parts) cursor = std::copy(part->begin(), part->end(), cursor);
  std::copy(row_candidate.begin(), row_candidate.end(), cursor);
  const auto uploaded = host.to(device, /*non_blocking=*/true);
  int64_t offset = 0;
  const auto next = [&](size_t count) {
    auto view = uploaded.narrow(0, offset, static_cast<int64_t>(count));
    offset += static_cast<int64_t>(count);
    return view;
  };
  plan.page_table = next(page_table.size()).view({num_users, max_pages});
  plan.row_user = next(row_user.size());
  plan.row_keys = next(row_keys.size());
  plan.write_slots = next(write_slots.size());
  plan.value_slots = next(value_slots.size());
  plan.row_order = next(row_order.size());
  plan.tiles = next(tiles.size()).view({-1, 3});
  plan.row_candidate = next(row_candidate.size()).ne(0);
  return new_tokens;
}

}  // namespace kvexport::runtime
