// A remote-tier entry: what encode_entry writes decodes to the same user, and every damaged,
// foreign or mismatched entry decodes to a fault (a miss), never to pages.
#include "runtime/remote_entry.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

namespace kvexport::runtime {
namespace {

RuntimeConfig tiny_config() {
  RuntimeConfig config;
  config.num_layers = 2;
  config.num_heads = 1;
  config.head_dim = 2;
  config.page_size = 2;
  config.device_pages = 8;
  config.dtype = "float32";
  return config;
}

const std::vector<int64_t> kTokens{11, 12, 13};

// The pages of kTokens: [layers, pages, 2, page_size, heads, head_dim], distinct values.
at::Tensor pages_of(const RuntimeConfig& c) {
  return at::arange(c.num_layers * c.pages_for(3) * 2 * c.page_size * c.num_heads * c.head_dim, at::kFloat)
      .view({c.num_layers, c.pages_for(3), 2, c.page_size, c.num_heads, c.head_dim});
}

TEST(RemoteEntry, DecodesToTheTokensAndPagesEncoded) {
  const auto config = tiny_config();
  const auto bytes = encode_entry("runtime-a", config, kTokens, pages_of(config));
  const auto entry = decode_entry(bytes, "runtime-a", config);
  ASSERT_EQ(entry.fault, EntryFault::kNone);
  EXPECT_EQ(entry.token_ids, kTokens);
  EXPECT_EQ(entry.pages.sizes().vec(), (std::vector<int64_t>{2, 2, 2, 2, 1, 2}));
  EXPECT_TRUE(at::equal(entry.pages, pages_of(config)));
  // Its version follows the magic; its checksum covers everything before the last 8 bytes.
  uint32_t version = 0;
  std::memcpy(&version, bytes.data() + 4, sizeof(version));
  EXPECT_EQ(bytes.substr(0, 4), "KVXR");
  EXPECT_EQ(version, kRemoteFormatVersion);
  uint64_t checksum = 0;
  std::memcpy(&checksum, bytes.data() + bytes.size() - 8, sizeof(checksum));
  EXPECT_EQ(checksum, entry_checksum(bytes.data(), bytes.size() - 8));
}

TEST(RemoteEntry, AChangedByteIsAChecksumFault) {
  const auto config = tiny_config();
  auto bytes = encode_entry("runtime-a", config, kTokens, pages_of(config));
  bytes[bytes.size() - 9] ^= 1;  // the last byte of the pages
  const auto entry = decode_entry(bytes, "runtime-a", config);
  EXPECT_EQ(entry.fault, EntryFault::kChecksum);
  EXPECT_TRUE(entry.token_ids.empty());
  EXPECT_FALSE(entry.pages.defined());
}

TEST(RemoteEntry, AnotherRuntimesEntryIsARuntimeFault) {
  const auto config = tiny_config();
  const auto bytes = encode_entry("runtime-a", config, kTokens, pages_of(config));
  EXPECT_EQ(decode_entry(bytes, "runtime-b", config).fault, EntryFault::kRuntime);
}

TEST(RemoteEntry, ATruncatedOrForeignEntryIsAFormatFault) {
  const auto config = tiny_config();
  const auto bytes = encode_entry("runtime-a", config, kTokens, pages_of(config));
  EXPECT_EQ(decode_entry("", "runtime-a", config).fault, EntryFault::kFormat);
  EXPECT_EQ(decode_entry(bytes.substr(0, bytes.size() - 1), "runtime-a", config).fault, EntryFault::kFormat);
  EXPECT_EQ(decode_entry(bytes + "x", "runtime-a", config).fault, EntryFault::kFormat);
  auto other_magic = bytes;
  other_magic[0] = 'X';
  EXPECT_EQ(decode_entry(other_magic, "runtime-a", config).fault, EntryFault::kFormat);
  auto other_version = bytes;
  const uint32_t next = kRemoteFormatVersion + 1;
  std::memcpy(other_version.data() + 4, &next, sizeof(next));
  EXPECT_EQ(decode_entry(other_version, "runtime-a", config).fault, EntryFault::kFormat);
}

TEST(RemoteEntry, AnEntryOfAnotherPageLayoutIsAFormatFault) {
  const auto config = tiny_config();
  const auto bytes = encode_entry("runtime-a", config, kTokens, pages_of(config));
  auto wider_pages = config;
  wider_pages.page_size = 4;
  EXPECT_EQ(decode_entry(bytes, "runtime-a", wider_pages).fault, EntryFault::kFormat);
  auto more_layers = config;
  more_layers.num_layers = 3;
  EXPECT_EQ(decode_entry(bytes, "runtime-a", more_layers).fault, EntryFault::kFormat);
  auto other_dtype = config;
  other_dtype.dtype = "bfloat16";
  EXPECT_EQ(decode_entry(bytes, "runtime-a", other_dtype).fault, EntryFault::kFormat);
}

TEST(RemoteEntry, TheChecksumSeesEveryByte) {
  const std::string data = "kvexport remote entry bytes";  // 27 bytes: three words and a tail
  const auto sum = entry_checksum(data.data(), data.size());
  EXPECT_EQ(sum, entry_checksum(data.data(), data.size()));
  for (size_t i = 0; i < data.size(); ++i) {
    auto changed = data;
    changed[i] ^= 0x10;
    EXPECT_NE(entry_checksum(changed.data(), changed.size()), sum) << "byte " << i;
  }
  EXPECT_NE(entry_checksum(data.data(), data.size() - 1), sum);
}

}  // namespace
}  // namespace kvexport::runtime
