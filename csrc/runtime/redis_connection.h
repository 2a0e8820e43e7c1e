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
  // AUTH at every connect when password is set (username too: a Redis 6 ACL user; else the
  // default user). Percent-decoded from the URL.
  std::string username;
  std::string password;
  // redis://[[username]:password@]host[:port][/db]; throws std::invalid_argument naming the URL,
  // its credentials hidden (redact_url).
  static RedisEndpoint parse(const std::string& url);
  // The endpoint as a URL for messages: its credentials shown as *** (redis://***@host:port/db).
  std::string display() const;
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
  // connection's own timeout): AUTH when the endpoint has a password, SELECT for a db other than
  // 0, then a PING, so that a server that wants a password it was not given refuses here.
  bool connect(std::chrono::microseconds connect_timeout);
  // Why the server refused the last connect's setup (its error reply to AUTH, SELECT or PING that
  // rejects the settings: "WRONGPASS ...", "NOAUTH ...", "NOPERM ..."); empty when it connected,
  // could not be reached, or answered with a passing error such as "LOADING ..." or "BUSY ...".
  const std::string& refusal() const { return refusal_; }
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
  std::string refusal_;
};

}  // namespace kvexport::runtime
