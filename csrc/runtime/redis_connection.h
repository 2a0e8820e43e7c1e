// One connection to a Redis/Valkey server (hiredis), every operation bounded by a timeout. After a
// failure the connection is dropped and not retried until a backoff has passed (doubling up to a
// cap), so a lost server costs each caller at most one refused connect per backoff period.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

struct redisContext;

namespace kvexport::runtime {

struct RedisEndpoint {
  std::string host;
  int port = 6379;
  int64_t db = 0;
  // redis://host[:port][/db]; throws std::invalid_argument naming the URL.
  static RedisEndpoint parse(const std::string& url);
};

class RedisConnection {
 public:
  enum class Status {
    kOk,           // the command ran
    kUnavailable,  // not connected and still backing off: nothing was sent
    kFailed,       // the server failed or timed out: the connection is dropped
  };

  RedisConnection(RedisEndpoint endpoint, std::chrono::microseconds timeout);
  ~RedisConnection();
  RedisConnection(const RedisConnection&) = delete;
  RedisConnection& operator=(const RedisConnection&) = delete;

  // Connects now, ignoring the backoff.
  bool connect();
  bool connected() const { return context_ != nullptr; }
  // One MGET: values[i] is keys[i]'s value, or nullopt when absent.
  Status get_many(const std::vector<std::string>& keys, std::vector<std::optional<std::string>>& values);
  Status set(const std::string& key, const std::string& value);

 private:
  Status ensure_connected();
  void drop();  // closes the connection and schedules the next attempt

  RedisEndpoint endpoint_;
  std::chrono::microseconds timeout_;
  redisContext* context_ = nullptr;
  std::chrono::steady_clock::time_point retry_at_;
  std::chrono::milliseconds backoff_;
};

}  // namespace kvexport::runtime
