#include "replay/shared_objects.h"

#include <caffe2/serialize/inline_container.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "replay/artifact.h"

namespace kvexport::replay {

namespace {

constexpr size_t kElfHeader = 64;
constexpr uint32_t kLoadableSegment = 1;  // PT_LOAD

// A little-endian field of `bytes` (the harness runs on little-endian hosts only).
template <typename T>
T field(const std::vector<char>& bytes, size_t offset) {
  T value;
  std::memcpy(&value, bytes.data() + offset, sizeof(T));
  return value;
}

// Reads a member's leading bytes: straight from the package file where the member is stored
// uncompressed (as torch writes packages), else through the archive reader, whole.
class MemberReader {
 public:
  MemberReader(const std::filesystem::path& package, caffe2::serialize::PyTorchStreamReader& archive,
               const std::string& record)
      : file_(package, std::ios::binary), offset_(archive.getRecordOffset(record)) {
    if (!stored_at_offset()) {
      auto [data, size] = archive.getRecord(record);
      const auto* begin = static_cast<const char*>(data.get());
      whole_.assign(begin, begin + size);
      have_whole_ = true;
    }
  }

  // `count` bytes from `offset` into the member; fewer where it ends first.
  std::vector<char> read(size_t offset, size_t count) {
    if (have_whole_) {
      const size_t begin = std::min(offset, whole_.size());
      return {whole_.begin() + static_cast<std::ptrdiff_t>(begin),
              whole_.begin() + static_cast<std::ptrdiff_t>(std::min(whole_.size(), begin + count))};
    }
    std::vector<char> bytes(count);
    file_.clear();
    file_.seekg(static_cast<std::streamoff>(offset_ + offset));
    file_.read(bytes.data(), static_cast<std::streamsize>(count));
    bytes.resize(static_cast<size_t>(file_.gcount()));
    return bytes;
  }

 private:
  // Whether the file holds the member's ELF magic at its data offset: a stored member.
  bool stored_at_offset() {
    char magic[4] = {};
    file_.seekg(static_cast<std::streamoff>(offset_));
    file_.read(magic, sizeof(magic));
    return file_.gcount() == sizeof(magic) && std::memcmp(magic, "\x7f" "ELF", sizeof(magic)) == 0;
  }

  std::ifstream file_;
  size_t offset_;
  std::vector<char> whole_;
  bool have_whole_ = false;
};

void check_elf(MemberReader& member, size_t size, const std::string& name) {
  const auto header = member.read(0, kElfHeader);
  if (header.size() < kElfHeader || std::memcmp(header.data(), "\x7f" "ELF", 4) != 0 || header[4] != 2 ||
      header[5] != 1) {
    throw ReplayError(kUnusable, name + " is not a 64-bit little-endian ELF shared object");
  }
  const auto program_headers = field<uint64_t>(header, 0x20), section_table = field<uint64_t>(header, 0x28);
  const size_t entry_size = field<uint16_t>(header, 0x36), entries = field<uint16_t>(header, 0x38);
  const size_t section_entry_size = field<uint16_t>(header, 0x3A), sections = field<uint16_t>(header, 0x3C);
  if (program_headers < kElfHeader || program_headers + entry_size * entries > size ||
      section_table + section_entry_size * sections > size) {
    throw ReplayError(kUnusable, name + " is truncated or corrupt: its ELF tables lie past its " +
                                     std::to_string(size) + " bytes");
  }
  const auto table = member.read(program_headers, entry_size * entries);
  for (size_t i = 0; i < entries; ++i) {
    const size_t at = i * entry_size;
    if (at + 40 > table.size()) {  // an entry too short for its p_type .. p_filesz
      throw ReplayError(kUnusable, name + " is truncated or corrupt: its program headers are " +
                                       std::to_string(entry_size) + " bytes each");
    }
    const auto end = field<uint64_t>(table, at + 8) + field<uint64_t>(table, at + 32);  // p_offset + p_filesz
    if (field<uint32_t>(table, at) == kLoadableSegment && end > size) {
      throw ReplayError(kUnusable, name + " is truncated or corrupt: a loadable segment ends at byte " +
                                       std::to_string(end) + ", past its " + std::to_string(size) + " bytes");
    }
  }
}

// The archive's top directory ("model/"), which the reader leaves out of record names: the first
// path component of the first local file header's name.
std::string archive_prefix(const std::filesystem::path& package) {
  std::ifstream file(package, std::ios::binary);
  std::vector<char> header(30);
  file.read(header.data(), static_cast<std::streamsize>(header.size()));
  if (file.gcount() != 30 || std::memcmp(header.data(), "PK\x03\x04", 4) != 0) return "";
  std::string name(field<uint16_t>(header, 26), '\0');
  file.read(name.data(), static_cast<std::streamsize>(name.size()));
  const auto slash = name.find('/');
  return slash == std::string::npos ? "" : name.substr(0, slash + 1);
}

}  // namespace

void check_shared_objects(const std::filesystem::path& package) {
  std::unique_ptr<caffe2::serialize::PyTorchStreamReader> archive;
  try {
    archive = std::make_unique<caffe2::serialize::PyTorchStreamReader>(package.string());
  } catch (const c10::Error&) {
    throw ReplayError(kUnusable, package.string() + " is not a readable AOTInductor package");
  }
  const auto prefix = archive_prefix(package);
  for (const auto& record : archive->getAllRecords()) {
    if (!record.ends_with(".so")) continue;
    MemberReader member(package, *archive, record);
    check_elf(member, archive->getRecordSize(record), package.string() + ": " + prefix + record);
  }
}

}  // namespace kvexport::replay
