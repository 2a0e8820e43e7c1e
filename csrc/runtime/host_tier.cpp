#include "runtime/host_tier.h"

namespace kvexport::runtime {

HostTier::HostTier(int64_t capacity_pages, bool pin_memory)
    : capacity_pages_(capacity_pages), pin_memory_(pin_memory) {}

int64_t HostTier::put(int64_t user_id, OffloadedUser user) {
  take(user_id);  // a newer copy replaces an older one
  const int64_t pages = user.num_pages();
  if (pages > capacity_pages_) {
    return 1;  // can never fit: dropped
  }
  int64_t evicted = 0;
  while (used_pages_ + pages > capacity_pages_) {
    used_pages_ -= lru_.front().second.num_pages();
    index_.erase(lru_.front().first);
    lru_.pop_front();
    ++evicted;
  }
  if (pin_memory_ && user.pages.defined() && !user.pages.is_pinned()) {
    user.pages = user.pages.pin_memory();
  }
  used_pages_ += pages;
  lru_.emplace_back(user_id, std::move(user));
  index_[user_id] = std::prev(lru_.end());
  return evicted;
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
