// FP8 pages (docs/design.md §2.7): a page of the cache as bytes, its keys' and values' rows in
// float8 e4m3 (fn) with one power-of-two scale per row and head in a trailer after them.
//
// Page layout (page_bytes bytes; "rows" are the page's 2 * page_size k then v rows):
//   [2, page_size, heads, head_dim] e4m3 bytes | [2, page_size, heads] scale bytes
// A scale byte is an e8m0 exponent: the row's head reads e4m3 * 2^(byte - 127). The exponent is the
// smallest E with max |x| <= 448 * 2^E over the head's head_dim values, so nothing saturates and
// every dequantised value (3 mantissa bits times a power of two) is exact in float32 and bfloat16.
// A row's rounding depends on that row alone: whichever request wrote it, however the user's
// pages were filled, and the full recompute (round_rows) rounds the same row to the same values.
// The scales live inside the page, so every copy of a page (offload, onboard, host and remote
// tiers) carries them with its bytes. Knows nothing of HSTU: rows of heads x head_dim values.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Float8_e4m3fn.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

namespace kvexport::runtime::fp8 {

constexpr float kMaxE4m3 = 448.0f;
constexpr int kScaleBias = 127;

struct PageLayout {
  int64_t page_size = 0, num_heads = 0, head_dim = 0;

  int64_t rows_per_page() const { return 2 * page_size; }  // k rows, then v rows
  int64_t row_bytes() const { return num_heads * head_dim; }
  int64_t data_bytes() const { return rows_per_page() * row_bytes(); }
  int64_t page_bytes() const { return data_bytes() + rows_per_page() * num_heads; }
  // A slot is a row of one layer's cache: page * rows_per_page + (value ? page_size : 0) + position.
  int64_t row_offset(int64_t slot) const {
    return slot / rows_per_page() * page_bytes() + slot % rows_per_page() * row_bytes();
  }
  int64_t scales_offset(int64_t slot) const {
    return slot / rows_per_page() * page_bytes() + data_bytes() + slot % rows_per_page() * num_heads;
  }
  // The layout of a byte cache of pages [pages, page_bytes] attended with heads x head_dim rows.
  static PageLayout of_pages(int64_t page_bytes, int64_t num_heads, int64_t head_dim) {
    return {page_bytes / (2 * num_heads * (head_dim + 1)), num_heads, head_dim};
  }
};

// The e4m3 byte of every value: decoding is a table lookup.
inline const std::array<float, 256>& e4m3_values() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int b = 0; b < 256; ++b)
      t[b] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(b), c10::Float8_e4m3fn::from_bits()));
    return t;
  }();
  return table;
}

// 2^(byte - 127) as a float (bytes 0 and 255 clamp to 2^-126 and 2^127): e8m0 and float32 bias
// their exponents alike, so the byte is the float's exponent field.
inline float scale_of(uint8_t byte) {
  return std::bit_cast<float>(static_cast<uint32_t>(std::clamp<int>(byte, 1, 254)) << 23);
}

// The scale byte of values whose largest magnitude is amax: the smallest E with amax <= 448 * 2^E.
inline uint8_t scale_byte(float amax) {
  if (!(amax > 0.0f) || !std::isfinite(amax)) return kScaleBias;
  int e = 0;
  const float m = std::frexp(amax, &e);  // amax = m * 2^e, m in [0.5, 1); 448 = 0.875 * 2^9
  const int exponent = m <= 0.875f ? e - 9 : e - 8;
  return static_cast<uint8_t>(std::clamp(exponent + kScaleBias, 1, 254));
}

// One row of heads x head_dim floats into e4m3 bytes and one scale byte per head.
inline void quantize_row(const float* x, int64_t num_heads, int64_t head_dim, uint8_t* bytes, uint8_t* scales) {
  for (int64_t h = 0; h < num_heads; ++h) {
    const float* head = x + h * head_dim;
    float amax = 0.0f;
    for (int64_t d = 0; d < head_dim; ++d) amax = std::max(amax, std::fabs(head[d]));
    scales[h] = scale_byte(amax);
    const float inverse = 1.0f / scale_of(scales[h]);  // a power of two: exact
    for (int64_t d = 0; d < head_dim; ++d) bytes[h * head_dim + d] = c10::Float8_e4m3fn(head[d] * inverse).x;
  }
}

inline void dequantize_row(const uint8_t* bytes, const uint8_t* scales, int64_t num_heads, int64_t head_dim,
                           float* out) {
  const auto& values = e4m3_values();
  for (int64_t h = 0; h < num_heads; ++h) {
    const float scale = scale_of(scales[h]);
    for (int64_t d = 0; d < head_dim; ++d) out[h * head_dim + d] = values[bytes[h * head_dim + d]] * scale;
  }
}

// rows [n, heads, head_dim] (any float dtype, on the CPU) quantised into the slots `index` [n] of one
// layer's byte cache [pages, page_bytes]. Throws std::out_of_range for a slot past the cache.
inline void store_rows(at::Tensor& layer_cache, const PageLayout& layout, const at::Tensor& index,
                       const at::Tensor& rows) {
  const auto values = rows.to(at::kFloat).contiguous();
  const auto slots = index.to(at::kLong).contiguous();
  const int64_t num_slots = layer_cache.size(0) * layout.rows_per_page(), row = layout.row_bytes();
  auto* base = layer_cache.data_ptr<uint8_t>();
  const float* from = values.const_data_ptr<float>();
  const int64_t* at = slots.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < slots.numel(); ++i) {
    if (at[i] < 0 || at[i] >= num_slots) {
      throw std::out_of_range("cache slot " + std::to_string(at[i]) + " outside 0.." + std::to_string(num_slots - 1));
    }
    quantize_row(from + i * row, layout.num_heads, layout.head_dim, base + layout.row_offset(at[i]),
                 base + layout.scales_offset(at[i]));
  }
}

// x [n, heads, head_dim] rounded as the cache stores it: quantised and dequantised, in x's dtype.
inline at::Tensor round_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 3 && x.is_cpu(), "fp8 round_rows: x must be [n, heads, head_dim] on the CPU, got ", x.sizes(),
              " on ", x.device());
  const int64_t n = x.size(0), heads = x.size(1), dim = x.size(2);
  const auto values = x.to(at::kFloat).contiguous();
  auto out = at::empty_like(values);
  std::vector<uint8_t> bytes(heads * dim), scales(heads);
  for (int64_t i = 0; i < n; ++i) {
    quantize_row(values.const_data_ptr<float>() + i * heads * dim, heads, dim, bytes.data(), scales.data());
    dequantize_row(bytes.data(), scales.data(), heads, dim, out.data_ptr<float>() + i * heads * dim);
  }
  return out.to(x.scalar_type());
}

// Byte pages [..., pages, page_bytes] as float k/v [..., pages, 2, page_size, heads, head_dim].
inline at::Tensor dequantize_pages(const at::Tensor& pages, const PageLayout& layout) {
  const auto bytes = pages.to(at::kCPU).contiguous();
  const int64_t num_pages = bytes.numel() / layout.page_bytes(), row = layout.row_bytes();
  auto out = at::empty({num_pages * layout.rows_per_page(), row}, at::kFloat);
  const auto* base = bytes.const_data_ptr<uint8_t>();
  for (int64_t slot = 0; slot < num_pages * layout.rows_per_page(); ++slot) {
    dequantize_row(base + layout.row_offset(slot), base + layout.scales_offset(slot), layout.num_heads, layout.head_dim,
                   out.data_ptr<float>() + slot * row);
  }
  std::vector<int64_t> shape(pages.sizes().begin(), pages.sizes().end() - 1);
  for (int64_t size : {int64_t{2}, layout.page_size, layout.num_heads, layout.head_dim}) shape.push_back(size);
  return out.view(shape);
}

}  // namespace kvexport::runtime::fp8
