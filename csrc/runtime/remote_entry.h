// The bytes of one remote-tier entry: one user's cached k/v as one runtime computed it.
//
// Layout (host byte order; the hosts sharing a server share an architecture):
//   "KVXR" | u32 format version | u32 + runtime name | u32 + stored dtype | i64 page_size
//   | u64 + i64 token ids | u32 + i64 shape [layers, pages, *page shape] | u64 + page bytes
//   | u64 checksum of everything before it
// The page shape is [2, page_size, heads, head_dim] in the model's dtype, or [page_bytes] for FP8
// pages (stored dtype float8_e4m3): their e4m3 bytes and scales (runtime/fp8_pages.h), so the
// checksum covers both. Version 2 added FP8 pages; a version 1 entry is a format fault (a miss).
#pragma once

#include <ATen/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "runtime/config.h"

namespace kvexport::runtime {

constexpr uint32_t kRemoteFormatVersion = 2;

enum class EntryFault {
  kNone,
  kFormat,    // malformed, truncated, another format version, or a shape the runtime does not have
  kChecksum,  // the bytes changed after they were written
  kRuntime,   // written by another runtime name
};

struct DecodedEntry {
  EntryFault fault = EntryFault::kNone;
  std::vector<int64_t> token_ids;
  at::Tensor pages;  // [layers, pages, *page shape] on the CPU, when fault is kNone
};

// pages: a contiguous CPU tensor holding the k/v of token_ids.
std::string encode_entry(const std::string& runtime, const RuntimeConfig& config, const std::vector<int64_t>& token_ids,
                         const at::Tensor& pages);
// Never throws on bad bytes: a bad entry is a fault.
DecodedEntry decode_entry(const std::string& bytes, const std::string& runtime, const RuntimeConfig& config);

uint64_t entry_checksum(const char* data, size_t size);

}  // namespace kvexport::runtime
