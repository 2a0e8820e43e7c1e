#include "runtime/config.h"

#include <nlohmann/json.hpp>
#include <stdexcept>

#include "runtime/fp8_pages.h"

namespace kvexport::runtime {

namespace {

int64_t positive_field(const nlohmann::json& j, const char* key, bool allow_zero = false) {
  if (!j.contains(key) || !j.at(key).is_number_integer()) {
    throw std::invalid_argument(std::string("runtime config: missing integer field ") + key);
  }
  const auto value = j.at(key).get<int64_t>();
  if (value < 0 || (value == 0 && !allow_zero)) {
    throw std::invalid_argument(std::string("runtime config: ") + key + " must be positive, got " +
                                std::to_string(value));
  }
  return value;
}

}  // namespace

c10::ScalarType RuntimeConfig::scalar_type() const {
  if (dtype == "float32") return c10::kFloat;
  if (dtype == "bfloat16") return c10::kBFloat16;
  if (dtype == "float16") return c10::kHalf;
  throw std::invalid_argument("runtime config: unsupported dtype " + dtype);
}

c10::ScalarType RuntimeConfig::cache_scalar_type() const {
  return fp8_pages() ? c10::kByte : scalar_type();
}

std::vector<int64_t> RuntimeConfig::page_shape() const {
  if (fp8_pages()) return {fp8::PageLayout{page_size, num_heads, head_dim}.page_bytes()};
  return {2, page_size, num_heads, head_dim};
}

RuntimeConfig RuntimeConfig::from_json(const std::string& json) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(json);
  } catch (const nlohmann::json::parse_error& e) {
    throw std::invalid_argument(std::string("runtime config is not JSON: ") + e.what());
  }
  RuntimeConfig c;
  c.num_layers = positive_field(j, "num_layers");
  c.num_heads = positive_field(j, "num_heads");
  c.head_dim = positive_field(j, "head_dim");
  c.page_size = positive_field(j, "page_size");
  c.device_pages = positive_field(j, "device_pages");
  c.host_pages = positive_field(j, "host_pages", /*allow_zero=*/true);
  if (!j.contains("dtype") || !j.at("dtype").is_string()) {
    throw std::invalid_argument("runtime config: missing string field dtype");
  }
  c.dtype = j.at("dtype").get<std::string>();
  c.scalar_type();  // refuses an unsupported dtype here, before any runtime exists
  if (j.contains("kv_dtype")) {
    c.kv_dtype = j.at("kv_dtype").is_string() ? j.at("kv_dtype").get<std::string>() : "";
    if (!c.fp8_pages()) {
      throw std::invalid_argument("runtime config: kv_dtype must be float8_e4m3 when given, got " +
                                  j.at("kv_dtype").dump());
    }
  }
  if (j.contains("stall_timeout_ms")) c.stall_timeout_ms = positive_field(j, "stall_timeout_ms");
  if (j.contains("remote_read_budget_us")) c.remote_read_budget_us = positive_field(j, "remote_read_budget_us");
  if (j.contains("remote_ttl_s")) c.remote_ttl_s = positive_field(j, "remote_ttl_s", /*allow_zero=*/true);
  if (j.contains("context_rows_see_prefix")) {
    c.context_rows_see_prefix = positive_field(j, "context_rows_see_prefix", /*allow_zero=*/true);
  }
  return c;
}

}  // namespace kvexport::runtime
