// Offload tiers: where users evicted from the device tier go, and come back from on a hit.
// `OffloadTier` is the seam for a remote tier (a distributed KV store) later.
#pragma once

#include <ATen/Tensor.h>
#include <c10/core/Event.h>

#include <cstdint>
#include <list>
#include <memory>
#include <optional>
#include <unordered_map>
#include <vector>

namespace kvexport::runtime {

// One user's cache outside the device tier.
struct OffloadedUser {
  std::vector<int64_t> token_ids;  // tokens the k/v were computed from
  at::Tensor pages;                // [layers, num_pages, 2, page_size, heads, head_dim] on the host
  // Set while `pages` may still be arriving from a CUDA device: recorded on the copy stream after
  // the device-to-host copy. A stream that reads `pages` waits for it first.
  std::shared_ptr<c10::Event> ready;
  int64_t num_pages() const { return pages.defined() ? pages.size(1) : 0; }
};

class OffloadTier {
 public:
  virtual ~OffloadTier() = default;
  // Stores a user; returns how many users were evicted to make room (the stored user itself
  // counts if it can never fit).
  virtual int64_t put(int64_t user_id, OffloadedUser user) = 0;
  // Removes and returns a user, if held.
  virtual std::optional<OffloadedUser> take(int64_t user_id) = 0;
  // Tokens held for a user, without touching its place in the LRU.
  virtual std::optional<int64_t> num_tokens(int64_t user_id) const = 0;
  virtual int64_t used_pages() const = 0;
  virtual int64_t num_users() const = 0;
  virtual void clear() = 0;
};

// Host RAM (pinned memory when the device tier is CUDA), with its own page capacity and LRU.
class HostTier final : public OffloadTier {
 public:
  HostTier(int64_t capacity_pages, bool pin_memory);
  int64_t put(int64_t user_id, OffloadedUser user) override;
  std::optional<OffloadedUser> take(int64_t user_id) override;
  std::optional<int64_t> num_tokens(int64_t user_id) const override;
  int64_t used_pages() const override { return used_pages_; }
  int64_t num_users() const override { return static_cast<int64_t>(lru_.size()); }
  void clear() override;

 private:
  using Entry = std::pair<int64_t, OffloadedUser>;
  int64_t capacity_pages_;
  bool pin_memory_;
  int64_t used_pages_ = 0;
  std::list<Entry> lru_;  // front = least recently stored
  std::unordered_map<int64_t, std::list<Entry>::iterator> index_;
};

}  // namespace kvexport::runtime
