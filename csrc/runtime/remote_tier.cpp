#include "runtime/remote_tier.h"

#include <algorithm>
#include <stdexcept>

#include "runtime/python_gil.h"

namespace kvexport::runtime {

namespace {

// The writer is off the request path: it may wait longer than a read.
constexpr std::chrono::microseconds kWriteTimeout{1000000};

}  // namespace

RemoteSettings RemoteSettings::parse(const std::string& url, const std::string& write_policy,
                                     const RuntimeConfig& config) {
  RemoteSettings settings;
  settings.endpoint = RedisEndpoint::parse(url);
  if (write_policy == "on_evict") {
    settings.write_policy = WritePolicy::kOnEvict;
  } else if (write_policy == "after_batch") {
    settings.write_policy = WritePolicy::kAfterBatch;
  } else {
    throw std::invalid_argument("remote write policy '" + write_policy + "': expected on_evict or after_batch");
  }
  settings.read_budget = std::chrono::microseconds(config.remote_read_budget_us);
  settings.ttl_s = config.remote_ttl_s;
  return settings;
}

RemoteTier::RemoteTier(std::string runtime, RuntimeConfig config, RemoteSettings settings)
    : runtime_(std::move(runtime)),
      config_(std::move(config)),
      settings_(std::move(settings)),
      reader_(settings_.endpoint, settings_.read_budget) {
  // The first connect is made at load time, not within a request: it may take longer than a read.
  reachable_ = reader_.connect(std::max<std::chrono::microseconds>(settings_.read_budget, kWriteTimeout));
  // A server that answers but refuses the setup (a wrong or missing password) is a setting to fix,
  // not an outage to ride out.
  if (!reachable_ && !reader_.refusal().empty()) {
    throw std::invalid_argument("remote tier " + settings_.endpoint.display() +
                                " refused the connection: " + reader_.refusal());
  }
  reader_connects_ = reader_.num_connects();
  reader_connected_ = reachable_;
  if (reachable_) writer_ = std::thread([this] { write_loop(); });
}

RemoteTier::~RemoteTier() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  queued_.notify_all();
  if (writer_.joinable()) {
    ScopedGilRelease gil;  // the write in progress may wait for the server
    writer_.join();
  }
}

std::string RemoteTier::key(int64_t user_id) const {
  return "kvexport:" + runtime_ + ":" + std::to_string(user_id);
}

std::vector<HeldUser> RemoteTier::put(int64_t user_id, OffloadedUser user) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (queue_.size() >= settings_.queue_capacity || !writer_.joinable()) {
      ++counters_.write_drops;
      return {};
    }
    queue_.push_back(Write{user_id, std::move(user)});
  }
  queued_.notify_one();
  return {};
}

void RemoteTier::write_loop() {
  RedisConnection connection(settings_.endpoint, kWriteTimeout);
  connection.connect(kWriteTimeout);
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    queued_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
    if (stopping_) {
      counters_.write_drops += static_cast<int64_t>(queue_.size());
      queue_.clear();
      drained_.notify_all();
      return;
    }
    Write next = std::move(queue_.front());
    queue_.pop_front();
    writing_ = true;
    lock.unlock();
    // Offloads from a CUDA device are still being copied to the host on the copy stream.
    if (next.user.ready) next.user.ready->synchronize();
    const auto bytes = encode_entry(runtime_, config_, next.user.token_ids, next.user.pages);
    const auto status = connection.set(key(next.user_id), bytes, settings_.ttl_s);
    lock.lock();
    writing_ = false;
    if (status == RedisConnection::Status::kOk) {
      ++counters_.writes;
      counters_.bytes_out += static_cast<int64_t>(bytes.size());
    } else {
      ++counters_.errors;
    }
    if (queue_.empty()) drained_.notify_all();
  }
}

bool RemoteTier::flush(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mutex_);
  return drained_.wait_for(lock, timeout, [&] { return queue_.empty() && !writing_; });
}

std::optional<OffloadedUser> RemoteTier::take(int64_t user_id) {
  return std::move(take_many({user_id}).front());
}

std::vector<std::optional<OffloadedUser>> RemoteTier::take_many(const std::vector<int64_t>& user_ids) {
  std::vector<std::string> keys;
  for (auto user_id : user_ids) keys.push_back(key(user_id));
  std::vector<std::optional<std::string>> values;
  std::unique_lock<std::mutex> read_lock(read_mutex_);
  const auto started = std::chrono::steady_clock::now();
  const auto status = reader_.get_many(keys, values);
  const auto elapsed =
      std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - started).count();
  const auto connects = reader_.num_connects();
  const int64_t reconnects = connects - reader_connects_;
  reader_connects_ = connects;
  const bool connected = reader_.connected();
  read_lock.unlock();
  // Decoded (checksum and copy: proportional to the entry) before the counters' lock, which the
  // request holding the runtime may need meanwhile to queue a write.
  std::vector<DecodedEntry> entries(values.size());
  if (status == RedisConnection::Status::kOk) {
    for (size_t i = 0; i < values.size(); ++i) {
      if (values[i]) entries[i] = decode_entry(*values[i], runtime_, config_);
    }
  }
  std::vector<std::optional<OffloadedUser>> users(user_ids.size());
  std::lock_guard<std::mutex> lock(mutex_);
  counters_.reconnects += reconnects;
  reader_connected_ = connected;
  if (status != RedisConnection::Status::kUnavailable) {
    ++counters_.reads;
    counters_.read_us += elapsed;
    counters_.read_us_max = std::max<int64_t>(counters_.read_us_max, elapsed);
  }
  if (status != RedisConnection::Status::kOk) {
    ++counters_.errors;
    counters_.misses += static_cast<int64_t>(user_ids.size());
    return users;
  }
  for (size_t i = 0; i < values.size(); ++i) {
    if (!values[i]) {
      ++counters_.misses;
      continue;
    }
    counters_.bytes_in += static_cast<int64_t>(values[i]->size());
    users[i] = accept(entries[i]);
  }
  return users;
}

std::optional<OffloadedUser> RemoteTier::accept(DecodedEntry& entry) {
  switch (entry.fault) {
    case EntryFault::kNone:
      return OffloadedUser{std::move(entry.token_ids), std::move(entry.pages), nullptr, TierKind::kRemote};
    case EntryFault::kFormat:
      ++counters_.rejected_format;
      break;
    case EntryFault::kChecksum:
      ++counters_.rejected_checksum;
      break;
    case EntryFault::kRuntime:
      ++counters_.rejected_runtime;
      break;
  }
  return std::nullopt;
}

void RemoteTier::clear() {
  std::lock_guard<std::mutex> lock(mutex_);
  counters_ = RemoteCounters{};
}

void RemoteTier::add_counters(Counters& counters) const {
  std::lock_guard<std::mutex> lock(mutex_);
  counters.remote += counters_;
  counters.remote.connected += reader_connected_ ? 1 : 0;
}

}  // namespace kvexport::runtime
