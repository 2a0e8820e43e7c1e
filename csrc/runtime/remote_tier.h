// The remote tier: a Redis/Valkey server shared by every process that loads a package of the same
// runtime name (the name digests config and weights). Last in the tier chain: it stores what the
// host tier lets go (and, with write policy after_batch, every committed user), and is read on a
// miss in both local tiers.
//
// Writes are asynchronous: a background writer drains a bounded queue, and a full queue drops the
// write (this is a cache); entries expire config.remote_ttl_s after they are written. Reads are made
// ahead of a batch (OffloadTier::is_remote), on the request's thread, without the runtime's lock or
// Python's GIL, within config.remote_read_budget_us. An entry is used only if it decodes, its
// checksum and runtime name match; the runtime then keeps only its longest common prefix with the
// request's tokens. Anything else is a miss, never an error.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <thread>

#include "runtime/config.h"
#include "runtime/offload_tier.h"
#include "runtime/redis_connection.h"
#include "runtime/remote_entry.h"

namespace kvexport::runtime {

enum class WritePolicy { kOnEvict, kAfterBatch };

struct RemoteSettings {
  RedisEndpoint endpoint;
  WritePolicy write_policy = WritePolicy::kOnEvict;
  std::chrono::microseconds read_budget{5000};
  int64_t ttl_s = 0;            // 0: entries never expire
  size_t queue_capacity = 256;  // entries waiting for the writer

  // The URL and policy a host gives at load time, the budget and expiry from the runtime's config.
  // Throws std::invalid_argument naming the bad value.
  static RemoteSettings parse(const std::string& url, const std::string& write_policy, const RuntimeConfig& config);
};

class RemoteTier final : public OffloadTier {
 public:
  RemoteTier(std::string runtime, RuntimeConfig config, RemoteSettings settings);
  // Finishes the write in progress (without Python's GIL) and drops those still queued, counted as
  // write drops: a host that wants them written calls flush() first.
  ~RemoteTier() override;

  // Whether the server answered when the tier was made.
  bool reachable() const { return reachable_; }

  std::vector<HeldUser> put(int64_t user_id, OffloadedUser user) override;
  std::optional<OffloadedUser> take(int64_t user_id) override;
  // One read for all of them, within the read budget; safe from several threads at once.
  std::vector<std::optional<OffloadedUser>> take_many(const std::vector<int64_t>& user_ids) override;
  std::optional<int64_t> num_tokens(int64_t) const override { return std::nullopt; }
  int64_t used_pages() const override { return 0; }
  int64_t num_users() const override { return 0; }
  void clear() override;
  bool stores_after_batch() const override { return settings_.write_policy == WritePolicy::kAfterBatch; }
  bool is_remote() const override { return true; }
  bool flush(std::chrono::milliseconds timeout) override;
  void add_counters(Counters& counters) const override;

 private:
  struct Write {
    int64_t user_id;
    OffloadedUser user;
  };
  std::string key(int64_t user_id) const;
  void write_loop();
  // The decoded entry's user, or nullopt counted as a rejection; called with mutex_ held.
  std::optional<OffloadedUser> accept(DecodedEntry& entry);

  std::string runtime_;
  RuntimeConfig config_;
  RemoteSettings settings_;
  std::mutex read_mutex_;    // one read on reader_ at a time
  RedisConnection reader_;   // guarded by read_mutex_
  int64_t reader_connects_;  // reader_.num_connects() when counted last; guarded by read_mutex_
  bool reachable_ = false;

  mutable std::mutex mutex_;  // guards everything below
  RemoteCounters counters_;
  bool reader_connected_ = false;
  std::deque<Write> queue_;
  bool writing_ = false;  // the writer holds an entry it took off the queue
  bool stopping_ = false;
  std::condition_variable queued_;
  std::condition_variable drained_;  // the queue is empty and nothing is being written
  std::thread writer_;
};

}  // namespace kvexport::runtime
