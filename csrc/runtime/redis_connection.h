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

  // Connects now, ignoring the backoff, waiting up to connect_timeout (commands keep the
  // connection's own timeout).
  bool connect(std::chrono::microseconds connect_timeout);
  bool connected() const { return context_ != nullptr; }
  // Connections made so far (the first one and every reconnect).
  int64_t num_connects() const { return num_connects_; }
  // One MGET: values[i] is keys[i]'s value, or nullopt when absent.
  Status get_many(const std::vector<std::string>& keys, std::vector<std::optional<std::string>>& values);
  // SET, with an expiry of ttl_s seconds unless it is 0.
  Status set(const std::string& key, const std::string& value, int64_t ttl_s);

 private:
  Status ensure_connected();
  void drop();  // closes the connection and schedules the next attempt

  RedisEndpoint endpoint_;
  std::chrono::microseconds timeout_;
  redisContext* context_ = nullptr;
  std::chrono::steady_clock::time_point retry_at_;
  std::chrono::milliseconds backoff_;
  int64_t num_connects_ = 0;
};

}  // namespace kvexport::runtime
