#include "runtime/offload_tier.h"

namespace kvexport::runtime {

bool TierChain::has(const std::function<bool(const OffloadTier&)>& match) const {
  for (const auto& tier : tiers_) {
    if (match(*tier)) return true;
  }
  return false;
}

int64_t TierChain::put(int64_t user_id, OffloadedUser user) {
  std::vector<HeldUser> moving;
  moving.emplace_back(user_id, std::move(user));
  int64_t first_let_go = 0;
  for (size_t t = 0; t < tiers_.size() && !moving.empty(); ++t) {
    std::vector<HeldUser> let_go;
    for (auto& [id, held] : moving) {
      auto more = tiers_[t]->put(id, std::move(held));
      std::move(more.begin(), more.end(), std::back_inserter(let_go));
    }
    if (t == 0) first_let_go = static_cast<int64_t>(let_go.size());
    moving = std::move(let_go);
  }
  return first_let_go;
}

std::vector<std::optional<OffloadedUser>> OffloadTier::take_many(const std::vector<int64_t>& user_ids) {
  std::vector<std::optional<OffloadedUser>> users;
  for (auto user_id : user_ids) users.push_back(take(user_id));
  return users;
}

std::vector<std::optional<OffloadedUser>> TierChain::take_many(const std::vector<int64_t>& user_ids) {
  std::vector<std::optional<OffloadedUser>> users(user_ids.size());
  for (auto& tier : tiers_) {
    if (tier->is_remote()) continue;
    std::vector<int64_t> wanted;
    std::vector<size_t> slots;
    for (size_t i = 0; i < user_ids.size(); ++i) {
      if (!users[i]) {
        wanted.push_back(user_ids[i]);
        slots.push_back(i);
      }
    }
    if (wanted.empty()) break;
    auto found = tier->take_many(wanted);
    for (size_t j = 0; j < slots.size(); ++j) users[slots[j]] = std::move(found[j]);
  }
  return users;
}

std::optional<int64_t> TierChain::num_tokens(int64_t user_id) const {
  for (const auto& tier : tiers_) {
    if (auto tokens = tier->num_tokens(user_id)) return tokens;
  }
  return std::nullopt;
}

bool TierChain::stores_after_batch() const {
  return has([](const OffloadTier& tier) { return tier.stores_after_batch(); });
}

void TierChain::store_after_batch(int64_t user_id, const OffloadedUser& user) {
  for (auto& tier : tiers_) {
    if (tier->stores_after_batch()) tier->put(user_id, user);
  }
}

void TierChain::clear() {
  for (auto& tier : tiers_) tier->clear();
}

void TierChain::add_counters(Counters& counters) const {
  for (const auto& tier : tiers_) tier->add_counters(counters);
}

}  // namespace kvexport::runtime
