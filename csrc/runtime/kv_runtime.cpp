#include "runtime/kv_runtime.h"

#include "runtime/fp8_pages.h"
#include "runtime/host_tier.h"
#include "runtime/parallel.h"
#include "runtime/python_gil.h"
#include "runtime/staging.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <algorithm>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <typeinfo>
#include <unordered_map>

namespace kvexport::runtime {

namespace {

RequestError invalid_request(const std::string& message) {
  return RequestError(ErrorCode::kInvalidRequest, message);
}

// The first `count` of a user's pages as an index on `device`, copied without waiting for it.
at::Tensor page_index(const std::vector<int64_t>& pages, int64_t count, const at::Device& device) {
  auto host = staging_buffer(count, device);
  std::copy(pages.begin(), pages.begin() + count, host.data_ptr<int64_t>());
  return host.to(device, /*non_blocking=*/true);
}

// slots [cache rows, H, dh] (one layer's cache) at index[i] <- rows[i] (rows [n, H, dh]). On the
// CPU, where the rows are the model's k or v (each row's values contiguous, any stride between
// rows) in the cache's dtype, a memcpy a row: index_copy_ of the same rows costs a contiguous copy
// and more than the copy itself in dispatch at a cached request's few rows. Elsewhere index_copy_.
void store_rows(at::Tensor& slots, const at::Tensor& index, const at::Tensor& rows) {
  if (rows.dim() != 3 || rows.size(1) != slots.size(1) || rows.size(2) != slots.size(2) || index.dim() != 1 ||
      rows.size(0) != index.size(0)) {
    throw RequestError(ErrorCode::kInternal, "cannot store rows of shape " + c10::str(rows.sizes()) + " at " +
                                                 c10::str(index.sizes()) + " slots of a cache of rows " +
                                                 c10::str(slots.sizes()));
  }
  const bool row_copies = slots.is_cpu() && rows.is_cpu() && index.is_cpu() && slots.is_contiguous() &&
                          rows.scalar_type() == slots.scalar_type() && index.scalar_type() == at::kLong &&
                          index.is_contiguous() && rows.stride(2) == 1 && rows.stride(1) == rows.size(2);
  if (!row_copies) {
    slots.index_copy_(0, index, rows.to(slots.dtype()));
    return;
  }
  const int64_t count = slots.size(0), row_bytes = slots.size(1) * slots.size(2) * slots.element_size(),
                from_stride = rows.stride(0) * rows.element_size();
  const int64_t* at = index.const_data_ptr<int64_t>();
  auto* to = static_cast<char*>(slots.data_ptr());
  const auto* from = static_cast<const char*>(rows.const_data_ptr());
  for (int64_t i = 0; i < index.size(0); ++i) {
    if (at[i] < 0 || at[i] >= count) {
      throw RequestError(ErrorCode::kInternal,
                         "cache slot " + std::to_string(at[i]) + " outside 0.." + std::to_string(count - 1));
    }
    std::memcpy(to + at[i] * row_bytes, from + i * from_stride, row_bytes);
  }
}

// How many leading tokens a and b share. Compared a block at a time with memcmp (vectorised by the
// C library), then token by token within the first block that differs.
int64_t common_prefix(const int64_t* a, int64_t a_len, const int64_t* b, int64_t b_len) {
  constexpr int64_t kBlock = 256;
  const int64_t n = std::min(a_len, b_len);
  int64_t i = 0;
  while (i + kBlock <= n && std::memcmp(a + i, b + i, kBlock * sizeof(int64_t)) == 0) i += kBlock;
  while (i < n && a[i] == b[i]) ++i;
  return i;
}

}  // namespace

KVRuntime::KVRuntime(std::string name, RuntimeConfig config, at::Device device)
    : name_(std::move(name)), config_(std::move(config)), pages_(config_.device_pages) {
  const auto& c = config_;
  if (c.fp8_pages() && !device.is_cpu()) {
    throw std::invalid_argument(
        "FP8 pages need the Hopper kernel's FP8 path, not built yet: kv_cache.dtype "
        "float8_e4m3 runs on the CPU only, got device " +
        device.str());
  }
  // One page more than the pool hands out: step programs' padding rows write there.
  std::vector<int64_t> shape{c.num_layers, c.device_pages + 1};
  for (int64_t size : c.page_shape()) shape.push_back(size);
  cache_ = at::zeros(shape, at::TensorOptions().dtype(c.cache_scalar_type()).device(device));
  tiers_.append(std::make_unique<HostTier>(c.host_pages, device.is_cuda()));
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

void KVRuntime::check_batch(const std::vector<int64_t>& user_ids, c10::ArrayRef<int64_t> token_ids,
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

PlannedBatch KVRuntime::begin_batch(const std::vector<int64_t>& user_ids, c10::ArrayRef<int64_t> token_ids,
                                    const std::vector<int64_t>& token_lengths,
                                    const std::vector<int64_t>& num_candidates) {
  check_batch(user_ids, token_ids, token_lengths, num_candidates);  // reads the config only
  auto remote = read_remote(user_ids);
  std::unique_lock<std::mutex> lock(mutex_);
  const auto user_pages = plan_batch(lock, user_ids, token_ids, token_lengths, remote);
  auto new_tokens =
      build_plan_tensors(plan_, user_pages, token_lengths, num_candidates, config_.page_size, cache_.device());
  // By value, under the lock: once it is released, a stalled batch's plan may be replaced.
  return {std::move(new_tokens), plan_.num_candidate_rows + plan_.num_new_prefix_rows};
}

StepPlan KVRuntime::begin_step(const std::vector<int64_t>& user_ids, c10::ArrayRef<int64_t> token_ids,
                               const std::vector<int64_t>& token_lengths, const std::vector<int64_t>& num_candidates,
                               c10::ArrayRef<int64_t> candidate_ids, int64_t max_prefix_length) {
  check_batch(user_ids, token_ids, token_lengths, num_candidates);
  int64_t total_candidates = 0;
  for (auto count : num_candidates) total_candidates += count;
  if (total_candidates != static_cast<int64_t>(candidate_ids.size())) {
    throw invalid_request("begin_step: num_candidates sum to " + std::to_string(total_candidates) + " but there are " +
                          std::to_string(candidate_ids.size()) + " candidates");
  }
  auto remote = read_remote(user_ids);
  std::unique_lock<std::mutex> lock(mutex_);
  const auto user_pages = plan_batch(lock, user_ids, token_ids, token_lengths, remote);
  // The page after the pool's last one belongs to no user: padding rows write there.
  const int64_t trash_slot = config_.device_pages * 2 * config_.page_size;
  return build_step_plan(plan_, user_pages, token_lengths, num_candidates, token_ids, candidate_ids, config_.page_size,
                         config_.pages_for(max_prefix_length), trash_slot, cache_.device());
}

std::vector<const std::vector<int64_t>*> KVRuntime::plan_batch(std::unique_lock<std::mutex>& lock,
                                                               const std::vector<int64_t>& user_ids,
                                                               c10::ArrayRef<int64_t> token_ids,
                                                               const std::vector<int64_t>& token_lengths,
                                                               std::vector<std::optional<OffloadedUser>>& remote) {
  acquire_batch(lock);
  if (owner_) {
    // A batch of this thread that never ended is abandoned; its state is consistent (only the
    // common prefix counts as cached until a batch commits). Waiters are woken on release.
    owner_.reset();
    released_.notify_all();
  }

  const std::unordered_set<int64_t> in_batch(user_ids.begin(), user_ids.end());
  // Take the batch's offloaded users out of the tier chain first, so that evictions made for
  // this batch cannot push them out before they are onboarded. A user another request brought
  // back meanwhile is taken from where it is now; its remote entry is not used.
  std::vector<int64_t> absent;
  for (auto user : user_ids) {
    if (!users_.find(user)) absent.push_back(user);
  }
  auto found = tiers_.take_many(absent);
  std::vector<std::optional<OffloadedUser>> offloaded(user_ids.size());
  for (size_t b = 0, next = 0; b < user_ids.size(); ++b) {
    if (next < absent.size() && absent[next] == user_ids[b]) {
      offloaded[b] = std::move(found[next++]);
      if (!offloaded[b] && !remote.empty()) offloaded[b] = std::move(remote[b]);
    }
  }
  // Each user's common prefix with the tokens cached for it, compared on several threads for a
  // request of many tokens; then reused in batch order.
  const auto num_users = static_cast<int64_t>(user_ids.size());
  std::vector<int64_t> first_token(num_users + 1, 0), common(num_users, 0);
  std::vector<const std::vector<int64_t>*> stored(num_users);
  for (int64_t b = 0; b < num_users; ++b) {
    first_token[b + 1] = first_token[b] + token_lengths[b];
    stored[b] = cached_tokens(users_.find(user_ids[b]), offloaded[b]);
  }
  const auto compare = [&](int64_t b) {
    if (stored[b]) {
      common[b] = common_prefix(stored[b]->data(), static_cast<int64_t>(stored[b]->size()),
                                token_ids.data() + first_token[b], token_lengths[b]);
    }
  };
  const bool parallel = first_token[num_users] >= kParallelTokens && !at::in_parallel_region();
  for_each_item(num_users, parallel ? at::get_num_threads() : 1, compare);
  plan_ = BatchPlan{};
  plan_.user_ids = user_ids;
  plan_.context_rows_see_prefix = config_.context_rows_see_prefix;
  for (int64_t b = 0; b < num_users; ++b) {
    const int64_t* tokens = token_ids.data() + first_token[b];
    const int64_t cached = reuse_prefix(user_ids[b], common[b], token_lengths[b], offloaded[b]);
    plan_.cached_lengths.push_back(cached);
    plan_.uncached_tokens.emplace_back(tokens + cached, tokens + token_lengths[b]);
  }
  for (size_t b = 0; b < user_ids.size(); ++b) {
    auto& entry = users_.touch(user_ids[b]);
    if (offloaded[b] && plan_.cached_lengths[b] > 0) {
      entry.pages = allocate_pages(config_.pages_for(plan_.cached_lengths[b]), in_batch);
      onboard(entry, *offloaded[b], plan_.cached_lengths[b]);
    }
    const int64_t missing = config_.pages_for(token_lengths[b]) - static_cast<int64_t>(entry.pages.size());
    if (missing > 0) {
      auto pages = allocate_pages(missing, in_batch);
      entry.pages.insert(entry.pages.end(), pages.begin(), pages.end());
    }
  }
  std::vector<const std::vector<int64_t>*> user_pages;
  for (auto user : user_ids) user_pages.push_back(&users_.find(user)->pages);
  owner_ = std::this_thread::get_id();
  last_progress_ = std::chrono::steady_clock::now();
  return user_pages;
}

std::vector<std::optional<OffloadedUser>> KVRuntime::read_remote(const std::vector<int64_t>& user_ids) {
  OffloadTier* remote = remote_.load();
  if (!remote) return {};
  // Released before mutex_ is taken and taken back after it is released: a thread holding the GIL
  // may be waiting for mutex_.
  ScopedGilRelease gil;
  std::vector<int64_t> wanted;
  std::vector<size_t> slots;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (size_t b = 0; b < user_ids.size(); ++b) {
      if (!users_.find(user_ids[b]) && !tiers_.num_tokens(user_ids[b])) {
        wanted.push_back(user_ids[b]);
        slots.push_back(b);
      }
    }
  }
  std::vector<std::optional<OffloadedUser>> users(user_ids.size());
  if (wanted.empty()) return users;
  auto found = remote->take_many(wanted);
  for (size_t i = 0; i < slots.size(); ++i) users[slots[i]] = std::move(found[i]);
  return users;
}

const std::vector<int64_t>* KVRuntime::cached_tokens(const UserEntry* entry,
                                                     const std::optional<OffloadedUser>& offloaded) {
  return entry ? &entry->token_ids : offloaded ? &offloaded->token_ids : nullptr;
}

int64_t KVRuntime::reuse_prefix(int64_t user_id, int64_t common, int64_t length,
                                std::optional<OffloadedUser>& offloaded) {
  ++counters_.lookups;
  auto* entry = users_.find(user_id);
  const std::vector<int64_t>* stored = cached_tokens(entry, offloaded);
  int64_t reused = 0;
  if (stored) {
    reused = common;
    // Contextual rows that read the whole prefix make every cached state depend on all of it:
    // reuse it whole or not at all.
    const bool whole = common == length && common == static_cast<int64_t>(stored->size());
    if (config_.context_rows_see_prefix > 0 && !whole) reused = 0;
    if (reused < static_cast<int64_t>(stored->size())) ++counters_.prefix_truncations;
  }
  if (entry) truncate(*entry, reused);
  if (offloaded && offloaded->source == TierKind::kRemote) {
    // A shared entry is used only for its common prefix with this request's tokens.
    if (reused > 0) {
      ++counters_.remote.hits;
      counters_.remote.hit_tokens += reused;
    } else {
      ++counters_.remote.rejected_prefix;
    }
  }
  if (offloaded && reused == 0) offloaded.reset();
  counters_.hit_tokens += reused;
  counters_.recomputed_tokens += length - reused;
  return reused;
}

void KVRuntime::truncate(UserEntry& entry, int64_t num_tokens) {
  entry.token_ids.resize(std::min<size_t>(entry.token_ids.size(), num_tokens));
  const auto keep = static_cast<size_t>(config_.pages_for(num_tokens));
  while (entry.pages.size() > keep) {
    pages_.release(entry.pages.back());
    entry.pages.pop_back();
  }
}

std::vector<int64_t> KVRuntime::allocate_pages(int64_t count, const std::unordered_set<int64_t>& in_batch) {
  while (pages_.num_free() < count) {
    const auto victim = users_.least_recent(in_batch);
    if (!victim) {
      // check_batch() guarantees the batch fits once every other user is gone.
      throw std::logic_error("kvexport bug: no user left to evict although the batch fits");
    }
    evict(*victim);
  }
  return pages_.allocate(count);
}

void KVRuntime::evict(int64_t user_id) {
  auto entry = users_.remove(user_id);
  ++counters_.device_evictions;
  offload(user_id, std::move(*entry));
}

at::Tensor KVRuntime::cached_pages(const UserEntry& entry) const {
  const int64_t num_pages = config_.pages_for(static_cast<int64_t>(entry.token_ids.size()));
  // [layers, num_pages, 2, page_size, H, dh]
  return cache_.index_select(1, page_index(entry.pages, num_pages, cache_.device()));
}

OffloadedUser KVRuntime::copy_to_host(const UserEntry& entry) {
  OffloadedUser user{entry.token_ids, {}, nullptr, TierKind::kHost};
  const auto pages = cached_pages(entry);  // a copy on the compute stream: the pages may be reused at once
  if (!copy_stream_) {
    user.pages = pages.to(at::kCPU);
    return user;
  }
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
  user.ready = std::make_shared<c10::Event>(type);
  user.ready->record(*copy_stream_);
  user.pages = std::move(host);
  return user;
}

void KVRuntime::offload(int64_t user_id, UserEntry entry) {
  if (!entry.token_ids.empty()) {
    counters_.host_evictions += tiers_.put(user_id, copy_to_host(entry));
    if (tiers_.num_tokens(user_id)) ++counters_.offloads;
  }
  pages_.release(entry.pages);
}

void KVRuntime::onboard(UserEntry& entry, const OffloadedUser& offloaded, int64_t num_tokens) {
  const int64_t num_pages = config_.pages_for(num_tokens);
  const auto index = page_index(entry.pages, static_cast<int64_t>(entry.pages.size()), cache_.device());
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
    throw RequestError(ErrorCode::kInternal,
                       "layer " + std::to_string(layer) + " outside 0.." + std::to_string(config_.num_layers - 1));
  }
  const int64_t rows = plan.num_candidate_rows + plan.num_new_prefix_rows;
  if (k.dim() != 3 || v.dim() != 3 || k.size(0) != rows || v.size(0) != rows) {
    throw RequestError(ErrorCode::kInternal, "expected k and v of " + std::to_string(rows) + " rows, got k " +
                                                 std::to_string(k.size(0)) + ", v " + std::to_string(v.size(0)));
  }
  store_layer_rows(layer, plan.write_slots, k.narrow(0, plan.num_candidate_rows, plan.num_new_prefix_rows));
  store_layer_rows(layer, plan.value_slots, v.narrow(0, plan.num_candidate_rows, plan.num_new_prefix_rows));
}

void KVRuntime::store_step_kv(int64_t layer, const at::Tensor& k, const at::Tensor& v, const at::Tensor& write_slots,
                              const at::Tensor& value_slots) {
  if (layer < 0 || layer >= config_.num_layers) {
    throw RequestError(ErrorCode::kInternal,
                       "layer " + std::to_string(layer) + " outside 0.." + std::to_string(config_.num_layers - 1));
  }
  const int64_t prefix_rows = write_slots.size(0);
  if (k.dim() != 3 || v.dim() != 3 || k.size(0) != v.size(0) || k.size(0) < prefix_rows ||
      value_slots.size(0) != prefix_rows) {
    throw RequestError(ErrorCode::kInternal, "expected k and v of the same rows, at least the " +
                                                 std::to_string(prefix_rows) + " prefix rows; got k " +
                                                 std::to_string(k.size(0)) + ", v " + std::to_string(v.size(0)));
  }
  const int64_t first = k.size(0) - prefix_rows;  // rows are [candidates][prefix]
  store_layer_rows(layer, write_slots, k.narrow(0, first, prefix_rows));
  store_layer_rows(layer, value_slots, v.narrow(0, first, prefix_rows));
}

void KVRuntime::store_layer_rows(int64_t layer, const at::Tensor& index, const at::Tensor& rows) {
  auto layer_cache = cache_.select(0, layer);
  if (!config_.fp8_pages()) {
    auto slots = layer_cache.view({-1, config_.num_heads, config_.head_dim});
    store_rows(slots, index, rows);
    return;
  }
  try {
    fp8::store_rows(layer_cache, fp8_layout(), index, rows);
  } catch (const std::out_of_range& e) {
    throw RequestError(ErrorCode::kInternal, e.what());
  }
}

void KVRuntime::end_batch(const std::vector<int64_t>& user_ids, bool fewer_threads) {
  std::unique_lock<std::mutex> lock(mutex_);
  const auto& plan = owned_batch();
  if (user_ids != plan.user_ids) {
    throw std::logic_error("kvexport bug: end_batch for other users than begin_batch");
  }
  // Each entry holds its cached prefix (begin_batch truncated or onboarded it to that), to which
  // the batch's tokens are appended; checked for every user before any is committed.
  std::vector<UserEntry*> entries;
  for (size_t b = 0; b < plan.user_ids.size(); ++b) {
    auto* entry = users_.find(plan.user_ids[b]);
    if (!entry || static_cast<int64_t>(entry->token_ids.size()) != plan.cached_lengths[b]) {
      throw std::logic_error("kvexport bug: user " + std::to_string(plan.user_ids[b]) +
                             " was evicted or changed while its batch was in flight");
    }
    entries.push_back(entry);
  }
  const bool store = tiers_.stores_after_batch();
  for (size_t b = 0; b < plan.user_ids.size(); ++b) {
    auto& entry = *entries[b];
    entry.token_ids.insert(entry.token_ids.end(), plan.uncached_tokens[b].begin(), plan.uncached_tokens[b].end());
    if (store && !entry.token_ids.empty()) tiers_.store_after_batch(plan.user_ids[b], copy_to_host(entry));
  }
  if (fewer_threads) ++counters_.busy_host_requests;
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
  Counters counters = counters_;
  tiers_.add_counters(counters);
  return stats_vector(counters, Occupancy{pages_.num_used(), users_.size(), tiers_.used_pages(), tiers_.num_users()});
}

void KVRuntime::reset() {
  std::unique_lock<std::mutex> lock(mutex_);
  acquire_batch(lock);
  users_.clear();
  tiers_.clear();
  pages_.reset();
  counters_ = Counters{};
  plan_ = BatchPlan{};
  owner_.reset();
  cache_.zero_();
  released_.notify_all();
}

bool KVRuntime::evict_user(int64_t user_id) {
  std::unique_lock<std::mutex> lock(mutex_);
  acquire_batch(lock);
  if (owner_ && std::find(plan_.user_ids.begin(), plan_.user_ids.end(), user_id) != plan_.user_ids.end()) {
    // Only the batch's own thread gets here while it is in flight; its pages are being written.
    throw std::invalid_argument("user " + std::to_string(user_id) +
                                " is in this thread's batch in flight: end or abort the batch first");
  }
  if (!users_.find(user_id)) return false;
  evict(user_id);
  return true;
}

int64_t KVRuntime::cached_length(int64_t user_id) {
  std::unique_lock<std::mutex> lock(mutex_);
  acquire_batch(lock);
  if (const auto* entry = users_.find(user_id)) return static_cast<int64_t>(entry->token_ids.size());
  return tiers_.num_tokens(user_id).value_or(0);
}

void KVRuntime::append_tier(std::unique_ptr<OffloadTier> tier) {
  std::unique_lock<std::mutex> lock(mutex_);
  acquire_batch(lock);
  const auto& type = typeid(*tier);
  if (tiers_.has([&](const OffloadTier& held) { return typeid(held) == type; })) {
    throw std::invalid_argument("KV runtime '" + name_ + "' has a tier of this kind already");
  }
  OffloadTier* added = tier.get();
  tiers_.append(std::move(tier));
  if (added->is_remote()) remote_.store(added);
}

bool KVRuntime::flush_remote(std::chrono::milliseconds timeout) {
  OffloadTier* remote = remote_.load();
  if (!remote) return true;
  ScopedGilRelease gil;
  return remote->flush(timeout);
}

std::vector<int64_t> KVRuntime::device_users_lru() {
  std::unique_lock<std::mutex> lock(mutex_);
  acquire_batch(lock);
  return users_.lru_order();
}

at::Tensor KVRuntime::read_user_kv(int64_t user_id) {
  std::unique_lock<std::mutex> lock(mutex_);
  acquire_batch(lock);
  const auto* entry = users_.find(user_id);
  if (!entry) {
    throw invalid_request("user " + std::to_string(user_id) + " is not on the device tier of " + name_);
  }
  const auto num_tokens = static_cast<int64_t>(entry->token_ids.size());
  const int64_t num_pages = config_.pages_for(num_tokens);
  auto pages = cached_pages(*entry);
  if (config_.fp8_pages()) pages = fp8::dequantize_pages(pages, fp8_layout()).to(config_.scalar_type());
  return pages.permute({0, 2, 1, 3, 4, 5})
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
  std::shared_ptr<KVRuntime> dropped;
  {
    std::lock_guard<std::mutex> lock(registry_mutex);
    auto it = registry().find(name);
    if (it == registry().end()) return false;
    dropped = std::move(it->second);
    registry().erase(it);
  }
  // Destroyed here, outside the registry's lock: a remote tier's writer may take a moment to stop.
  return true;
}

}  // namespace kvexport::runtime
