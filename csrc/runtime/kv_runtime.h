// The KV-cache runtime of one model: a paged device tier, an offload tier, per-user page
// tables and the token ids each user's cache was computed from. Knows nothing of HSTU.
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

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "runtime/config.h"
#include "runtime/host_tier.h"
#include "runtime/request_error.h"

namespace kvexport::runtime {

struct Counters {
  int64_t lookups = 0;             // users looked up
  int64_t hit_tokens = 0;          // prefix tokens served from the cache
  int64_t recomputed_tokens = 0;   // prefix tokens computed by a request
  int64_t device_evictions = 0;    // users evicted from the device tier
  int64_t offloads = 0;            // of those, users stored in the offload tier
  int64_t onboards = 0;            // users brought back from the offload tier
  int64_t host_evictions = 0;      // users dropped by the offload tier
  int64_t prefix_truncations = 0;  // users whose stored tokens diverged from the request
  int64_t stalled_batches = 0;     // batches released to another request after stalling
};

// The names of the stats op's values, in order: the one list every host reads (kvexport::stat_names).
const std::vector<std::string>& stat_names();
// Counters and gauges in stat_names() order.
std::vector<int64_t> stats_vector(const Counters& c, int64_t device_pages_used, int64_t device_users,
                                  int64_t host_pages_used, int64_t host_users);

// The plan of the batch in flight. New rows of the model are laid out as
// [candidates of all users][uncached prefix tokens of all users], users in batch order.
struct BatchPlan {
  std::vector<int64_t> user_ids;
  std::vector<int64_t> cached_lengths;  // reused prefix per user
  std::vector<std::vector<int64_t>> prefix_tokens;
  int64_t num_candidate_rows = 0;
  int64_t num_new_prefix_rows = 0;
  // On the cache's device:
  at::Tensor page_table;     // [B, max_pages] int64, page of each user's j-th page slot
  at::Tensor row_user;       // [N] int64, batch index of each new row
  at::Tensor row_keys;       // [N] int64, cached keys a row reads: position + 1, or the prefix length
  at::Tensor row_candidate;  // [N] bool, true for candidate rows (they also read themselves)
  at::Tensor write_slots;    // [num_new_prefix_rows] int64, slot of each new prefix row in a layer's
                             // cache viewed as [pages * 2 * page_size, heads, head_dim] (k; v is +page_size)
  at::Tensor value_slots;    // [num_new_prefix_rows] int64, write_slots + page_size: where the v rows go
  at::Tensor cached_lengths_tensor;  // [B] int64
  // For kernels that work on tiles of one user's rows (CUDA): rows grouped by user, and tiles
  // [T, 3] int64 of (user, first index into row_order, row count <= kAttentionTileRows).
  at::Tensor row_order;  // [N] int64
  at::Tensor tiles;      // [T, 3] int64
  int64_t max_row_keys = 0;  // the most cached keys any row reads
};

// Rows per attention tile (one user's rows; the CUDA kernel's block).
constexpr int64_t kAttentionTileRows = 64;

// Rows grouped by user (stable) and cut into tiles of at most tile_rows rows of one user:
// (row_order, tiles as flat (user, first index into row_order, count) triples).
std::pair<std::vector<int64_t>, std::vector<int64_t>> user_tiles(const std::vector<int64_t>& row_user,
                                                                 int64_t tile_rows);

class KVRuntime {
 public:
  KVRuntime(std::string name, RuntimeConfig config, at::Device device);

  const std::string& name() const { return name_; }
  const RuntimeConfig& config() const { return config_; }
  at::Device device() const { return cache_.device(); }

  // Plans a batch. token_ids is the jagged concatenation of each user's prefix tokens,
  // token_lengths [B] their lengths. Throws RequestError (state unchanged) when the batch is
  // malformed or cannot fit even after evicting every other user.
  const BatchPlan& begin_batch(const std::vector<int64_t>& user_ids, const std::vector<int64_t>& token_ids,
                               const std::vector<int64_t>& token_lengths,
                               const std::vector<int64_t>& num_candidates);
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
  void end_batch(const std::vector<int64_t>& user_ids);
  // Releases this thread's batch without committing (a request that failed midway); no-op
  // when the thread has none.
  void abort_batch();

  std::vector<int64_t> stats();
  void reset();
  bool evict_user(int64_t user_id);  // device tier -> offload tier; false if not on the device
  int64_t cached_length(int64_t user_id);  // tokens cached on either tier
  std::vector<int64_t> device_users_lru();  // least recently used first
  // A device-tier user's cached k/v, [layers, 2, cached_length, heads, head_dim] (a copy).
  at::Tensor read_user_kv(int64_t user_id);

 private:
  struct UserEntry {
    std::vector<int64_t> pages;
    std::vector<int64_t> token_ids;
    int64_t last_used = 0;
  };

  void acquire_batch(std::unique_lock<std::mutex>& lock);
  bool owner_stalled() const;
  const BatchPlan& owned_batch() const;  // throws RequestError when this thread has no batch
  void store_new_kv(const BatchPlan& plan, int64_t layer, const at::Tensor& k, const at::Tensor& v);
  void check_batch(const std::vector<int64_t>& user_ids, const std::vector<int64_t>& token_ids,
                   const std::vector<int64_t>& token_lengths, const std::vector<int64_t>& num_candidates) const;
  void truncate(UserEntry& entry, int64_t num_tokens);
  int64_t reuse_prefix(int64_t user_id, const int64_t* tokens, int64_t length,
                       std::optional<OffloadedUser>& offloaded);
  std::vector<int64_t> allocate_pages(int64_t count, const std::unordered_map<int64_t, bool>& in_batch);
  void evict_lru_user(const std::unordered_map<int64_t, bool>& in_batch);
  void evict(std::unordered_map<int64_t, UserEntry>::iterator user);  // device tier -> offload tier
  at::Tensor cached_pages(const UserEntry& entry) const;  // the pages holding the entry's tokens
  // The same, copied to host memory; on CUDA asynchronously, with `ready` set to the event that
  // marks the copy done.
  at::Tensor pages_to_host(const UserEntry& entry, std::shared_ptr<c10::Event>& ready);
  void offload(int64_t user_id, UserEntry entry);
  void onboard(UserEntry& entry, const OffloadedUser& offloaded, int64_t num_tokens);
  void build_plan(const std::vector<int64_t>& token_lengths, const std::vector<int64_t>& num_candidates);

  std::string name_;
  RuntimeConfig config_;
  at::Tensor cache_;
  std::unique_ptr<OffloadTier> offload_tier_;
  // CUDA: offloads and onboards copy on this stream, ordered with the compute stream by events.
  std::optional<c10::Stream> copy_stream_;
  std::vector<int64_t> free_pages_;
  std::unordered_map<int64_t, UserEntry> users_;
  Counters counters_;
  int64_t clock_ = 0;
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
