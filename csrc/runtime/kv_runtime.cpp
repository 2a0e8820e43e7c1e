#include "runtime/kv_runtime.h"

#include "runtime/python_gil.h"

#include <ATen/ATen.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <algorithm>
#include <numeric>
#include <sstream>
#include <stdexcept>

namespace kvexport::runtime {

namespace {

at::ScalarType parse_dtype(const std::string& dtype) {
  if (dtype == "float32") return at::kFloat;
  if (dtype == "bfloat16") return at::kBFloat16;
  if (dtype == "float16") return at::kHalf;
  throw std::invalid_argument("runtime config: unsupported dtype " + dtype);
}

RequestError invalid_request(const std::string& message) {
  return RequestError(ErrorCode::kInvalidRequest, message);
}

int64_t common_prefix(const int64_t* a, int64_t a_len, const int64_t* b, int64_t b_len) {
  const int64_t n = std::min(a_len, b_len);
  int64_t i = 0;
  while (i < n && a[i] == b[i]) ++i;
  return i;
}

}  // namespace

std::pair<std::vector<int64_t>, std::vector<int64_t>> user_tiles(const std::vector<int64_t>& row_user,
                                                                 int64_t tile_rows) {
  std::vector<int64_t> row_order(row_user.size());
  std::iota(row_order.begin(), row_order.end(), 0);
  std::stable_sort(row_order.begin(), row_order.end(),
                   [&](int64_t a, int64_t b) { return row_user[a] < row_user[b]; });
  std::vector<int64_t> tiles;
  for (size_t first = 0; first < row_order.size();) {
    const int64_t user = row_user[row_order[first]];
    size_t end = first;
    while (end < row_order.size() && row_user[row_order[end]] == user &&
           static_cast<int64_t>(end - first) < tile_rows) {
      ++end;
    }
    tiles.insert(tiles.end(), {user, static_cast<int64_t>(first), static_cast<int64_t>(end - first)});
    first = end;
  }
  return {std::move(row_order), std::move(tiles)};
}

const std::vector<std::string>& stat_names() {
  static const std::vector<std::string> names = {
      "lookups",         "hit_tokens",        "recomputed_tokens", "device_evictions", "offloads",
      "onboards",        "host_evictions",    "prefix_truncations", "stalled_batches", "device_pages_used",
      "device_users",    "host_pages_used",   "host_users"};
  return names;
}

std::vector<int64_t> stats_vector(const Counters& c, int64_t device_pages_used, int64_t device_users,
                                  int64_t host_pages_used, int64_t host_users) {
  return {c.lookups,      c.hit_tokens,       c.recomputed_tokens,  c.device_evictions, c.offloads,
          c.onboards,     c.host_evictions,   c.prefix_truncations, c.stalled_batches,  device_pages_used,
          device_users,   host_pages_used,    host_users};
}

KVRuntime::KVRuntime(std::string name, RuntimeConfig config, at::Device device)
    : name_(std::move(name)), config_(std::move(config)) {
  const auto& c = config_;
  cache_ = at::zeros({c.num_layers, c.device_pages, 2, c.page_size, c.num_heads, c.head_dim},
                     at::TensorOptions().dtype(parse_dtype(c.dtype)).device(device));
  offload_tier_ = std::make_unique<HostTier>(c.host_pages, device.is_cuda());
  if (cache_.is_cuda()) {
    copy_stream_ = c10::impl::VirtualGuardImpl(cache_.device().type()).getStreamFromGlobalPool(cache_.device());
  }
  reset();
}

void KVRuntime::acquire_batch(std::unique_lock<std::mutex>& lock) {
  const auto me = std::this_thread::get_id();
  const auto free_for_me = [&] { return !owner_ || *owner_ == me; };
  while (!free_for_me()) {
    if (owner_stalled()) {
      // The owner's request failed outside our ops or its host stopped calling: its state is
      // consistent (nothing uncommitted counts as cached) and its later ops will fail.
      ++counters_.stalled_batches;
      owner_.reset();
      break;
    }
    lock.unlock();
    {
      // GIL released first and taken back last, never while holding mutex_: a thread that
      // holds the GIL may be waiting for mutex_.
      ScopedGilRelease gil;
      std::unique_lock<std::mutex> wait_lock(mutex_);
      released_.wait_for(wait_lock, std::chrono::milliseconds(config_.stall_timeout_ms), free_for_me);
    }
    lock.lock();
  }
}

bool KVRuntime::owner_stalled() const {
  return std::chrono::steady_clock::now() - last_progress_ > std::chrono::milliseconds(config_.stall_timeout_ms);
}

void KVRuntime::check_batch(const std::vector<int64_t>& user_ids, const std::vector<int64_t>& token_ids,
                            const std::vector<int64_t>& token_lengths,
                            const std::vector<int64_t>& num_candidates) const {
  const auto num_users = user_ids.size();
  if (token_lengths.size() != num_users || num_candidates.size() != num_users) {
    throw invalid_request("begin_batch: user_ids (" + std::to_string(num_users) + "), token_lengths (" +
                                std::to_string(token_lengths.size()) + ") and num_candidates (" +
                                std::to_string(num_candidates.size()) + ") differ in length");
  }
  std::vector<int64_t> sorted = user_ids;
  std::sort(sorted.begin(), sorted.end());
  const auto dup = std::adjacent_find(sorted.begin(), sorted.end());
  if (dup != sorted.end()) {
    throw invalid_request("user id " + std::to_string(*dup) + " appears twice in one batch");
  }
  int64_t total = 0;
  int64_t pages = 0;
  for (size_t b = 0; b < num_users; ++b) {
    if (token_lengths[b] < 0 || num_candidates[b] < 0) {
      throw invalid_request("begin_batch: negative length for user " + std::to_string(user_ids[b]));
    }
    total += token_lengths[b];
    pages += config_.pages_for(token_lengths[b]);
  }
  if (total != static_cast<int64_t>(token_ids.size())) {
    throw invalid_request("begin_batch: token_lengths sum to " + std::to_string(total) + " but there are " +
                                std::to_string(token_ids.size()) + " tokens");
  }
  if (pages > config_.device_pages) {
    std::ostringstream msg;
    msg << "KV cache capacity exceeded: the batch of " << num_users << " users needs " << pages
        << " device pages but kv_cache.device_pages is " << config_.device_pages;
    throw RequestError(ErrorCode::kCapacityExceeded, msg.str());
  }
}

const BatchPlan& KVRuntime::begin_batch(const std::vector<int64_t>& user_ids, const std::vector<int64_t>& token_ids,
                                        const std::vector<int64_t>& token_lengths,
                                        const std::vector<int64_t>& num_candidates) {
  std::unique_lock<std::mutex> lock(mutex_);
  acquire_batch(lock);
  if (owner_) {
    // A batch of this thread that never ended is abandoned; its state is consistent (only the
    // common prefix counts as cached until a batch commits). Waiters are woken on release.
    owner_.reset();
    released_.notify_all();
  }
  check_batch(user_ids, token_ids, token_lengths, num_candidates);

  std::unordered_map<int64_t, bool> in_batch;
  for (auto u : user_ids) in_batch[u] = true;
  // Take the batch's offloaded users out of the offload tier first, so that evictions made
  // for this batch cannot push them out before they are onboarded.
  std::vector<std::optional<OffloadedUser>> offloaded(user_ids.size());
  for (size_t b = 0; b < user_ids.size(); ++b) {
    if (!users_.count(user_ids[b])) offloaded[b] = offload_tier_->take(user_ids[b]);
  }
  plan_ = BatchPlan{};
  plan_.user_ids = user_ids;
  int64_t offset = 0;
  for (size_t b = 0; b < user_ids.size(); ++b) {
    const int64_t* tokens = token_ids.data() + offset;
    const int64_t cached = reuse_prefix(user_ids[b], tokens, token_lengths[b], offloaded[b]);
    plan_.cached_lengths.push_back(cached);
    plan_.prefix_tokens.emplace_back(tokens, tokens + token_lengths[b]);
    offset += token_lengths[b];
  }
  for (size_t b = 0; b < user_ids.size(); ++b) {
    auto& entry = users_[user_ids[b]];
    if (offloaded[b] && plan_.cached_lengths[b] > 0) {
      entry.pages = allocate_pages(config_.pages_for(plan_.cached_lengths[b]), in_batch);
      onboard(entry, *offloaded[b], plan_.cached_lengths[b]);
    }
    const int64_t missing = config_.pages_for(token_lengths[b]) - static_cast<int64_t>(entry.pages.size());
    if (missing > 0) {
      auto pages = allocate_pages(missing, in_batch);
      entry.pages.insert(entry.pages.end(), pages.begin(), pages.end());
    }
    entry.last_used = ++clock_;
  }
  build_plan(token_lengths, num_candidates);
  owner_ = std::this_thread::get_id();
  last_progress_ = std::chrono::steady_clock::now();
  return plan_;
}

int64_t KVRuntime::reuse_prefix(int64_t user_id, const int64_t* tokens, int64_t length,
                                std::optional<OffloadedUser>& offloaded) {
  ++counters_.lookups;
  const std::vector<int64_t>* stored = nullptr;
  auto it = users_.find(user_id);
  if (it != users_.end()) {
    stored = &it->second.token_ids;
  } else if (offloaded) {
    stored = &offloaded->token_ids;
  }
  int64_t reused = 0;
  if (stored) {
    reused = common_prefix(stored->data(), static_cast<int64_t>(stored->size()), tokens, length);
    if (reused < static_cast<int64_t>(stored->size())) ++counters_.prefix_truncations;
  }
  if (it != users_.end()) truncate(it->second, reused);
  if (offloaded && reused == 0) offloaded.reset();
  counters_.hit_tokens += reused;
  counters_.recomputed_tokens += length - reused;
  return reused;
}

void KVRuntime::truncate(UserEntry& entry, int64_t num_tokens) {
  entry.token_ids.resize(std::min<size_t>(entry.token_ids.size(), num_tokens));
  const auto keep = static_cast<size_t>(config_.pages_for(num_tokens));
  while (entry.pages.size() > keep) {
    free_pages_.push_back(entry.pages.back());
    entry.pages.pop_back();
  }
}

std::vector<int64_t> KVRuntime::allocate_pages(int64_t count, const std::unordered_map<int64_t, bool>& in_batch) {
  while (static_cast<int64_t>(free_pages_.size()) < count) {
    evict_lru_user(in_batch);
  }
  std::vector<int64_t> pages(free_pages_.end() - count, free_pages_.end());
  free_pages_.resize(free_pages_.size() - count);
  return pages;
}

void KVRuntime::evict_lru_user(const std::unordered_map<int64_t, bool>& in_batch) {
  auto victim = users_.end();
  for (auto it = users_.begin(); it != users_.end(); ++it) {
    if (in_batch.count(it->first)) continue;
    if (victim == users_.end() || it->second.last_used < victim->second.last_used) victim = it;
  }
  if (victim == users_.end()) {
    // check_batch() guarantees the batch fits once every other user is gone.
    throw std::logic_error("kvexport bug: no user left to evict although the batch fits");
  }
  evict(victim);
}

void KVRuntime::evict(std::unordered_map<int64_t, UserEntry>::iterator user) {
  const int64_t user_id = user->first;
  UserEntry entry = std::move(user->second);
  users_.erase(user);
  ++counters_.device_evictions;
  offload(user_id, std::move(entry));
}

at::Tensor KVRuntime::cached_pages(const UserEntry& entry) const {
  const int64_t num_pages = config_.pages_for(static_cast<int64_t>(entry.token_ids.size()));
  const auto index = at::tensor(std::vector<int64_t>(entry.pages.begin(), entry.pages.begin() + num_pages), at::kLong)
                         .to(cache_.device());
  return cache_.index_select(1, index);  // [layers, num_pages, 2, page_size, H, dh]
}

at::Tensor KVRuntime::pages_to_host(const UserEntry& entry, std::shared_ptr<c10::Event>& ready) {
  const auto pages = cached_pages(entry);  // a copy on the compute stream: the pages may be reused at once
  if (!copy_stream_) return pages.to(at::kCPU);
  const auto type = cache_.device().type();
  c10::Event gathered(type);
  gathered.record(c10::impl::VirtualGuardImpl(type).getStream(cache_.device()));
  gathered.block(*copy_stream_);
  auto host = at::empty(pages.sizes(), pages.options().device(at::kCPU).pinned_memory(true));
  {
    c10::StreamGuard on_copy_stream(*copy_stream_);
    host.copy_(pages, /*non_blocking=*/true);
  }
  pages.record_stream(*copy_stream_);  // kept from reuse until the copy stream is done with it
  ready = std::make_shared<c10::Event>(type);
  ready->record(*copy_stream_);
  return host;
}

void KVRuntime::offload(int64_t user_id, UserEntry entry) {
  if (!entry.token_ids.empty()) {
    OffloadedUser user{entry.token_ids, {}, nullptr};
    user.pages = pages_to_host(entry, user.ready);
    const int64_t dropped = offload_tier_->put(user_id, std::move(user));
    counters_.host_evictions += dropped;
    if (offload_tier_->num_tokens(user_id)) ++counters_.offloads;
  }
  free_pages_.insert(free_pages_.end(), entry.pages.begin(), entry.pages.end());
}

void KVRuntime::onboard(UserEntry& entry, const OffloadedUser& offloaded, int64_t num_tokens) {
  const int64_t num_pages = config_.pages_for(num_tokens);
  auto index = at::tensor(entry.pages, at::kLong).to(cache_.device());
  const auto source = offloaded.pages.narrow(1, 0, num_pages);
  if (!copy_stream_) {
    cache_.index_copy_(1, index, source.to(cache_.device()));
  } else {
    // Host to device on the copy stream (after the offload's own copy into host memory), then
    // the compute stream waits for it before writing the pages.
    const auto type = cache_.device().type();
    const auto compute = c10::impl::VirtualGuardImpl(type).getStream(cache_.device());
    if (offloaded.ready) offloaded.ready->block(*copy_stream_);
    at::Tensor staged;
    {
      c10::StreamGuard on_copy_stream(*copy_stream_);
      staged = source.to(cache_.device(), /*non_blocking=*/true);
    }
    staged.record_stream(compute);
    c10::Event arrived(type);
    arrived.record(*copy_stream_);
    arrived.block(compute);
    cache_.index_copy_(1, index, staged);
  }
  entry.token_ids.assign(offloaded.token_ids.begin(), offloaded.token_ids.begin() + num_tokens);
  ++counters_.onboards;
}

void KVRuntime::build_plan(const std::vector<int64_t>& token_lengths, const std::vector<int64_t>& num_candidates) {
  const auto num_users = static_cast<int64_t>(plan_.user_ids.size());
  int64_t max_pages = 1;
  for (auto length : token_lengths) max_pages = std::max(max_pages, config_.pages_for(length));
  std::vector<int64_t> page_table(num_users * max_pages, 0);
  std::vector<int64_t> row_user, row_keys, write_slots;
  std::vector<uint8_t> row_candidate;
  for (int64_t b = 0; b < num_users; ++b) {
    const auto& pages = users_.at(plan_.user_ids[b]).pages;
    std::copy(pages.begin(), pages.end(), page_table.begin() + b * max_pages);
    for (int64_t t = 0; t < num_candidates[b]; ++t) {
      row_user.push_back(b);
      row_keys.push_back(token_lengths[b]);
      row_candidate.push_back(1);
    }
  }
  plan_.num_candidate_rows = static_cast<int64_t>(row_user.size());
  for (int64_t b = 0; b < num_users; ++b) {
    const auto& pages = users_.at(plan_.user_ids[b]).pages;
    for (int64_t p = plan_.cached_lengths[b]; p < token_lengths[b]; ++p) {
      row_user.push_back(b);
      row_keys.push_back(p + 1);
      row_candidate.push_back(0);
      write_slots.push_back(pages[p / config_.page_size] * 2 * config_.page_size + p % config_.page_size);
    }
  }
  plan_.num_new_prefix_rows = static_cast<int64_t>(write_slots.size());
  plan_.max_row_keys = row_keys.empty() ? 0 : *std::max_element(row_keys.begin(), row_keys.end());
  const auto [row_order, tiles] = user_tiles(row_user, kAttentionTileRows);
  // One host-to-device copy per request: every per-request tensor is a view of one buffer (pinned
  // on CUDA, so the copy is asynchronous on the current stream).
  std::vector<int64_t> value_slots(write_slots);
  for (auto& slot : value_slots) slot += config_.page_size;  // a page holds its k rows, then its v rows
  const std::vector<const std::vector<int64_t>*> parts = {
      &page_table, &row_user, &row_keys, &write_slots, &value_slots, &plan_.cached_lengths, &row_order, &tiles};
  int64_t total = static_cast<int64_t>(row_candidate.size());
  for (const auto* part : parts) total += static_cast<int64_t>(part->size());
  const auto device = cache_.device();
  auto host = at::empty({total}, at::TensorOptions().dtype(at::kLong).pinned_memory(device.is_cuda()));
  int64_t* cursor = host.data_ptr<int64_t>();
  for (const auto* part : parts) cursor = std::copy(part->begin(), part->end(), cursor);
  std::copy(row_candidate.begin(), row_candidate.end(), cursor);
  const auto uploaded = host.to(device, /*non_blocking=*/true);
  int64_t offset = 0;
  const auto next = [&](size_t count) {
    auto view = uploaded.narrow(0, offset, static_cast<int64_t>(count));
    offset += static_cast<int64_t>(count);
    return view;
  };
  plan_.page_table = next(page_table.size()).view({num_users, max_pages});
  plan_.row_user = next(row_user.size());
  plan_.row_keys = next(row_keys.size());
  plan_.write_slots = next(write_slots.size());
  plan_.value_slots = next(value_slots.size());
  plan_.cached_lengths_tensor = next(plan_.cached_lengths.size());
  plan_.row_order = next(row_order.size());
  plan_.tiles = next(tiles.size()).view({-1, 3});
  plan_.row_candidate = next(row_candidate.size()).ne(0);
}

const BatchPlan& KVRuntime::owned_batch() const {
  if (!owner_ || *owner_ != std::this_thread::get_id()) {
    throw RequestError(ErrorCode::kInternal, name_ + ": this thread has no batch in flight (it was released after " +
                                                 "stalling for " + std::to_string(config_.stall_timeout_ms) +
                                                 " ms, or begin_batch never ran)");
  }
  return plan_;
}

void KVRuntime::store_new_kv(const BatchPlan& plan, int64_t layer, const at::Tensor& k, const at::Tensor& v) {
  if (layer < 0 || layer >= config_.num_layers) {
    throw RequestError(ErrorCode::kInternal, "layer " + std::to_string(layer) + " outside 0.." +
                                                 std::to_string(config_.num_layers - 1));
  }
  const int64_t rows = plan.num_candidate_rows + plan.num_new_prefix_rows;
  if (k.dim() != 3 || v.dim() != 3 || k.size(0) != rows || v.size(0) != rows) {
    throw RequestError(ErrorCode::kInternal, "expected k and v of " + std::to_string(rows) + " rows, got k " +
                                                 std::to_string(k.size(0)) + ", v " + std::to_string(v.size(0)));
  }
  auto slots = cache_.select(0, layer).view({-1, config_.num_heads, config_.head_dim});
  const auto new_k = k.narrow(0, plan.num_candidate_rows, plan.num_new_prefix_rows).to(cache_.dtype());
  const auto new_v = v.narrow(0, plan.num_candidate_rows, plan.num_new_prefix_rows).to(cache_.dtype());
  slots.index_copy_(0, plan.write_slots, new_k);
  slots.index_copy_(0, plan.value_slots, new_v);
}

void KVRuntime::end_batch(const std::vector<int64_t>& user_ids) {
  std::unique_lock<std::mutex> lock(mutex_);
  const auto& plan = owned_batch();
  if (user_ids != plan.user_ids) {
    throw std::logic_error("kvexport bug: end_batch for other users than begin_batch");
  }
  for (size_t b = 0; b < plan.user_ids.size(); ++b) {
    users_.at(plan.user_ids[b]).token_ids = plan.prefix_tokens[b];
  }
  owner_.reset();
  lock.unlock();
  released_.notify_all();
}

void KVRuntime::abort_batch() {
  std::unique_lock<std::mutex> lock(mutex_);
  if (!owner_ || *owner_ != std::this_thread::get_id()) return;
  owner_.reset();  // nothing is committed: the users keep only their common prefixes
  lock.unlock();
  released_.notify_all();
}

std::vector<int64_t> KVRuntime::stats() {
  std::unique_lock<std::mutex> lock(mutex_);
  acquire_batch(lock);
  const int64_t used = config_.device_pages - static_cast<int64_t>(free_pages_.size());
  return stats_vector(counters_, used, static_cast<int64_t>(users_.size()), offload_tier_->used_pages(),
                      offload_tier_->num_users());
}

void KVRuntime::reset() {
  std::unique_lock<std::mutex> lock(mutex_);
  acquire_batch(lock);
  users_.clear();
  offload_tier_->clear();
  free_pages_.resize(config_.device_pages);
  // Pages are handed out from the back: page 0 first.
  std::iota(free_pages_.rbegin(), free_pages_.rend(), 0);
  counters_ = Counters{};
  clock_ = 0;
  plan_ = BatchPlan{};
  owner_.reset();
  cache_.zero_();
  released_.notify_all();
}

bool KVRuntime::evict_user(int64_t user_id) {
  std::unique_lock<std::mutex> lock(mutex_);
  acquire_batch(lock);
  auto it = users_.find(user_id);
  if (it == users_.end()) return false;
  evict(it);
  return true;
}

int64_t KVRuntime::cached_length(int64_t user_id) {
  std::unique_lock<std::mutex> lock(mutex_);
  acquire_batch(lock);
  auto it = users_.find(user_id);
  if (it != users_.end()) return static_cast<int64_t>(it->second.token_ids.size());
  return offload_tier_->num_tokens(user_id).value_or(0);
}

std::vector<int64_t> KVRuntime::device_users_lru() {
  std::unique_lock<std::mutex> lock(mutex_);
  acquire_batch(lock);
  std::vector<std::pair<int64_t, int64_t>> by_age;
  for (const auto& [user, entry] : users_) by_age.emplace_back(entry.last_used, user);
  std::sort(by_age.begin(), by_age.end());
  std::vector<int64_t> users;
  for (const auto& [age, user] : by_age) users.push_back(user);
  return users;
}

at::Tensor KVRuntime::read_user_kv(int64_t user_id) {
  std::unique_lock<std::mutex> lock(mutex_);
  acquire_batch(lock);
  auto it = users_.find(user_id);
  if (it == users_.end()) {
    throw invalid_request("user " + std::to_string(user_id) + " is not on the device tier of " + name_);
  }
  const auto num_tokens = static_cast<int64_t>(it->second.token_ids.size());
  const int64_t num_pages = config_.pages_for(num_tokens);
  return cached_pages(it->second)
      .permute({0, 2, 1, 3, 4, 5})
      .reshape({config_.num_layers, 2, num_pages * config_.page_size, config_.num_heads, config_.head_dim})
      .narrow(2, 0, num_tokens)
      .clone();
}

namespace {

std::mutex registry_mutex;
// Never destroyed: a runtime still registered when the host process exits would otherwise be
// destroyed by a static destructor, after the CUDA runtime and torch's allocators it frees into
// are gone (a host that exits without dropping its runtime then crashes on the way out).
std::unordered_map<std::string, std::shared_ptr<KVRuntime>>& registry() {
  static auto* runtimes = new std::unordered_map<std::string, std::shared_ptr<KVRuntime>>();
  return *runtimes;
}

// `wanted` without an index (plain "cuda") matches the runtime's device of that type.
bool same_device(const at::Device& runtime, const at::Device& wanted) {
  return runtime.type() == wanted.type() && (!wanted.has_index() || runtime.index() == wanted.index());
}

}  // namespace

std::shared_ptr<KVRuntime> get_or_create_runtime(const std::string& name, const std::string& config_json,
                                                 at::Device device) {
  auto config = RuntimeConfig::from_json(config_json);
  std::lock_guard<std::mutex> lock(registry_mutex);
  auto& slot = registry()[name];
  if (!slot) {
    slot = std::make_shared<KVRuntime>(name, config, device);
  } else if (!(slot->config() == config) || !same_device(slot->device(), device)) {
    throw std::invalid_argument("KV runtime '" + name +
                                "' already exists in this process with a different config or device");
  }
  return slot;
}

std::shared_ptr<KVRuntime> find_runtime(const std::string& name) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  auto it = registry().find(name);
  if (it == registry().end()) {
    throw std::invalid_argument("no KV runtime named '" + name + "' in this process");
  }
  return it->second;
}

bool drop_runtime(const std::string& name) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  return registry().erase(name) > 0;
}

}  // namespace kvexport::runtime
