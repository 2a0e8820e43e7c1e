#include "replay/shared_objects.h"

#include <c10/util/Exception.h>
#include <caffe2/serialize/inline_container.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "replay/artifact.h"

namespace kvexport::replay {

namespace {

constexpr size_t kElfHeader = 64;
constexpr uint32_t kLoadableSegment = 1;                    // PT_LOAD
constexpr uint32_t kDynamicSegment = 2;                     // PT_DYNAMIC
constexpr int64_t kNeeded = 1, kStringTable = 5;            // DT_NEEDED, DT_STRTAB
constexpr uint32_t kSymbolTable = 2, kDynamicSymbols = 11;  // SHT_SYMTAB, SHT_DYNSYM
constexpr size_t kSymbolSize = 24;                          // sizeof(Elf64_Sym)
constexpr size_t kLongestName = 4096;

// A little-endian field of `bytes` (the harness runs on little-endian hosts only).
template <typename T>
T field(const std::vector<char>& bytes, size_t offset) {
  T value;
  std::memcpy(&value, bytes.data() + offset, sizeof(T));
  return value;
}

// Reads a member's bytes: straight from the package file where the member is stored uncompressed
// (as torch writes packages), else through the archive reader, whole. A deflated member cannot show
// the ELF magic at its data offset: a first byte of 0x7f would begin a deflate block of the
// reserved type 3.
class MemberReader {
 public:
  MemberReader(const std::filesystem::path& package, caffe2::serialize::PyTorchStreamReader& archive,
               const std::string& record)
      : file_(package, std::ios::binary),
        offset_(archive.getRecordOffset(record)),
        size_(archive.getRecordSize(record)) {
    if (!stored_at_offset()) {
      auto [data, size] = archive.getRecord(record);
      const auto* begin = static_cast<const char*>(data.get());
      whole_.assign(begin, begin + size);
      size_ = whole_.size();
    }
  }

  size_t size() const { return size_; }

  // `count` bytes from `offset` into the member; fewer where it ends first.
  std::vector<char> read(size_t offset, size_t count) {
    const size_t begin = std::min(offset, size_);
    count = std::min(count, size_ - begin);
    if (!whole_.empty()) {
      const auto first = whole_.begin() + static_cast<std::ptrdiff_t>(begin);
      return {first, first + static_cast<std::ptrdiff_t>(count)};
    }
    std::vector<char> bytes(count);
    file_.clear();
    file_.seekg(static_cast<std::streamoff>(offset_ + begin));
    file_.read(bytes.data(), static_cast<std::streamsize>(count));
    bytes.resize(static_cast<size_t>(file_.gcount()));
    return bytes;
  }

 private:
  // Whether the file holds the member's ELF magic at its data offset: a stored member.
  bool stored_at_offset() {
    char magic[4] = {};
    if (size_ < sizeof(magic)) return false;
    file_.seekg(static_cast<std::streamoff>(offset_));
    file_.read(magic, sizeof(magic));
    return file_.gcount() == sizeof(magic) && std::memcmp(magic,
                                                          "\x7f"
                                                          "ELF",
                                                          sizeof(magic)) == 0;
  }

  std::ifstream file_;
  size_t offset_;
  size_t size_;
  std::vector<char> whole_;  // the member, where it is not stored: read through the archive
};

// Whether [start, start + length) ends past `size`, without the sum wrapping around.
bool ends_past(uint64_t start, uint64_t length, uint64_t size) {
  return start > size || length > size - start;
}

// start + length in decimal, however large (Python's message prints the exact sum).
std::string decimal_sum(uint64_t start, uint64_t length) {
  auto value = static_cast<unsigned __int128>(start) + length;
  std::string digits;
  do {
    digits.insert(digits.begin(), static_cast<char>('0' + static_cast<int>(value % 10)));
    value /= 10;
  } while (value != 0);
  return digits;
}

// The contract's elf_* failures, as kvexport.native.elf.check_elf raises them.
void check_elf(MemberReader& member, const std::string& name) {
  const uint64_t size = member.size();
  const auto header = member.read(0, kElfHeader);
  if (header.size() < kElfHeader ||
      std::memcmp(header.data(),
                  "\x7f"
                  "ELF",
                  4) != 0 ||
      header[4] != 2 || header[5] != 1) {
    throw contract_failure("elf_not_shared_object", {{"name", name}});
  }
  const auto program_headers = field<uint64_t>(header, 0x20), section_table = field<uint64_t>(header, 0x28);
  const uint64_t entry_size = field<uint16_t>(header, 0x36), entries = field<uint16_t>(header, 0x38);
  const uint64_t section_entry_size = field<uint16_t>(header, 0x3A), sections = field<uint16_t>(header, 0x3C);
  if (program_headers < kElfHeader || ends_past(program_headers, entry_size * entries, size) ||
      ends_past(section_table, section_entry_size * sections, size)) {
    throw contract_failure("elf_tables_past_end", {{"name", name}, {"size", std::to_string(size)}});
  }
  if (entries > 0 && entry_size < 40) {  // too short for p_type .. p_filesz
    throw contract_failure("elf_short_program_headers", {{"name", name}, {"entry_size", std::to_string(entry_size)}});
  }
  const auto table = member.read(program_headers, entry_size * entries);
  for (uint64_t i = 0; i < entries; ++i) {
    const size_t at = i * entry_size;
    const auto offset = field<uint64_t>(table, at + 8), file_size = field<uint64_t>(table, at + 32);
    if (field<uint32_t>(table, at) == kLoadableSegment && ends_past(offset, file_size, size)) {
      throw contract_failure("elf_segment_past_end",
                             {{"name", name}, {"end", decimal_sum(offset, file_size)}, {"size", std::to_string(size)}});
    }
  }
}

// The NUL-terminated string at `offset` of `bytes` (empty past its end).
std::string string_at(const std::vector<char>& bytes, uint64_t offset) {
  if (offset >= bytes.size()) return "";
  const char* begin = bytes.data() + offset;
  return std::string(begin, strnlen(begin, bytes.size() - offset));
}

// The DT_NEEDED names of a member whose tables check_elf accepted.
std::vector<std::string> needed_libraries(MemberReader& member) {
  const auto header = member.read(0, kElfHeader);
  const auto entry_size = field<uint16_t>(header, 0x36), entries = field<uint16_t>(header, 0x38);
  const auto table = member.read(field<uint64_t>(header, 0x20), uint64_t{entry_size} * entries);
  std::vector<char> dynamic;
  for (uint64_t i = 0; i < entries; ++i) {
    if (field<uint32_t>(table, i * entry_size) == kDynamicSegment) {
      dynamic = member.read(field<uint64_t>(table, i * entry_size + 8), field<uint64_t>(table, i * entry_size + 32));
    }
  }
  std::vector<uint64_t> needed;
  std::optional<uint64_t> strings;
  for (size_t at = 0; at + 16 <= dynamic.size(); at += 16) {
    const auto tag = field<int64_t>(dynamic, at);
    if (tag == 0) break;
    if (tag == kNeeded) needed.push_back(field<uint64_t>(dynamic, at + 8));
    if (tag == kStringTable) strings = field<uint64_t>(dynamic, at + 8);
  }
  std::vector<std::string> names;
  for (uint64_t i = 0; strings && i < entries; ++i) {  // DT_STRTAB is an address: find where it lies
    const size_t at = i * entry_size;
    const auto offset = field<uint64_t>(table, at + 8), address = field<uint64_t>(table, at + 16);
    const auto file_size = field<uint64_t>(table, at + 32);
    if (field<uint32_t>(table, at) != kLoadableSegment || *strings < address || *strings - address >= file_size)
      continue;
    for (const auto value : needed)
      names.push_back(string_at(member.read(offset + (*strings - address) + value, kLongestName), 0));
    break;
  }
  return names;
}

// Whether the member's symbol tables define, and whether they leave undefined, any of the C++
// runtime's entry points (the contract's cxx_runtime.entry_points).
std::pair<bool, bool> runtime_symbols(MemberReader& member) {
  const auto& entry_points = contract().at("cxx_runtime").at("entry_points");
  const auto header = member.read(0, kElfHeader);
  const uint64_t entry_size = field<uint16_t>(header, 0x3A), count = field<uint16_t>(header, 0x3C);
  const auto sections = member.read(field<uint64_t>(header, 0x28), entry_size * count);
  bool defines = false, references = false;
  for (uint64_t i = 0; i < count; ++i) {
    const size_t at = i * entry_size;
    const auto kind = field<uint32_t>(sections, at + 4);
    const auto link = field<uint32_t>(sections, at + 40);
    if ((kind != kSymbolTable && kind != kDynamicSymbols) || link >= count) continue;
    const auto strings = member.read(field<uint64_t>(sections, link * entry_size + 24),
                                     field<uint64_t>(sections, link * entry_size + 32));
    const auto symbols = member.read(field<uint64_t>(sections, at + 24), field<uint64_t>(sections, at + 32));
    for (size_t s = 0; s + kSymbolSize <= symbols.size(); s += kSymbolSize) {
      const auto name = string_at(strings, field<uint32_t>(symbols, s));
      if (std::find(entry_points.begin(), entry_points.end(), name) == entry_points.end()) continue;
      const bool undefined = field<uint16_t>(symbols, s + 6) == 0;
      defines |= !undefined;
      references |= undefined;
    }
  }
  return {defines, references};
}

// The member must use the host's C++ runtime (the contract's cxx_runtime rule), as
// kvexport.native.elf.carries_own_cxx_runtime decides.
void check_cxx_runtime(MemberReader& member, const std::string& name) {
  const auto library = contract().at("cxx_runtime").at("library").get<std::string>();
  const auto needed = needed_libraries(member);
  if (std::find(needed.begin(), needed.end(), library) != needed.end()) return;
  const auto [defines, references] = runtime_symbols(member);
  if (defines || !references) throw contract_failure("own_cxx_runtime", {{"name", name}, {"library", library}});
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
  try {
    caffe2::serialize::PyTorchStreamReader archive(package.string());
    const auto prefix = archive_prefix(package);
    for (const auto& record : archive.getAllRecords()) {
      if (!record.ends_with(".so")) continue;
      MemberReader member(package, archive, record);
      const auto name = package.string() + ": " + prefix + record;
      check_elf(member, name);
      check_cxx_runtime(member, name);
    }
  } catch (const c10::Error&) {  // a zip the reader cannot open, list or inflate
    throw ReplayError(kUnusable, package.string() + " is not a readable AOTInductor package");
  } catch (const std::bad_alloc&) {  // a member claiming more bytes than can be held
    throw ReplayError(kUnusable, package.string() + " is not a readable AOTInductor package");
  }
}

}  // namespace kvexport::replay
