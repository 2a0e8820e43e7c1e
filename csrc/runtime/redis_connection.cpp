#include "runtime/redis_connection.h"

#include "runtime/url_redaction.h"

#include <hiredis/hiredis.h>

#include <algorithm>
#include <cctype>
#include <iterator>
#include <limits>
#include <memory>
#include <regex>
#include <stdexcept>

namespace kvexport::runtime {

namespace {

constexpr std::chrono::milliseconds kFirstBackoff{50};
constexpr std::chrono::milliseconds kMaxBackoff{5000};

timeval to_timeval(std::chrono::microseconds t) {
  return timeval{static_cast<time_t>(t.count() / 1000000), static_cast<suseconds_t>(t.count() % 1000000)};
}

struct ReplyDeleter {
  void operator()(redisReply* reply) const { freeReplyObject(reply); }
};
using Reply = std::unique_ptr<redisReply, ReplyDeleter>;

// %XX escapes in a URL's user or password; throws on a malformed one.
std::string percent_decode(const std::string& text, const std::string& url) {
  std::string out;
  for (size_t i = 0; i < text.size(); ++i) {
    if (text[i] != '%') {
      out += text[i];
      continue;
    }
    if (i + 2 >= text.size() || !std::isxdigit(static_cast<unsigned char>(text[i + 1])) ||
        !std::isxdigit(static_cast<unsigned char>(text[i + 2]))) {
      throw std::invalid_argument("remote URL '" + redact_url(url) +
                                  "': a '%' in its user or password is not followed by two hex digits");
    }
    out += static_cast<char>(std::stoi(text.substr(i + 1, 2), nullptr, 16));
    i += 2;
  }
  return out;
}

// Whether an error reply to AUTH, SELECT or PING rejects the endpoint's settings (a wrong, missing
// or unneeded password, a user without the right, a db the server lacks or cannot select, a server
// that takes no connections from this host) rather than a passing state.
bool is_refusal(const std::string& error) {
  static const char* const kPrefixes[] = {"NOAUTH",
                                          "WRONGPASS",
                                          "NOPERM",
                                          "ERR AUTH",
                                          "ERR invalid password",
                                          "ERR Client sent AUTH",
                                          "ERR DB index",
                                          "ERR invalid DB index",
                                          "ERR SELECT is not allowed",
                                          "DENIED"};
  return std::any_of(std::begin(kPrefixes), std::end(kPrefixes),
                     [&](const char* prefix) { return error.rfind(prefix, 0) == 0; });
}

// A URL that does not parse, for its error message: its scheme, then the rest only where it is made
// of host-name characters and '/' alone, which can hold no credential (redis://:password:host,
// redis://host/0?password=... and redis://user%3Apassword@host all show as redis://***).
std::string redact_unparsed(const std::string& url) {
  static const std::regex plain(R"([A-Za-z0-9.\-/]*)");
  const auto keep = scheme_length(url);
  return std::regex_match(url.begin() + static_cast<std::ptrdiff_t>(keep), url.end(), plain)
             ? url
             : url.substr(0, keep) + "***";
}

}  // namespace

RedisEndpoint RedisEndpoint::parse(const std::string& url) {
  static const std::regex pattern(
      R"(redis://(?:([^:@/]*)(?::([^@/]*))?@)?([A-Za-z0-9.\-]+|\[[0-9A-Fa-f:]+\])(?::(\d{1,5}))?(?:/(\d+))?/?)");
  std::smatch match;
  if (!std::regex_match(url, match, pattern)) {
    throw std::invalid_argument("remote URL '" + redact_unparsed(url) +
                                "' is not of the form redis://[[user]:password@]host[:port][/db]");
  }
  RedisEndpoint endpoint;
  endpoint.username = percent_decode(match[1].str(), url);
  endpoint.password = percent_decode(match[2].str(), url);
  if (!endpoint.username.empty() && endpoint.password.empty()) {
    throw std::invalid_argument("remote URL '" + redact_url(url) + "' names a user but no password");
  }
  if (match[2].matched && endpoint.password.empty()) {
    throw std::invalid_argument("remote URL '" + redact_url(url) + "' gives an empty password");
  }
  endpoint.host = match[3].str();
  if (endpoint.host.front() == '[') endpoint.host = endpoint.host.substr(1, endpoint.host.size() - 2);
  if (match[4].matched) endpoint.port = std::stoi(match[4].str());
  if (match[5].matched) {
    const auto db = match[5].str();
    const auto first_digit = std::min(db.find_first_not_of('0'), db.size() - 1);  // leading zeros aside
    const auto digits = db.substr(first_digit);
    endpoint.db = digits.size() <= 10 ? std::stoll(digits) : -1;  // ten digits cannot overflow stoll
    if (endpoint.db < 0 || endpoint.db > std::numeric_limits<int32_t>::max()) {
      throw std::invalid_argument("remote URL '" + redact_url(url) + "': db " + db + " outside 0.." +
                                  std::to_string(std::numeric_limits<int32_t>::max()));
    }
  }
  if (endpoint.port < 1 || endpoint.port > 65535) {
    throw std::invalid_argument("remote URL '" + redact_url(url) + "': port " + std::to_string(endpoint.port) +
                                " outside 1..65535");
  }
  return endpoint;
}

std::string RedisEndpoint::display() const {
  const bool ipv6 = host.find(':') != std::string::npos;
  return "redis://" + std::string(password.empty() ? "" : "***@") + (ipv6 ? "[" + host + "]" : host) + ":" +
         std::to_string(port) + "/" + std::to_string(db);
}

RedisConnection::RedisConnection(RedisEndpoint endpoint, std::chrono::microseconds timeout)
    : endpoint_(std::move(endpoint)), timeout_(timeout), backoff_(kFirstBackoff) {}

RedisConnection::~RedisConnection() {
  if (context_) redisFree(context_);
}

bool RedisConnection::connect(std::chrono::microseconds connect_timeout) {
  if (context_) return true;
  refusal_.clear();
  redisContext* context = redisConnectWithTimeout(endpoint_.host.c_str(), endpoint_.port, to_timeval(connect_timeout));
  if (context == nullptr || context->err || redisSetTimeout(context, to_timeval(timeout_)) != REDIS_OK) {
    if (context) redisFree(context);
    drop();
    return false;
  }
  context_ = context;
  // The setup's commands in turn. A refusal is kept for refusal(); a lost connection or a server
  // that is busy for now (LOADING, BUSY, max clients reached) is not one.
  const auto setup = [this](redisReply* raw) {
    Reply reply(raw);
    if (reply && reply->type != REDIS_REPLY_ERROR) return true;
    if (reply && is_refusal(std::string(reply->str, reply->len))) refusal_.assign(reply->str, reply->len);
    drop();
    return false;
  };
  const auto& e = endpoint_;
  if (!e.password.empty() &&
      !setup(static_cast<redisReply*>(e.username.empty()
                                          ? redisCommand(context_, "AUTH %b", e.password.data(), e.password.size())
                                          : redisCommand(context_, "AUTH %b %b", e.username.data(), e.username.size(),
                                                         e.password.data(), e.password.size())))) {
    return false;
  }
  if (e.db != 0 &&
      !setup(static_cast<redisReply*>(redisCommand(context_, "SELECT %lld", static_cast<long long>(e.db))))) {
    return false;
  }
  if (!setup(static_cast<redisReply*>(redisCommand(context_, "PING")))) return false;
  backoff_ = kFirstBackoff;
  ++num_connects_;
  return true;
}

RedisConnection::Status RedisConnection::ensure_connected() {
  if (context_) return Status::kOk;
  if (std::chrono::steady_clock::now() < retry_at_) return Status::kUnavailable;
  return connect(timeout_) ? Status::kOk : Status::kFailed;
}

void RedisConnection::drop() {
  if (context_) redisFree(context_);
  context_ = nullptr;
  retry_at_ = std::chrono::steady_clock::now() + backoff_;
  backoff_ = std::min(backoff_ * 2, kMaxBackoff);
}

RedisConnection::Status RedisConnection::get_many(const std::vector<std::string>& keys,
                                                  std::vector<std::optional<std::string>>& values) {
  if (const auto status = ensure_connected(); status != Status::kOk) return status;
  std::vector<const char*> argv = {"MGET"};
  std::vector<size_t> argv_lengths = {4};
  for (const auto& key : keys) {
    argv.push_back(key.data());
    argv_lengths.push_back(key.size());
  }
  Reply reply(static_cast<redisReply*>(
      redisCommandArgv(context_, static_cast<int>(argv.size()), argv.data(), argv_lengths.data())));
  if (!reply) {
    drop();
    return Status::kFailed;
  }
  if (reply->type != REDIS_REPLY_ARRAY || reply->elements != keys.size()) return Status::kFailed;
  values.assign(keys.size(), std::nullopt);
  for (size_t i = 0; i < keys.size(); ++i) {
    const redisReply* element = reply->element[i];
    if (element->type == REDIS_REPLY_STRING) values[i].emplace(element->str, element->len);
  }
  return Status::kOk;
}

RedisConnection::Status RedisConnection::set(const std::string& key, const std::string& value, int64_t ttl_s) {
  if (const auto status = ensure_connected(); status != Status::kOk) return status;
  Reply reply(static_cast<redisReply*>(
      ttl_s > 0 ? redisCommand(context_, "SET %b %b EX %lld", key.data(), key.size(), value.data(), value.size(),
                               static_cast<long long>(ttl_s))
                : redisCommand(context_, "SET %b %b", key.data(), key.size(), value.data(), value.size())));
  if (!reply) {
    drop();
    return Status::kFailed;
  }
  return reply->type == REDIS_REPLY_ERROR ? Status::kFailed : Status::kOk;
}

}  // namespace kvexport::runtime
