#include "runtime/remote_entry.h"

#include <ATen/ATen.h>

#include <cstring>

namespace kvexport::runtime {

namespace {

constexpr char kMagic[4] = {'K', 'V', 'X', 'R'};

class Writer {
 public:
  template <typename T>
  void scalar(T value) {
    bytes_.append(reinterpret_cast<const char*>(&value), sizeof(T));
  }
  void text(const std::string& value) {
    scalar<uint32_t>(static_cast<uint32_t>(value.size()));
    bytes_.append(value);
  }
  void raw(const void* data, size_t size) { bytes_.append(static_cast<const char*>(data), size); }
  std::string& bytes() { return bytes_; }

 private:
  std::string bytes_;
};

// Reads fields front to back; any read past the end marks the entry bad instead of throwing.
class Reader {
 public:
  Reader(const char* data, size_t size) : data_(data), size_(size) {}
  template <typename T>
  T scalar() {
    T value{};
    if (take(sizeof(T))) std::memcpy(&value, data_ + offset_ - sizeof(T), sizeof(T));
    return value;
  }
  std::string text() {
    const auto size = scalar<uint32_t>();
    const char* start = data_ + offset_;
    return take(size) ? std::string(start, size) : std::string();
  }
  const char* span(uint64_t size) {
    const char* start = data_ + offset_;
    return take(size) ? start : nullptr;
  }
  bool ok() const { return ok_; }
  size_t offset() const { return offset_; }

 private:
  bool take(uint64_t size) {
    if (!ok_ || size > size_ - offset_) {
      ok_ = false;
      return false;
    }
    offset_ += size;
    return true;
  }
  const char* data_;
  size_t size_;
  size_t offset_ = 0;
  bool ok_ = true;
};

std::vector<int64_t> expected_shape(const RuntimeConfig& c, int64_t num_tokens) {
  std::vector<int64_t> shape{c.num_layers, c.pages_for(num_tokens)};
  for (int64_t size : c.page_shape()) shape.push_back(size);
  return shape;
}

}  // namespace

uint64_t entry_checksum(const char* data, size_t size) {
  // 64-bit multiply-xorshift over 8-byte words: detects corruption, not tampering.
  uint64_t hash = 0x9E3779B97F4A7C15ULL ^ size;
  size_t i = 0;
  for (; i + 8 <= size; i += 8) {
    uint64_t word;
    std::memcpy(&word, data + i, 8);
    hash = (hash ^ word) * 0xFF51AFD7ED558CCDULL;
    hash ^= hash >> 32;
  }
  for (; i < size; ++i) {
    hash = (hash ^ static_cast<unsigned char>(data[i])) * 0xC4CEB9FE1A85EC53ULL;
    hash ^= hash >> 29;
  }
  return hash;
}

std::string encode_entry(const std::string& runtime, const RuntimeConfig& config, const std::vector<int64_t>& token_ids,
                         const at::Tensor& pages) {
  const auto contiguous = pages.contiguous();
  Writer out;
  out.raw(kMagic, sizeof(kMagic));
  out.scalar<uint32_t>(kRemoteFormatVersion);
  out.text(runtime);
  out.text(config.cache_dtype());
  out.scalar<int64_t>(config.page_size);
  out.scalar<uint64_t>(token_ids.size());
  out.raw(token_ids.data(), token_ids.size() * sizeof(int64_t));
  out.scalar<uint32_t>(static_cast<uint32_t>(contiguous.dim()));
  for (auto size : contiguous.sizes()) out.scalar<int64_t>(size);
  const auto num_bytes = static_cast<uint64_t>(contiguous.nbytes());
  out.scalar<uint64_t>(num_bytes);
  out.raw(contiguous.data_ptr(), num_bytes);
  out.scalar<uint64_t>(entry_checksum(out.bytes().data(), out.bytes().size()));
  return std::move(out.bytes());
}

DecodedEntry decode_entry(const std::string& bytes, const std::string& runtime, const RuntimeConfig& config) {
  DecodedEntry entry;
  entry.fault = EntryFault::kFormat;
  Reader in(bytes.data(), bytes.size());
  const char* magic = in.span(sizeof(kMagic));
  if (!magic || std::memcmp(magic, kMagic, sizeof(kMagic)) != 0) return entry;
  if (in.scalar<uint32_t>() != kRemoteFormatVersion) return entry;
  const auto name = in.text();
  const auto dtype = in.text();
  const auto page_size = in.scalar<int64_t>();
  const auto num_tokens = in.scalar<uint64_t>();
  const char* tokens = num_tokens <= bytes.size() / sizeof(int64_t) ? in.span(num_tokens * sizeof(int64_t)) : nullptr;
  const auto ndim = in.scalar<uint32_t>();
  std::vector<int64_t> shape;
  for (uint32_t d = 0; d < ndim && d < 8 && in.ok(); ++d) shape.push_back(in.scalar<int64_t>());
  const auto num_bytes = in.scalar<uint64_t>();
  const char* kv = in.span(num_bytes);
  const size_t checked = in.offset();
  const auto checksum = in.scalar<uint64_t>();
  if (!tokens || !kv || !in.ok() || in.offset() != bytes.size()) return entry;
  if (checksum != entry_checksum(bytes.data(), checked)) {
    entry.fault = EntryFault::kChecksum;
    return entry;
  }
  if (name != runtime) {
    entry.fault = EntryFault::kRuntime;
    return entry;
  }
  const auto n = static_cast<int64_t>(num_tokens);
  if (dtype != config.cache_dtype() || page_size != config.page_size || n == 0 || shape != expected_shape(config, n)) {
    return entry;
  }
  auto pages = at::empty(shape, at::TensorOptions().dtype(config.cache_scalar_type()));
  if (num_bytes != static_cast<uint64_t>(pages.nbytes())) return entry;
  std::memcpy(pages.data_ptr(), kv, num_bytes);
  entry.token_ids.resize(num_tokens);
  std::memcpy(entry.token_ids.data(), tokens, num_tokens * sizeof(int64_t));
  entry.pages = std::move(pages);
  entry.fault = EntryFault::kNone;
  return entry;
}

}  // namespace kvexport::runtime
