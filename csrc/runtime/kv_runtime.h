// The KV-cache runtime of one model: a paged device tier (page pool + user table), the chain of
// offload tiers behind it, and the batch in flight. Knows nothing of HSTU.
//
// A request is one batch: begin_batch() plans it (prefix reuse, eviction, allocation),
// with_layer() stores each layer's new k/v and runs its attention, end_batch() commits the new
// token ids.
// Between begin and end the calling thread owns the runtime; other threads wait (without
// Python's GIL). A batch whose owner makes no progress for config.stall_timeout_ms is released
// to the next waiting request, and the stalled request's later ops fail: no wait is unbounded.
#pragma once

#include <ATen/Tensor.h>
#include <c10/core/Stream.h>
#include <c10/util/ArrayRef.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_set>
#include <vector>

#include "runtime/batch_plan.h"
#include "runtime/config.h"
#include "runtime/counters.h"
#include "runtime/fp8_pages.h"
#include "runtime/offload_tier.h"
#include "runtime/page_pool.h"
#include "runtime/request_error.h"
#include "runtime/user_table.h"

namespace kvexport::runtime {

class KVRuntime {
 public:
  KVRuntime(std::string name, RuntimeConfig config, at::Device device);

  const std::string& name() const { return name_; }
  const RuntimeConfig& config() const { return config_; }
  at::Device device() const { return cache_.device(); }

  // Plans a batch. token_ids is the jagged concatenation of each user's prefix tokens (read
  // during the call only), token_lengths [B] their lengths. Throws RequestError (state unchanged)
  // when the batch is malformed or cannot fit even after evicting every other user.
  PlannedBatch begin_batch(const std::vector<int64_t>& user_ids, c10::ArrayRef<int64_t> token_ids,
                           const std::vector<int64_t>& token_lengths, const std::vector<int64_t>& num_candidates);
  // begin_batch for a step program (docs/design.md 3.9): the same planning, and the step's inputs
  // and plan on the host in one buffer, padded to buckets (build_step_plan).
  // candidate_ids [T] are the batch's candidates; max_prefix_length sizes the padded page table.
  StepPlan begin_step(const std::vector<int64_t>& user_ids, c10::ArrayRef<int64_t> token_ids,
                      const std::vector<int64_t>& token_lengths, const std::vector<int64_t>& num_candidates,
                      c10::ArrayRef<int64_t> candidate_ids, int64_t max_prefix_length);
  // with_layer for a step program, whose plan comes with every call: stores the prefix rows (the
  // last write_slots.size(0) rows) of k, v in the slots given, then attend(layer_cache). The
  // calling thread must own a batch (begin_step).
  template <typename F>
  auto with_step_layer(int64_t layer, const at::Tensor& k, const at::Tensor& v, const at::Tensor& write_slots,
                       const at::Tensor& value_slots, F&& attend) {
    std::lock_guard<std::mutex> lock(mutex_);
    owned_batch();
    last_progress_ = std::chrono::steady_clock::now();
    store_step_kv(layer, k, v, write_slots, value_slots);
    return attend(cache_.select(0, layer));
  }
  // One layer of this thread's batch in flight: stores the new prefix rows of k, v
  // [N, heads, head_dim] in their pages, then returns attend(plan, layer_cache) with the layer's
  // cache [pages, 2, page_size, heads, head_dim]. Holds the runtime throughout, so no other
  // request changes pages meanwhile.
  template <typename F>
  auto with_layer(int64_t layer, const at::Tensor& k, const at::Tensor& v, F&& attend) {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto& plan = owned_batch();
    last_progress_ = std::chrono::steady_clock::now();
    store_new_kv(plan, layer, k, v);
    return attend(plan, cache_.select(0, layer));
  }
  // Commits the batch's token ids and releases the runtime to other threads.
  // fewer_threads: the request ran on fewer CPU threads than its thread has (counted once committed).
  void end_batch(const std::vector<int64_t>& user_ids, bool fewer_threads = false);
  // Releases this thread's batch without committing (a request that failed midway); no-op
  // when the thread has none.
  void abort_batch();

  std::vector<int64_t> stats();
  void reset();
  bool evict_user(int64_t user_id);        // device tier -> offload tier; false if not on the device
  int64_t cached_length(int64_t user_id);  // tokens cached on the device or host tier
  // Appends a tier to the end of the tier chain (the host tier, built from the config, is first).
  // Throws std::invalid_argument when the chain has a tier of that type already.
  void append_tier(std::unique_ptr<OffloadTier> tier);
  // Waits up to `timeout` (without the runtime's lock or Python's GIL) for writes still on their
  // way into the remote tier; true when none is left or there is no remote tier.
  bool flush_remote(std::chrono::milliseconds timeout);
  std::vector<int64_t> device_users_lru();  // least recently used first
  // A device-tier user's cached k/v, [layers, 2, cached_length, heads, head_dim] (a copy).
  at::Tensor read_user_kv(int64_t user_id);

 private:
  void acquire_batch(std::unique_lock<std::mutex>& lock);
  // The remote tier's entries for the users neither the device tier nor a local offload tier holds,
  // read before the runtime is taken and with the GIL released; one slot per user.
  std::vector<std::optional<OffloadedUser>> read_remote(const std::vector<int64_t>& user_ids);
  bool owner_stalled() const;
  const BatchPlan& owned_batch() const;  // throws RequestError when this thread has no batch
  void store_new_kv(const BatchPlan& plan, int64_t layer, const at::Tensor& k, const at::Tensor& v);
  void store_step_kv(int64_t layer, const at::Tensor& k, const at::Tensor& v, const at::Tensor& write_slots,
                     const at::Tensor& value_slots);
  // rows [n, heads, head_dim] into one layer's cache slots `index` [n], as the cache stores them.
  void store_layer_rows(int64_t layer, const at::Tensor& index, const at::Tensor& rows);
  fp8::PageLayout fp8_layout() const { return {config_.page_size, config_.num_heads, config_.head_dim}; }
  // What begin_batch and begin_step share: takes the runtime for this thread (lock held), reuses
  // each user's longest cached common prefix, evicts and allocates; plan_ holds the batch's users,
  // cached lengths and uncached tokens. Returns each user's pages.
  std::vector<const std::vector<int64_t>*> plan_batch(std::unique_lock<std::mutex>& lock,
                                                      const std::vector<int64_t>& user_ids,
                                                      c10::ArrayRef<int64_t> token_ids,
                                                      const std::vector<int64_t>& token_lengths,
                                                      std::vector<std::optional<OffloadedUser>>& remote);
  void check_batch(const std::vector<int64_t>& user_ids, c10::ArrayRef<int64_t> token_ids,
                   const std::vector<int64_t>& token_lengths, const std::vector<int64_t>& num_candidates) const;
  void truncate(UserEntry& entry, int64_t num_tokens);
  // The tokens cached for a user: its device tier entry's, else those of its offloaded copy.
  static const std::vector<int64_t>* cached_tokens(const UserEntry* entry,
                                                   const std::optional<OffloadedUser>& offloaded);
  // Keeps the first `common` of the user's cached tokens (their common prefix with its `length`
  // request tokens) and counts the lookup.
  int64_t reuse_prefix(int64_t user_id, int64_t common, int64_t length, std::optional<OffloadedUser>& offloaded);
  std::vector<int64_t> allocate_pages(int64_t count, const std::unordered_set<int64_t>& in_batch);
  void evict(int64_t user_id);                            // device tier -> tier chain
  at::Tensor cached_pages(const UserEntry& entry) const;  // the pages holding the entry's tokens
  // The entry's tokens and cached pages, copied to host memory; on CUDA asynchronously, with
  // `ready` set to the event that marks the copy done.
  OffloadedUser copy_to_host(const UserEntry& entry);
  void offload(int64_t user_id, UserEntry entry);
  void onboard(UserEntry& entry, const OffloadedUser& offloaded, int64_t num_tokens);

  std::string name_;
  RuntimeConfig config_;
  at::Tensor cache_;
  PagePool pages_;
  UserTable users_;
  TierChain tiers_;
  // The chain's remote tier, if any, read without mutex_ (tiers are never removed from tiers_).
  std::atomic<OffloadTier*> remote_{nullptr};
  // CUDA: offloads and onboards copy on this stream, ordered with the compute stream by events.
  std::optional<c10::Stream> copy_stream_;
  Counters counters_;
  BatchPlan plan_;

  std::mutex mutex_;
  std::condition_variable released_;
  std::optional<std::thread::id> owner_;
  std::chrono::steady_clock::time_point last_progress_;  // of the batch in flight
};

// Per-process registry keyed by the model's name: two packages never share a cache.
std::shared_ptr<KVRuntime> get_or_create_runtime(const std::string& name, const std::string& config_json,
                                                 at::Device device);
std::shared_ptr<KVRuntime> find_runtime(const std::string& name);  // throws if absent
bool drop_runtime(const std::string& name);

}  // namespace kvexport::runtime
