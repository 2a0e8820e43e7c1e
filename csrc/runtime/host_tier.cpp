#include "runtime/host_tier.h"

namespace kvexport::runtime {

HostTier::HostTier(int64_t capacity_pages, bool pin_memory)
    : capacity_pages_(capacity_pages), pin_memory_(pin_memory) {}

std::vector<HeldUser> HostTier::put(int64_t user_id, OffloadedUser user) {
  take(user_id);  // a newer copy replaces an older one
  std::vector<HeldUser> let_go;
  const int64_t pages = user.num_pages();
  if (pages > capacity_pages_) {
    let_go.emplace_back(user_id, std::move(user));  // can never fit
    return let_go;
  }
  while (used_pages_ + pages > capacity_pages_) {
    used_pages_ -= lru_.front().second.num_pages();
    index_.erase(lru_.front().first);
    let_go.push_back(std::move(lru_.front()));
    lru_.pop_front();
  }
  if (pin_memory_ && user.pages.defined() && !user.pages.is_pinned()) {
    user.pages = user.pages.pin_memory();
  }
  user.source = TierKind::kHost;
  used_pages_ += pages;
  lru_.emplace_back(user_id, std::move(user));
  index_[user_id] = std::prev(lru_.end());
  return let_go;
}

std::optional<OffloadedUser> HostTier::take(int64_t user_id) {
  auto it = index_.find(user_id);
  if (it == index_.end()) {
    return std::nullopt;
  }
  OffloadedUser user = std::move(it->second->second);
  used_pages_ -= user.num_pages();
  lru_.erase(it->second);
  index_.erase(it);
  return user;
}

std::optional<int64_t> HostTier::num_tokens(int64_t user_id) const {
  auto it = index_.find(user_id);
  if (it == index_.end()) return std::nullopt;
  return static_cast<int64_t>(it->second->second.token_ids.size());
}

void HostTier::clear() {
  lru_.clear();
  index_.clear();
  used_pages_ = 0;
}

}  // namespace kvexport::runtime
