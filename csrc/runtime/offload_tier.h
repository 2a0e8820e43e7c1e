// Offload tiers: where users evicted from the device tier go, and come back from on a hit.
// Tiers form a chain behind the device tier (host, then remote): what one tier lets go is handed
// to the next, and a lookup asks them in order. A tier is a plug-in: the chain knows only this
// interface.
#pragma once

#include <ATen/Tensor.h>
#include <c10/core/Event.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "runtime/counters.h"

namespace kvexport::runtime {

enum class TierKind { kHost, kRemote };

// One user's cache outside the device tier.
struct OffloadedUser {
  std::vector<int64_t> token_ids;  // tokens the k/v were computed from
  at::Tensor pages;                // [layers, num_pages, 2, page_size, heads, head_dim] on the host
  // Set while `pages` may still be arriving from a CUDA device: recorded on the copy stream after
  // the device-to-host copy. A stream that reads `pages` waits for it first.
  std::shared_ptr<c10::Event> ready;
  TierKind source = TierKind::kHost;  // the tier it came back from
  int64_t num_pages() const { return pages.defined() ? pages.size(1) : 0; }
};

using HeldUser = std::pair<int64_t, OffloadedUser>;

class OffloadTier {
 public:
  virtual ~OffloadTier() = default;
  // Stores a user; returns the users let go to make room (the stored user itself if it can never
  // fit), for the next tier.
  virtual std::vector<HeldUser> put(int64_t user_id, OffloadedUser user) = 0;
  // Removes and returns a user, if held (a shared tier keeps its copy).
  virtual std::optional<OffloadedUser> take(int64_t user_id) = 0;
  // take() of several users; a tier behind a network asks for them in one round trip.
  virtual std::vector<std::optional<OffloadedUser>> take_many(const std::vector<int64_t>& user_ids);
  // Tokens held for a user, without touching its place in the LRU (local tiers only).
  virtual std::optional<int64_t> num_tokens(int64_t user_id) const = 0;
  virtual int64_t used_pages() const = 0;
  virtual int64_t num_users() const = 0;
  // Empties what this process holds and zeroes the tier's counters.
  virtual void clear() = 0;
  // Whether the runtime also puts each batch's users here when the batch commits.
  virtual bool stores_after_batch() const { return false; }
  // A tier behind a network: the runtime reads it ahead of a batch, before taking its lock and with
  // Python's GIL released, so a slow read never holds up other requests; take_many may then be
  // called from several threads at once. TierChain::take_many skips it.
  virtual bool is_remote() const { return false; }
  // Waits up to `timeout` for writes still on their way into the tier; true when none is left.
  virtual bool flush(std::chrono::milliseconds /*timeout*/) { return true; }
  virtual void add_counters(Counters&) const {}
};

class TierChain {
 public:
  void append(std::unique_ptr<OffloadTier> tier) { tiers_.push_back(std::move(tier)); }
  bool has(const std::function<bool(const OffloadTier&)>& match) const;
  // Stores a user evicted from the device tier in the first tier; each tier's leftovers go to the
  // next, the last tier's are dropped. Returns how many users the first tier let go.
  int64_t put(int64_t user_id, OffloadedUser user);
  // Each user from the first local tier that has it; a tier is asked only for users the tiers
  // before it lacked. The remote tier is not asked: the runtime reads it ahead.
  std::vector<std::optional<OffloadedUser>> take_many(const std::vector<int64_t>& user_ids);
  std::optional<int64_t> num_tokens(int64_t user_id) const;
  int64_t used_pages() const { return tiers_.empty() ? 0 : tiers_.front()->used_pages(); }
  int64_t num_users() const { return tiers_.empty() ? 0 : tiers_.front()->num_users(); }
  bool stores_after_batch() const;
  // Puts a copy of a committed user into each tier that stores after every batch.
  void store_after_batch(int64_t user_id, const OffloadedUser& user);
  void clear();
  void add_counters(Counters& counters) const;

 private:
  std::vector<std::unique_ptr<OffloadTier>> tiers_;
};

}  // namespace kvexport::runtime
