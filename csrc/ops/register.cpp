// Every kvexport:: op: schemas in one TORCH_LIBRARY block, thin kernels that call the runtime.
// Typed wrappers, each with its fake beside it: kvexport/ops/wrappers.py; the list of ops: kvexport/ops/library.py.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <chrono>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "ops/paged_attention.h"
#include "runtime/fp8_pages.h"
#ifdef KVEXPORT_WITH_CUDA
#include "ops/paged_attention_cuda.h"
#endif
#include "ops/request_check.h"
#include "runtime/kv_runtime.h"
#include "runtime/url_redaction.h"
#ifdef KVEXPORT_WITH_REMOTE
#include "runtime/remote_tier.h"
#endif

namespace kvexport::ops {

namespace {

using runtime::ErrorCode;
using runtime::KVRuntime;
using runtime::RequestError;

std::vector<int64_t> values_of(const at::Tensor& host) {
  return {host.const_data_ptr<int64_t>(), host.const_data_ptr<int64_t>() + host.numel()};
}

// Releases the calling thread's batch on `runtime`, if there is one: a request that failed
// midway never keeps the runtime from other requests.
void release_batch(const std::string& runtime) {
  end_request_threads();
  try {
    runtime::find_runtime(runtime)->abort_batch();
  } catch (const std::exception&) {
    // No such runtime: nothing is held.
  }
}

// An op of a request whose earlier op failed. torch 2.11's CUDA AOTInductor packages do not check a
// custom op's error code (their CPU packages and torch 2.13's do): the package goes on, and the
// next ops get the failed op's outputs as undefined tensors. Such an op fails too, but leaves the
// first failure's code and message in last_error, where hosts read why the request failed.
struct AfterFailure : std::runtime_error {
  AfterFailure() : std::runtime_error("an earlier op of this request failed (kvexport::last_error says why)") {}
};

void require_defined(std::initializer_list<const at::Tensor*> inputs) {
  for (const auto* t : inputs) {
    if (!t->defined()) throw AfterFailure();
  }
}

// Every op of a request runs through here: a failure is recorded for kvexport::last_error
// (hosts read why a request failed there, never from exception text), the request's batch is
// released, and the error surfaces as one catchable exception (ValueError for the request's own
// faults).
template <typename F>
auto request_op(const std::string& runtime, F&& f) {
  try {
    return f();
  } catch (const AfterFailure& e) {
    release_batch(runtime);
    TORCH_CHECK(false, e.what());
  } catch (const RequestError& e) {
    runtime::record_last_error(runtime, e.code(), e.what());
    release_batch(runtime);
    if (e.code() == ErrorCode::kInternal) TORCH_CHECK(false, e.what());
    TORCH_CHECK_VALUE(false, e.what());
  } catch (const c10::Error& e) {
    runtime::record_last_error(runtime, ErrorCode::kInternal, e.what_without_backtrace());
    release_batch(runtime);
    throw;
  } catch (const std::exception& e) {
    runtime::record_last_error(runtime, ErrorCode::kInternal, e.what());
    release_batch(runtime);
    TORCH_CHECK(false, e.what());
  }
}

// Management ops: user errors (an unknown runtime, a bad config) as ValueError.
template <typename F>
auto management_op(F&& f) {
  try {
    return f();
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
}

RequestTensors check_request_op(const std::string& name, const std::string& limits, const at::Tensor& user_ids,
                                const at::Tensor& history_lengths, const at::Tensor& item_ids,
                                const at::Tensor& action_ids, const at::Tensor& context_ids,
                                const at::Tensor& num_candidates, const at::Tensor& candidate_ids) {
  runtime::clear_last_error(name);  // the first op of every request
  return request_op(name, [&] {
    return check_request(limits, user_ids, history_lengths, item_ids, action_ids, context_ids, num_candidates,
                         candidate_ids);
  });
}

// A 1-D int64 host tensor's values, read in place (the request's token ids are its largest tensor);
// `keep` holds the contiguous tensor they belong to.
c10::ArrayRef<int64_t> values_in_place(const char* what, const at::Tensor& host, at::Tensor& keep) {
  check_kind(what, host, 1);
  keep = host.contiguous();
  return {keep.const_data_ptr<int64_t>(), static_cast<size_t>(keep.numel())};
}

at::Tensor begin_batch(const std::string& name, const std::string& config, const at::Tensor& user_ids,
                       const at::Tensor& token_ids, const at::Tensor& token_lengths, const at::Tensor& num_candidates,
                       const at::Tensor& placement) {
  return request_op(name, [&] {
    require_defined({&user_ids, &token_ids, &token_lengths, &num_candidates});
    auto rt = runtime::get_or_create_runtime(name, config, placement.device());
    check_kind("user_ids", user_ids, 1);
    check_kind("token_lengths", token_lengths, 1);
    check_kind("num_candidates", num_candidates, 1);
    at::Tensor tokens;
    auto planned = rt->begin_batch(values_of(user_ids.contiguous()), values_in_place("token_ids", token_ids, tokens),
                                   values_of(token_lengths.contiguous()), values_of(num_candidates.contiguous()));
    if (rt->device().is_cpu()) begin_request_threads(planned.num_rows);
    return planned.new_tokens;
  });
}

std::tuple<at::Tensor, at::Tensor> begin_step(const std::string& name, const std::string& config,
                                              const at::Tensor& user_ids, const at::Tensor& token_ids,
                                              const at::Tensor& token_lengths, const at::Tensor& num_candidates,
                                              const at::Tensor& candidate_ids, const at::Tensor& placement,
                                              int64_t max_prefix_length) {
  return request_op(name, [&] {
    auto rt = runtime::get_or_create_runtime(name, config, placement.device());
    check_kind("user_ids", user_ids, 1);
    check_kind("token_lengths", token_lengths, 1);
    check_kind("num_candidates", num_candidates, 1);
    at::Tensor tokens, candidates;
    auto step = rt->begin_step(values_of(user_ids.contiguous()), values_in_place("token_ids", token_ids, tokens),
                               values_of(token_lengths.contiguous()), values_of(num_candidates.contiguous()),
                               values_in_place("candidate_ids", candidate_ids, candidates), max_prefix_length);
    if (rt->device().is_cpu()) begin_request_threads(step.layout.rows());
    return std::make_tuple(step.staged, at::tensor(step.layout.to_vector(), at::kLong));
  });
}

std::vector<at::Tensor> upload_op(const std::string& name, at::TensorList host, const at::Tensor& placement) {
  return request_op(name, [&] {
    for (const auto& t : host) require_defined({&t});
    return upload(host, placement.device());
  });
}

at::Tensor paged_attention(const std::string& name, int64_t layer, const at::Tensor& q, const at::Tensor& k,
                           const at::Tensor& v, double alpha, double inv_scaling_seqlen) {
  return request_op(name, [&] {
    require_defined({&q, &k, &v});
    return runtime::find_runtime(name)->with_layer(
        layer, k, v, [&](const runtime::BatchPlan& plan, const at::Tensor& layer_cache) {
#ifdef KVEXPORT_WITH_CUDA
          if (q.is_cuda()) {
            return paged_attention_cuda(q, k, v, layer_cache, plan.page_table, plan.row_keys, plan.row_candidate,
                                        plan.row_order, plan.tiles, plan.max_row_keys, plan.max_tile_rows,
                                        /*split_tiles=*/0, alpha, inv_scaling_seqlen);
          }
#endif
          return paged_attention_cpu(q, k, v, layer_cache, plan.page_table, plan.row_user, plan.row_keys,
                                     plan.row_candidate, alpha, inv_scaling_seqlen);
        });
  });
}

at::Tensor paged_attention_step(const std::string& name, int64_t layer, const at::Tensor& q, const at::Tensor& k,
                                const at::Tensor& v, const at::Tensor& page_table, const at::Tensor& row_user,
                                const at::Tensor& row_keys, const at::Tensor& row_candidate,
                                const at::Tensor& write_slots, const at::Tensor& value_slots,
                                const at::Tensor& row_order, const at::Tensor& tiles, int64_t max_keys, double alpha,
                                double inv_scaling_seqlen) {
  return request_op(name, [&] {
    return runtime::find_runtime(name)->with_step_layer(
        layer, k, v, write_slots, value_slots, [&](const at::Tensor& layer_cache) {
          const auto candidate = row_candidate.ne(0);
#ifdef KVEXPORT_WITH_CUDA
          if (q.is_cuda()) {
            // The bucket's tiles run past the batch's; a user of up to kAttentionTileRows rows (the
            // common case) is one tile, so the split over keys is sized for one tile per user slot.
            return paged_attention_cuda(q, k, v, layer_cache, page_table, row_keys, candidate, row_order, tiles,
                                        max_keys, runtime::kAttentionTileRows, page_table.size(0), alpha,
                                        inv_scaling_seqlen);
          }
#endif
          return paged_attention_cpu(q, k, v, layer_cache, page_table, row_user, row_keys, candidate, alpha,
                                     inv_scaling_seqlen);
        });
  });
}

// `after` is never read: it is the request's logits, so that end_batch depends on every layer's
// output by data and no compiler can schedule it earlier. (Inductor on torch 2.13 can move an
// end_batch ordered only by its ORDERED effect before begin_batch.)
void end_batch(const std::string& name, const at::Tensor& user_ids, const at::Tensor& after) {
  request_op(name, [&] {
    require_defined({&user_ids, &after});
    check_kind("user_ids", user_ids, 1);
    runtime::find_runtime(name)->end_batch(values_of(user_ids.contiguous()), end_request_threads());
    return 0;
  });
}

std::tuple<std::string, std::string> last_error(const std::string& name) {
  const auto error = runtime::last_error(name);
  return {runtime::error_code_name(error.code), error.message};
}

std::vector<std::string> stat_names() {
  return runtime::stat_names();
}

// A no-op when nothing is held, including when no runtime of that name exists yet.
void abort_batch(const std::string& name) {
  release_batch(name);
}

void create_runtime(const std::string& name, const std::string& config, at::Device device) {
  management_op([&] {
    runtime::get_or_create_runtime(name, config, device);
    return 0;
  });
}

at::Tensor runtime_stats(const std::string& name) {
  return at::tensor(management_op([&] { return runtime::find_runtime(name)->stats(); }), at::kLong);
}

void reset_runtime(const std::string& name) {
  management_op([&] {
    runtime::find_runtime(name)->reset();
    return 0;
  });
}

bool evict_user(const std::string& name, int64_t user_id) {
  return management_op([&] { return runtime::find_runtime(name)->evict_user(user_id); });
}

int64_t cached_length(const std::string& name, int64_t user_id) {
  return management_op([&] { return runtime::find_runtime(name)->cached_length(user_id); });
}

at::Tensor device_users_lru(const std::string& name) {
  return at::tensor(management_op([&] { return runtime::find_runtime(name)->device_users_lru(); }), at::kLong);
}

at::Tensor read_user_kv(const std::string& name, int64_t user_id) {
  return management_op([&] { return runtime::find_runtime(name)->read_user_kv(user_id); });
}

bool drop_runtime(const std::string& name) {
  return runtime::drop_runtime(name);
}

bool attach_remote(const std::string& name, const std::string& url, const std::string& write_policy) {
  return management_op([&] {
#ifdef KVEXPORT_WITH_REMOTE
    auto rt = runtime::find_runtime(name);
    // Connects before taking the runtime: requests in flight are not held up by the connect.
    auto tier = std::make_unique<runtime::RemoteTier>(name, rt->config(),
                                                      runtime::RemoteSettings::parse(url, write_policy, rt->config()));
    if (!tier->reachable()) return false;
    rt->append_tier(std::move(tier));
    return true;
#else
    throw std::invalid_argument(
        "this op library was built without the remote tier (hiredis was not found when it was built); "
        "install libhiredis-dev (Debian/Ubuntu), rebuild it with python -m kvexport.native and rebuild the package");
    return false;
#endif
  });
}

std::string redact_url_op(const std::string& url) {
  return runtime::redact_url(url);
}

bool flush_remote(const std::string& name, int64_t timeout_ms) {
  return management_op([&] {
    if (timeout_ms < 0) throw std::invalid_argument("flush timeout must be >= 0 ms, got " + std::to_string(timeout_ms));
    return runtime::find_runtime(name)->flush_remote(std::chrono::milliseconds(timeout_ms));
  });
}

// The CUDA device's compute capability ("major.minor") and name; empty strings for a CPU device,
// a host without that CUDA device, or an op library built without CUDA. Hosts without Python
// (the replay harness) check a CUDA package's recorded build GPU against it.
std::tuple<std::string, std::string> gpu_info([[maybe_unused]] const c10::Device& device) {
#ifdef KVEXPORT_WITH_CUDA
  if (device.is_cuda()) return cuda_device_info(device.index());
#endif
  return {};
}

}  // namespace

TORCH_LIBRARY(kvexport, m) {
  // The first op of every request: checks it (on the host, where every request's tensors are)
  // against the package's limits and returns the host tensors the rest of the graph reads (so
  // nothing indexes with an unchecked id): user_ids, token_lengths, the prefix tokens laid out
  // (context ids, then each event's tokens, users one after another), num_candidates,
  // candidate_ids.
  m.def(
      "check_request(str runtime, str limits, Tensor user_ids, Tensor history_lengths, Tensor item_ids, "
      "Tensor action_ids, Tensor context_ids, Tensor num_candidates, Tensor candidate_ids) -> "
      "(Tensor, Tensor, Tensor, Tensor, Tensor)");
  // Contiguous copies of int64 host tensors on placement's device; on a GPU staged in one pinned
  // buffer and copied asynchronously (a failure is one of request `runtime`'s).
  m.def("upload(str runtime, Tensor[] host, Tensor placement) -> Tensor[]");
  // Stateful ops (ORDERED effects, declared in kvexport/ops/library.py). Each also depends on
  // the previous one by data: begin_batch returns [2, N_new] on the host, the uncached tokens'
  // index into token_ids and their positions, which select the rows every layer computes; each
  // layer's paged_attention (which stores the layer's new k/v, then attends) feeds the next
  // layer, and end_batch takes the logits. (One output: torch 2.13's Inductor cannot lower an
  // effectful op whose second output has a data-dependent size.) begin_batch's request tensors
  // and end_batch's user_ids are on the host, so neither waits for the device; `placement` is any
  // tensor on the package's device (a weight): the runtime lives there.
  m.def(
      "begin_batch(str runtime, str config, Tensor user_ids, Tensor token_ids, Tensor token_lengths, "
      "Tensor num_candidates, Tensor placement) -> Tensor");
  m.def(
      "paged_attention(str runtime, int layer, Tensor q, Tensor k, Tensor v, float alpha, "
      "float inv_scaling_seqlen) -> Tensor");
  m.def("end_batch(str runtime, Tensor user_ids, Tensor after) -> ()");
  // A step program's request (docs/design.md 3.9): the host calls check_request, then begin_step,
  // which plans like begin_batch and returns, on the host, the step program's inputs and plan in
  // one buffer (padded to buckets) and its layout [candidate rows, prefix rows, users,
  // pages per user, tiles, real candidates, alignment of the parts (runtime::StepLayout)]; the
  // step program runs paged_attention_step per layer
  // with that plan as tensors (fixed addresses, so a CUDA graph can replay it); end_batch commits.
  m.def(
      "begin_step(str runtime, str config, Tensor user_ids, Tensor token_ids, Tensor token_lengths, "
      "Tensor num_candidates, Tensor candidate_ids, Tensor placement, int max_prefix_length) -> "
      "(Tensor, Tensor)");
  m.def(
      "paged_attention_step(str runtime, int layer, Tensor q, Tensor k, Tensor v, Tensor page_table, "
      "Tensor row_user, Tensor row_keys, Tensor row_candidate, Tensor write_slots, Tensor value_slots, "
      "Tensor row_order, Tensor tiles, int max_keys, float alpha, float inv_scaling_seqlen) -> Tensor");
  // Management (eager only, never in an exported graph).
  m.def("create_runtime(str runtime, str config, Device device) -> ()");
  m.def("abort_batch(str runtime) -> ()");
  // Why the calling thread's last request on `runtime` failed: (code, message), code "ok" if it did not.
  m.def("last_error(str runtime) -> (str, str)");
  m.def("stat_names() -> str[]");
  m.def("runtime_stats(str runtime) -> Tensor");
  m.def("reset_runtime(str runtime) -> ()");
  m.def("evict_user(str runtime, int user_id) -> bool");
  m.def("cached_length(str runtime, int user_id) -> int");
  m.def("device_users_lru(str runtime) -> Tensor");
  m.def("read_user_kv(str runtime, int user_id) -> Tensor");
  m.def("drop_runtime(str runtime) -> bool");
  m.def("gpu_info(Device device) -> (str, str)");
  // Adds the remote tier (redis://[[user]:password@]host[:port][/db]) behind the host tier;
  // write_policy is on_evict or after_batch; read budget and expiry come from the runtime's config.
  // False when the server does not answer: the runtime then runs without it; ValueError when it
  // refuses the connection (a wrong or missing password).
  m.def("attach_remote(str runtime, str url, str write_policy) -> bool");
  // Waits up to timeout_ms for the remote tier's queued writes; False if some are still queued.
  m.def("flush_remote(str runtime, int timeout_ms) -> bool");
  // A remote tier's URL for a message or a log, its credentials as *** (the one statement of the rule).
  m.def("redact_url(str url) -> str");
  // Pure kernel behind paged_attention, with every input explicit.
  m.def(
      "hstu_paged_attention(Tensor q, Tensor k, Tensor v, Tensor cache, Tensor page_table, Tensor row_user, "
      "Tensor row_keys, Tensor row_candidate, float alpha, float inv_scaling_seqlen) -> Tensor");
  // Rows [N, H, dh] rounded as FP8 pages store them (runtime/fp8_pages.h): the full recompute of a
  // model with kv_cache.dtype float8_e4m3 attends over these, the cached path over its pages.
  m.def("fp8_round(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvexport, CPU, m) {
  m.impl("check_request", &check_request_op);
  m.impl("upload", &upload_op);
  m.impl("begin_batch", &begin_batch);
  m.impl("paged_attention", &paged_attention);
  m.impl("end_batch", &end_batch);
  m.impl("begin_step", &begin_step);
  m.impl("paged_attention_step", &paged_attention_step);
  m.impl("hstu_paged_attention", &paged_attention_cpu);
  m.impl("fp8_round", &runtime::fp8::round_rows);
}

#ifdef KVEXPORT_WITH_CUDA
// The request ops are device-generic (the runtime lives on the device of begin_batch's
// placement); only the attention kernel differs. A GPU package's begin_batch, upload and end_batch
// dispatch here through their device tensor; check_request only when a caller
// passes a request on the GPU, to refuse it. hstu_paged_attention's CUDA kernel registers itself
// (paged_attention_cuda.cu).
TORCH_LIBRARY_IMPL(kvexport, CUDA, m) {
  m.impl("check_request", &check_request_op);
  m.impl("upload", &upload_op);
  m.impl("begin_batch", &begin_batch);
  m.impl("paged_attention", &paged_attention);
  m.impl("end_batch", &end_batch);
  m.impl("begin_step", &begin_step);
  m.impl("paged_attention_step", &paged_attention_step);
}
#endif

// Management ops take no tensors; CompositeExplicitAutograd makes them callable anywhere and
// leaves room for their fakes.
TORCH_LIBRARY_IMPL(kvexport, CompositeExplicitAutograd, m) {
  m.impl("create_runtime", &create_runtime);
  m.impl("abort_batch", &abort_batch);
  m.impl("last_error", &last_error);
  m.impl("stat_names", &stat_names);
  m.impl("runtime_stats", &runtime_stats);
  m.impl("reset_runtime", &reset_runtime);
  m.impl("evict_user", &evict_user);
  m.impl("cached_length", &cached_length);
  m.impl("device_users_lru", &device_users_lru);
  m.impl("read_user_kv", &read_user_kv);
  m.impl("drop_runtime", &drop_runtime);
  m.impl("gpu_info", &gpu_info);
  m.impl("attach_remote", &attach_remote);
  m.impl("flush_remote", &flush_remote);
  m.impl("redact_url", &redact_url_op);
}

}  // namespace kvexport::ops
