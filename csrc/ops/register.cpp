// Every kvexport:: op: schemas in one TORCH_LIBRARY block, thin kernels that call the runtime.
// Fakes: kvexport/ops/fakes.py. Typed wrappers: kvexport/ops/wrappers.py.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "ops/paged_attention.h"
#include "runtime/kv_runtime.h"

namespace kvexport::ops {

namespace {

using runtime::KVRuntime;

std::vector<int64_t> to_vector(const at::Tensor& t, const char* what) {
  TORCH_CHECK_VALUE(t.dim() == 1, what, " must be 1-D, got ", t.sizes());
  TORCH_CHECK_VALUE(t.scalar_type() == at::kLong, what, " must be int64, got ", t.scalar_type());
  const auto cpu = t.to(at::kCPU).contiguous();
  return {cpu.data_ptr<int64_t>(), cpu.data_ptr<int64_t>() + cpu.numel()};
}

// Runtime errors caused by the request (capacity, malformed batch) reach Python as ValueError.
template <typename F>
auto user_errors_as_value_error(F&& f) {
  try {
    return f();
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
}

at::Tensor begin_batch(const std::string& name, const std::string& config,
                                               const at::Tensor& user_ids, const at::Tensor& token_ids,
                                               const at::Tensor& token_lengths, const at::Tensor& num_candidates) {
  return user_errors_as_value_error([&] {
    auto rt = runtime::get_or_create_runtime(name, config, user_ids.device());
    const auto& plan = rt->begin_batch(to_vector(user_ids, "user_ids"), to_vector(token_ids, "token_ids"),
                                       to_vector(token_lengths, "token_lengths"),
                                       to_vector(num_candidates, "num_candidates"));
    return plan.cached_lengths_tensor.clone();
  });
}

void append_kv(const std::string& name, int64_t layer, const at::Tensor& k, const at::Tensor& v) {
  user_errors_as_value_error([&] {
    runtime::find_runtime(name)->write_kv(layer, k, v);
    return 0;
  });
}

at::Tensor paged_attention(const std::string& name, int64_t layer, const at::Tensor& q, const at::Tensor& k,
                           const at::Tensor& v, double alpha, double inv_scaling_seqlen) {
  auto rt = runtime::find_runtime(name);
  TORCH_CHECK(layer >= 0 && layer < rt->config().num_layers, "paged_attention: layer ", layer, " outside 0..",
              rt->config().num_layers - 1);
  const auto& plan = rt->batch();
  return paged_attention_cpu(q, k, v, rt->cache().select(0, layer), plan.page_table, plan.row_user, plan.row_keys,
                             plan.row_candidate, alpha, inv_scaling_seqlen);
}

void end_batch(const std::string& name, const at::Tensor& user_ids) {
  runtime::find_runtime(name)->end_batch(to_vector(user_ids, "user_ids"));
}

void abort_batch(const std::string& name) {
  user_errors_as_value_error([&] {
    runtime::find_runtime(name)->abort_batch();
    return 0;
  });
}

void create_runtime(const std::string& name, const std::string& config, at::Device device) {
  user_errors_as_value_error([&] {
    runtime::get_or_create_runtime(name, config, device);
    return 0;
  });
}

at::Tensor runtime_stats(const std::string& name) {
  return at::tensor(user_errors_as_value_error([&] { return runtime::find_runtime(name)->stats(); }), at::kLong);
}

void reset_runtime(const std::string& name) {
  user_errors_as_value_error([&] {
    runtime::find_runtime(name)->reset();
    return 0;
  });
}

bool evict_user(const std::string& name, int64_t user_id) {
  return user_errors_as_value_error([&] { return runtime::find_runtime(name)->evict_user(user_id); });
}

int64_t cached_length(const std::string& name, int64_t user_id) {
  return user_errors_as_value_error([&] { return runtime::find_runtime(name)->cached_length(user_id); });
}

at::Tensor device_users_lru(const std::string& name) {
  return at::tensor(user_errors_as_value_error([&] { return runtime::find_runtime(name)->device_users_lru(); }),
                    at::kLong);
}

at::Tensor read_user_kv(const std::string& name, int64_t user_id) {
  return user_errors_as_value_error([&] { return runtime::find_runtime(name)->read_user_kv(user_id); });
}

bool drop_runtime(const std::string& name) { return runtime::drop_runtime(name); }

}  // namespace

TORCH_LIBRARY(kvexport, m) {
  // Stateful ops (ORDERED effects, declared in kvexport/ops/library.py).
  m.def("begin_batch(str runtime, str config, Tensor user_ids, Tensor token_ids, Tensor token_lengths, "
        "Tensor num_candidates) -> Tensor");
  m.def("append_kv(str runtime, int layer, Tensor k, Tensor v) -> ()");
  m.def("paged_attention(str runtime, int layer, Tensor q, Tensor k, Tensor v, float alpha, "
        "float inv_scaling_seqlen) -> Tensor");
  m.def("end_batch(str runtime, Tensor user_ids) -> ()");
  // Management (eager only, never in an exported graph).
  m.def("create_runtime(str runtime, str config, Device device) -> ()");
  m.def("abort_batch(str runtime) -> ()");
  m.def("runtime_stats(str runtime) -> Tensor");
  m.def("reset_runtime(str runtime) -> ()");
  m.def("evict_user(str runtime, int user_id) -> bool");
  m.def("cached_length(str runtime, int user_id) -> int");
  m.def("device_users_lru(str runtime) -> Tensor");
  m.def("read_user_kv(str runtime, int user_id) -> Tensor");
  m.def("drop_runtime(str runtime) -> bool");
  // Pure kernel behind paged_attention, with every input explicit.
  m.def("hstu_paged_attention(Tensor q, Tensor k, Tensor v, Tensor cache, Tensor page_table, Tensor row_user, "
        "Tensor row_keys, Tensor row_candidate, float alpha, float inv_scaling_seqlen) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvexport, CPU, m) {
  m.impl("begin_batch", &begin_batch);
  m.impl("append_kv", &append_kv);
  m.impl("paged_attention", &paged_attention);
  m.impl("end_batch", &end_batch);
  m.impl("hstu_paged_attention", &paged_attention_cpu);
}

// Management ops take no tensors; CompositeExplicitAutograd makes them callable anywhere and
// leaves room for their fakes.
TORCH_LIBRARY_IMPL(kvexport, CompositeExplicitAutograd, m) {
  m.impl("create_runtime", &create_runtime);
  m.impl("abort_batch", &abort_batch);
  m.impl("runtime_stats", &runtime_stats);
  m.impl("reset_runtime", &reset_runtime);
  m.impl("evict_user", &evict_user);
  m.impl("cached_length", &cached_length);
  m.impl("device_users_lru", &device_users_lru);
  m.impl("read_user_kv", &read_user_kv);
  m.impl("drop_runtime", &drop_runtime);
}

}  // namespace kvexport::ops
