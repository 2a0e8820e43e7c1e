#include "ops/request_check.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <unordered_map>
#include <vector>

#include "runtime/parallel.h"
#include "runtime/request_error.h"
#include "runtime/staging.h"

namespace kvexport::ops {

namespace {

using runtime::ErrorCode;
using runtime::RequestError;

struct RequestLimits {
  int64_t max_batch_size = 0;
  int64_t max_history_length = 0;
  int64_t max_num_candidates = 0;
  int64_t num_contextual_features = 0;
  int64_t context_vocab_size = 0;
  int64_t item_vocab_size = 0;
  int64_t action_vocab_size = 0;
  // model.event_tokens: combined lays out one token per event, (item << bits) | action; -1 (pairs)
  // lays out an item token and an action token.
  int64_t combined_action_bits = -1;
  // model.head: item_tower: context_ids' last column is the query time, and each checked candidate
  // id carries its calendar code in its low time_code_bits bits, (item << bits) | code.
  std::vector<std::pair<int64_t, int64_t>> query_time_periods;  // [seconds per unit, units per cycle]
  // Derived in Python (kvexport.config.ModelConfig) and passed in: parse_limits lays out and shifts by
  // them as given, after checking that they fit the fields they describe (a limits string written by
  // hand must not make the layout write past its tensors).
  int64_t tokens_per_event = 2;  // prefix tokens of one event
  int64_t context_width = 0;     // columns of context_ids
  int64_t time_code_bits = 0;
  bool reads_query_time() const { return !query_time_periods.empty(); }
};

// Upstream's float32 arithmetic, as torch computes it (c10::div_floor_floating, then remainder), so
// the code of a query time lands on the side of an hour boundary the trainer's model put it.
float div_floor(float a, float b) {
  const float mod = std::fmod(a, b);
  float div = (a - mod) / b;
  if (mod != 0 && (b < 0) != (mod < 0)) div -= 1;
  if (div == 0) return std::copysign(0.0f, a / b);
  float floored = std::floor(div);
  if (div - floored > 0.5f) floored += 1;
  return floored;
}

float remainder(float a, float b) {
  float mod = std::fmod(a, b);
  if (mod != 0 && (b < 0) != (mod < 0)) mod += b;
  return mod;
}

// The calendar code of a query time: each period's unit index within its cycle, mixed radix, the
// first period most significant (Python: kvexport.model.hstu.time_codes).
int64_t time_code(const RequestLimits& l, int64_t query_time) {
  const float seconds = static_cast<float>(query_time);
  int64_t code = 0;
  for (const auto& [unit, units] : l.query_time_periods) {
    const float index = remainder(div_floor(seconds, static_cast<float>(unit)), static_cast<float>(units));
    code = code * units + std::clamp<int64_t>(static_cast<int64_t>(index), 0, units - 1);
  }
  return code;
}

// Whether ids below `limit` shifted left by `bits` (0..62) stay below 2^63.
bool fits_shifted(int64_t limit, int64_t bits) {
  return limit >= 1 && ((limit - 1) >> (63 - bits)) == 0;
}

RequestLimits parse_limits(const std::string& json) {
  const auto j = nlohmann::json::parse(json);
  RequestLimits l;
  l.max_batch_size = j.at("max_batch_size").get<int64_t>();
  l.max_history_length = j.at("max_history_length").get<int64_t>();
  l.max_num_candidates = j.at("max_num_candidates").get<int64_t>();
  l.num_contextual_features = j.at("num_contextual_features").get<int64_t>();
  l.context_vocab_size = j.at("context_vocab_size").get<int64_t>();
  l.item_vocab_size = j.at("item_vocab_size").get<int64_t>();
  l.action_vocab_size = j.at("action_vocab_size").get<int64_t>();
  l.combined_action_bits = j.value("combined_action_bits", int64_t{-1});
  int64_t num_codes = 1;
  for (const auto& period : j.value("query_time_periods", nlohmann::json::array())) {
    const auto unit = period.at(0).get<int64_t>(), units = period.at(1).get<int64_t>();
    if (unit <= 0 || unit >= (int64_t{1} << 24) || units <= 0 || units > (int64_t{1} << 16) / num_codes) {
      throw std::invalid_argument("kvexport: request limits: query time period [" + std::to_string(unit) + ", " +
                                  std::to_string(units) +
                                  "]: seconds must lie in [1, 2^24) and the periods make "
                                  "at most 65536 codes");
    }
    l.query_time_periods.emplace_back(unit, units);
    num_codes *= units;
  }
  for (const char* key : {"tokens_per_event", "context_width", "time_code_bits"}) {
    if (!j.contains(key)) {
      throw std::invalid_argument(std::string("kvexport: request limits lack ") + key +
                                  ": the package was built by an older kvexport; rebuild it with this one");
    }
  }
  l.tokens_per_event = j.at("tokens_per_event").get<int64_t>();
  l.context_width = j.at("context_width").get<int64_t>();
  l.time_code_bits = j.at("time_code_bits").get<int64_t>();
  if (l.tokens_per_event != (l.combined_action_bits < 0 ? 2 : 1) ||
      l.context_width != l.num_contextual_features + (l.reads_query_time() ? 1 : 0)) {
    throw std::invalid_argument("kvexport: request limits: tokens_per_event " + std::to_string(l.tokens_per_event) +
                                " and context_width " + std::to_string(l.context_width) +
                                " do not fit the event tokens and context features they describe");
  }
  if (l.time_code_bits < 0 || l.time_code_bits > 16 || (int64_t{1} << l.time_code_bits) < num_codes ||
      (!l.reads_query_time() && l.time_code_bits != 0)) {
    throw std::invalid_argument("kvexport: request limits: time_code_bits " + std::to_string(l.time_code_bits) +
                                " cannot hold " + std::to_string(num_codes) + " query time codes");
  }
  if (l.reads_query_time() && !fits_shifted(l.item_vocab_size, l.time_code_bits)) {
    throw std::invalid_argument("kvexport: request limits: " + std::to_string(l.item_vocab_size) +
                                " items leave no room for a " + std::to_string(l.time_code_bits) +
                                "-bit query time code");
  }
  const int64_t bits = l.combined_action_bits;
  if (bits < -1 || bits > 62 ||
      (bits >= 0 && (l.action_vocab_size > (int64_t{1} << bits) || !fits_shifted(l.item_vocab_size, bits)))) {
    throw std::invalid_argument("kvexport: request limits: " + std::to_string(l.action_vocab_size) + " actions and " +
                                std::to_string(l.item_vocab_size) +
                                " items do not fit a token of combined_action_bits " + std::to_string(bits));
  }
  return l;
}

// A package checks every request against the same string: parse it once per process.
const RequestLimits& limits_for(const std::string& json) {
  static std::mutex mutex;
  static std::unordered_map<std::string, RequestLimits> parsed;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = parsed.find(json);
  if (it == parsed.end()) it = parsed.emplace(json, parse_limits(json)).first;
  return it->second;
}

[[noreturn]] void refuse(const std::string& message) {
  throw RequestError(ErrorCode::kInvalidRequest, message);
}

std::string shape_of(const at::Tensor& t) {
  std::string s = "[";
  for (int64_t d = 0; d < t.dim(); ++d) s += (d ? ", " : "") + std::to_string(t.size(d));
  return s + "]";
}

// Torch's Python names (int32, not Int), as users write them.
std::string dtype_name(at::ScalarType type) {
  switch (type) {
    case at::kLong:
      return "int64";
    case at::kInt:
      return "int32";
    case at::kShort:
      return "int16";
    case at::kByte:
      return "uint8";
    case at::kBool:
      return "bool";
    case at::kFloat:
      return "float32";
    case at::kDouble:
      return "float64";
    case at::kHalf:
      return "float16";
    case at::kBFloat16:
      return "bfloat16";
    default:
      return c10::toString(type);
  }
}

void check_range(const char* name, const at::Tensor& values, int64_t low, int64_t high, const char* what) {
  const auto* data = values.const_data_ptr<int64_t>();
  const auto* end = data + values.numel();
  const auto* bad = std::find_if(data, end, [&](int64_t x) { return x < low || x >= high; });
  if (bad != end) {
    refuse(std::string(name) + " has " + std::to_string(*bad) + ", outside " + what + " [" + std::to_string(low) +
           ", " + std::to_string(high - 1) + "]");
  }
}

// The first `columns` columns of a 2-D tensor, row by row; the first bad value is named.
void check_columns(const char* name, const at::Tensor& values, int64_t columns, int64_t low, int64_t high,
                   const char* what) {
  if (columns == values.size(1)) return check_range(name, values, low, high, what);
  check_range(name, values.narrow(1, 0, columns).contiguous(), low, high, what);
}

int64_t sum_of(const at::Tensor& values) {
  const auto* data = values.const_data_ptr<int64_t>();
  int64_t total = 0;
  for (int64_t i = 0; i < values.numel(); ++i) total += data[i];
  return total;
}

void check_rows(const char* name, const at::Tensor& t, int64_t num_users) {
  if (t.size(0) != num_users) {
    refuse(std::string(name) + " has " + std::to_string(t.size(0)) + " rows for " + std::to_string(num_users) +
           " users");
  }
}

void check_jagged(const char* lengths_name, int64_t total, const char* name, const at::Tensor& values) {
  if (values.size(0) != total) {
    refuse(std::string(lengths_name) + " sum to " + std::to_string(total) + " but " + name + " has " +
           std::to_string(values.size(0)) + " entries");
  }
}

void check_distinct(const at::Tensor& user_ids) {
  const auto* data = user_ids.const_data_ptr<int64_t>();
  std::vector<int64_t> sorted(data, data + user_ids.numel());
  std::sort(sorted.begin(), sorted.end());
  const auto dup = std::adjacent_find(sorted.begin(), sorted.end());
  if (dup != sorted.end()) refuse("user_ids repeat a user (" + std::to_string(*dup) + ") within one batch");
}

// Each user's context ids, then its events' tokens (an item and an action token each, or one token
// (item << bits) | action with combined_action_bits), users one after another; nullopt (nothing to
// use) when an item or action id lies outside [0, vocab): the caller names it. The range test is
// branch-free, so each user's copy stays one vectorisable pass over its events; a request of many
// events lays its users out on several threads (runtime::kParallelTokens).
std::optional<at::Tensor> layout_tokens(const at::Tensor& history_lengths, const at::Tensor& items,
                                        const at::Tensor& actions, const at::Tensor& context, const RequestLimits& l) {
  const int64_t num_users = context.size(0), num_context = l.num_contextual_features, width = context.size(1);
  const int64_t per_event = l.tokens_per_event;
  auto tokens = at::empty({num_users * num_context + per_event * items.size(0)}, at::kLong);
  int64_t* out = tokens.data_ptr<int64_t>();
  const int64_t* length = history_lengths.const_data_ptr<int64_t>();
  const int64_t *item = items.const_data_ptr<int64_t>(), *action = actions.const_data_ptr<int64_t>();
  const int64_t* ctx = context.const_data_ptr<int64_t>();
  std::vector<int64_t> first_event(num_users + 1, 0);  // of each user in items and actions
  for (int64_t b = 0; b < num_users; ++b) first_event[b + 1] = first_event[b] + length[b];
  // Unsigned comparison: a negative id wraps to a huge value and fails `< vocab` too.
  const auto item_limit = static_cast<uint64_t>(l.item_vocab_size);
  const auto action_limit = static_cast<uint64_t>(l.action_vocab_size);
  std::vector<char> bad(num_users, 0);
  const auto lay_out = [&](int64_t b) {
    // Locals and restrict pointers (the tokens are a fresh tensor): the int64 stores cannot alias
    // the length, the limits or the ids, so the loops keep them in registers.
    const int64_t events = length[b];
    const uint64_t items_below = item_limit, actions_below = action_limit;
    int64_t* __restrict user_out =
        std::copy(ctx + b * width, ctx + b * width + num_context, out + b * num_context + per_event * first_event[b]);
    const int64_t* __restrict user_item = item + first_event[b];
    const int64_t* __restrict user_action = action + first_event[b];
    bool user_bad = false;
    if (per_event == 2) {
      for (int64_t e = 0; e < events; ++e) {
        user_bad |= static_cast<uint64_t>(user_item[e]) >= items_below;
        user_bad |= static_cast<uint64_t>(user_action[e]) >= actions_below;
        user_out[2 * e] = user_item[e];
        user_out[2 * e + 1] = user_action[e];
      }
    } else {
      // The item limit leaves the top bits free (model.item_id_limit): a valid id cannot overflow.
      const auto bits = static_cast<uint64_t>(l.combined_action_bits);
      for (int64_t e = 0; e < events; ++e) {
        const auto item_id = static_cast<uint64_t>(user_item[e]), action_id = static_cast<uint64_t>(user_action[e]);
        user_bad |= item_id >= items_below;
        user_bad |= action_id >= actions_below;
        user_out[e] = static_cast<int64_t>((item_id << bits) | action_id);
      }
    }
    bad[b] = user_bad;
  };
  const bool parallel = per_event * first_event[num_users] >= runtime::kParallelTokens && !at::in_parallel_region();
  runtime::for_each_item(num_users, parallel ? at::get_num_threads() : 1, lay_out);
  if (std::find(bad.begin(), bad.end(), 1) != bad.end()) return std::nullopt;
  return tokens;
}

// A copy of the candidate ids; with a query time, each (item << time_code_bits) | its user's code
// (the item limit leaves the top bits free, so a checked id cannot overflow).
at::Tensor checked_candidates(const at::Tensor& candidates, const at::Tensor& counts, const at::Tensor& context,
                              const RequestLimits& l) {
  if (!l.reads_query_time()) return candidates.clone();
  auto out = at::empty_like(candidates);
  auto* id = out.data_ptr<int64_t>();
  const auto* item = candidates.const_data_ptr<int64_t>();
  const auto* count = counts.const_data_ptr<int64_t>();
  const auto* ctx = context.const_data_ptr<int64_t>();
  const int64_t width = context.size(1);
  for (int64_t b = 0, t = 0; b < context.size(0); ++b) {
    const int64_t code = time_code(l, ctx[b * width + l.num_contextual_features]);
    for (int64_t end = t + count[b]; t < end; ++t) {
      id[t] = static_cast<int64_t>((static_cast<uint64_t>(item[t]) << l.time_code_bits) | static_cast<uint64_t>(code));
    }
  }
  return out;
}

}  // namespace

// dtype, rank and place first: nothing else may read a tensor whose bytes are not int64 or are
// not on the host.
void check_kind(const char* name, const at::Tensor& t, int64_t ndim) {
  if (t.scalar_type() != at::kLong) {
    refuse(std::string(name) + " must be int64, got " + dtype_name(t.scalar_type()));
  }
  if (t.dim() != ndim) refuse(std::string(name) + " must be " + std::to_string(ndim) + "-D, got shape " + shape_of(t));
  if (!t.is_cpu()) {
    refuse(std::string(name) + " is on " + t.device().str() +
           ": a request's tensors must be on the host (cpu), whatever the package's device");
  }
}

std::vector<at::Tensor> upload(at::TensorList host, const at::Device& device) {
  std::vector<at::Tensor> out;
  int64_t total = 0;
  for (const auto& t : host) {
    TORCH_CHECK(t.is_cpu() && t.scalar_type() == at::kLong, "upload takes int64 host tensors, got ",
                dtype_name(t.scalar_type()), " on ", t.device().str());
    total += t.numel();
  }
  if (device.is_cpu()) {
    for (const auto& t : host) out.push_back(t.clone(at::MemoryFormat::Contiguous));
    return out;
  }
  // Separate device tensors, not views of one: outputs of an op must not alias.
  auto staged = runtime::staging_buffer(total, device);
  int64_t offset = 0;
  for (const auto& t : host) {
    auto part = staged.narrow(0, offset, t.numel()).view(t.sizes());
    part.copy_(t);
    out.push_back(part.to(device, /*non_blocking=*/true));
    offset += t.numel();
  }
  return out;
}

RequestTensors check_request(const std::string& limits_json, const at::Tensor& user_ids,
                             const at::Tensor& history_lengths, const at::Tensor& item_ids,
                             const at::Tensor& action_ids, const at::Tensor& context_ids,
                             const at::Tensor& num_candidates, const at::Tensor& candidate_ids) {
  const auto& l = limits_for(limits_json);
  check_kind("user_ids", user_ids, 1);
  check_kind("history_lengths", history_lengths, 1);
  check_kind("item_ids", item_ids, 1);
  check_kind("action_ids", action_ids, 1);
  check_kind("context_ids", context_ids, 2);
  check_kind("num_candidates", num_candidates, 1);
  check_kind("candidate_ids", candidate_ids, 1);
  const auto users = user_ids.contiguous(), history = history_lengths.contiguous(), items = item_ids.contiguous(),
             actions = action_ids.contiguous(), context = context_ids.contiguous(),
             counts = num_candidates.contiguous(), candidates = candidate_ids.contiguous();

  const int64_t num_users = users.size(0);
  if (num_users == 0) refuse("empty batch (no users)");
  if (num_users > l.max_batch_size) {
    refuse(std::to_string(num_users) + " users exceed serving.max_batch_size (" + std::to_string(l.max_batch_size) +
           ")");
  }
  check_rows("history_lengths", history, num_users);
  check_rows("num_candidates", counts, num_users);
  check_rows("context_ids", context, num_users);
  if (context.size(1) != l.context_width) {
    refuse("context_ids has " + std::to_string(context.size(1)) + " features, the model has " +
           std::to_string(l.num_contextual_features) + (l.reads_query_time() ? " and the query time" : ""));
  }
  check_distinct(users);
  check_range("history_lengths", history, 0, l.max_history_length + 1, "events");
  check_range("num_candidates", counts, 1, l.max_num_candidates + 1, "candidates");
  // Lengths are bounded now, so their sums cannot overflow.
  const int64_t num_events = sum_of(history);
  check_jagged("history_lengths", num_events, "item_ids", items);
  check_jagged("history_lengths", num_events, "action_ids", actions);
  check_jagged("num_candidates", sum_of(counts), "candidate_ids", candidates);
  // The events are the request's bulk: their ranges are tested while they are laid out, in one
  // pass; when one is bad, the ordered checks name the first bad value, in the same order as
  // always (items, candidates, actions, context), whatever the layout met first.
  auto tokens = layout_tokens(history, items, actions, context, l);
  if (!tokens) check_range("item_ids", items, 0, l.item_vocab_size, "the item vocabulary");
  check_range("candidate_ids", candidates, 0, l.item_vocab_size, "the item vocabulary");
  if (!tokens) check_range("action_ids", actions, 0, l.action_vocab_size, "the action vocabulary");
  check_columns("context_ids", context, l.num_contextual_features, 0, l.context_vocab_size, "the context vocabulary");
  if (l.reads_query_time()) {
    check_range("context_ids' query time", context.narrow(1, l.num_contextual_features, 1).contiguous(), 0,
                std::numeric_limits<int64_t>::max(), "seconds since the epoch");
  }
  if (!tokens) throw std::logic_error("kvexport bug: the layout refused ids the range checks accept");
  auto token_lengths = at::empty({num_users}, at::kLong);
  const auto* length = history.const_data_ptr<int64_t>();
  auto* token_length = token_lengths.data_ptr<int64_t>();
  for (int64_t b = 0; b < num_users; ++b) {
    token_length[b] = l.num_contextual_features + l.tokens_per_event * length[b];
  }
  // Copies of the small tensors for the rest of the graph (contiguous() may have returned the input).
  return {users.clone(), std::move(token_lengths), std::move(*tokens), counts.clone(),
          checked_candidates(candidates, counts, context, l)};
}

}  // namespace kvexport::ops
