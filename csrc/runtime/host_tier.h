// The host tier: host RAM (pinned memory when the device tier is CUDA), with its own page
// capacity and LRU. What it evicts goes on down the tier chain.
#pragma once

#include <cstdint>
#include <list>
#include <optional>
#include <unordered_map>
#include <vector>

#include "runtime/offload_tier.h"

namespace kvexport::runtime {

class HostTier final : public OffloadTier {
 public:
  HostTier(int64_t capacity_pages, bool pin_memory);
  std::vector<HeldUser> put(int64_t user_id, OffloadedUser user) override;
  std::optional<OffloadedUser> take(int64_t user_id) override;
  std::optional<int64_t> num_tokens(int64_t user_id) const override;
  int64_t used_pages() const override { return used_pages_; }
  int64_t num_users() const override { return static_cast<int64_t>(lru_.size()); }
  void clear() override;

 private:
  int64_t capacity_pages_;
  bool pin_memory_;
  int64_t used_pages_ = 0;
  std::list<HeldUser> lru_;  // front = least recently stored
  std::unordered_map<int64_t, std::list<HeldUser>::iterator> index_;
};

}  // namespace kvexport::runtime
