// Runtime configuration: parsed from the JSON string that the exporter bakes into the graph.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <string>
#include <vector>

namespace kvexport::runtime {

struct RuntimeConfig {
  int64_t num_layers = 0;
  int64_t num_heads = 0;
  int64_t head_dim = 0;
  int64_t page_size = 0;
  int64_t device_pages = 0;
  int64_t host_pages = 0;
  std::string dtype;
  // kv_cache.dtype: how the cache stores keys and values. Empty: in dtype, a page
  // [2, page_size, heads, head_dim]; "float8_e4m3": FP8 pages of bytes (runtime/fp8_pages.h).
  std::string kv_dtype;
  // How long a batch in flight may make no progress before a waiting request takes the runtime.
  int64_t stall_timeout_ms = 10000;
  // The remote tier, when a host attaches one: a batch waits at most remote_read_budget_us for its
  // remote reads, and an entry expires remote_ttl_s after it was written (0: never).
  int64_t remote_read_budget_us = 5000;
  int64_t remote_ttl_s = 86400;
  // model.context_attention: whole_prefix: a user's first context_rows_see_prefix rows (its
  // contextual tokens) read every token of its prefix, so their states, and through them every
  // later layer's k/v, depend on the whole prefix: a cached prefix is reused only when the request's
  // prefix equals it. 0: causal, the default.
  int64_t context_rows_see_prefix = 0;

  // Throws std::invalid_argument naming the bad or missing field.
  static RuntimeConfig from_json(const std::string& json);

  // The cache's element type; from_json accepted the name.
  c10::ScalarType scalar_type() const;
  bool fp8_pages() const { return kv_dtype == "float8_e4m3"; }
  // The cache's element type and the shape of one of its pages.
  c10::ScalarType cache_scalar_type() const;
  std::vector<int64_t> page_shape() const;
  // The stored format's name: kv_dtype when set, else dtype.
  const std::string& cache_dtype() const { return kv_dtype.empty() ? dtype : kv_dtype; }
  int64_t pages_for(int64_t num_tokens) const { return (num_tokens + page_size - 1) / page_size; }
  bool operator==(const RuntimeConfig&) const = default;
};

}  // namespace kvexport::runtime
