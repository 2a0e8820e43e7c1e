#include "replay/artifact.h"

#include <openssl/evp.h>
#include <torch/serialize.h>

#include <algorithm>
#include <fstream>
#include <iomanip>
#include <iterator>
#include <sstream>

#include "replay/contract.h"

namespace kvexport::replay {

namespace {

using json = nlohmann::json;

// A JSON value as Python's str() shows it in a message (strings without quotes).
std::string text(const json& value) {
  return value.is_string() ? value.get<std::string>() : value.dump();
}

std::string trace_field(const char* role) {
  return contract().at("trace").at(role).get<std::string>();
}

std::vector<char> read_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ReplayError(kUnusable, "cannot read " + path.string());
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

std::string sha256_hex(const std::string& bytes) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  if (EVP_Digest(bytes.data(), bytes.size(), digest, &length, EVP_sha256(), nullptr) != 1) {
    throw std::runtime_error("kvexport bug: EVP_Digest failed");
  }
  std::ostringstream hex;
  for (unsigned int i = 0; i < length; ++i) hex << std::hex << std::setw(2) << std::setfill('0') << int(digest[i]);
  return hex.str();
}

std::string sha256_of(const fs::path& path) {
  const auto bytes = read_bytes(path);
  return sha256_hex({bytes.begin(), bytes.end()});
}

// A trace step: an object whose contract fields, where present, are strings (file and
// description required), as kvexport.artifact._is_step.
bool is_step(const json& step) {
  if (!step.is_object()) return false;
  for (const char* role : {"file", "description"}) {
    const auto key = trace_field(role);
    if (!step.contains(key) || !step.at(key).is_string()) return false;
  }
  for (const char* role : {"reference_file", "expect_error"}) {
    const auto key = trace_field(role);
    if (step.contains(key) && !step.at(key).is_string()) return false;
  }
  return true;
}

bool all_strings(const json& values) {
  return std::all_of(values.begin(), values.end(), [](const json& v) { return v.is_string(); });
}

// The contract's fields are present, with the types both checkers read them as (the same order
// of checks as kvexport.artifact._check_manifest_shape).
void check_manifest_shape(const json& m, const fs::path& path) {
  const std::string where = path.string();
  for (const auto& field : contract().at("manifest_fields")) {
    if (!m.is_object() || !m.contains(field.get<std::string>())) {
      throw contract_failure("manifest_field_missing", {{"path", where}, {"field", field.get<std::string>()}});
    }
  }
  const auto steps_key = trace_field("steps");
  const auto& trace = m.at("trace");
  if (!trace.is_object() || !trace.contains(steps_key) || !trace.at(steps_key).is_array()) {
    throw contract_failure("trace_steps_missing", {{"path", where}});
  }
  const auto& expected_version = contract().at("format_version");
  if (m.at("format_version") != expected_version) {
    throw contract_failure(
        "format_version",
        {{"path", where}, {"found", text(m.at("format_version"))}, {"expected", text(expected_version)}});
  }
  auto malformed = [&](const char* field) {
    return contract_failure("manifest_field_malformed", {{"path", where}, {"field", field}});
  };
  if (!m.at("files").is_object() || !all_strings(m.at("files"))) throw malformed("files");
  const auto& steps = trace.at(steps_key);
  if (!std::all_of(steps.begin(), steps.end(), is_step)) throw malformed("trace");
  const auto& tolerance = m.at("tolerance");
  if (!tolerance.is_object() || !tolerance.value("atol", json()).is_number() ||
      !tolerance.value("rtol", json()).is_number()) {
    throw malformed("tolerance");
  }
  if (!m.at("required_libraries").is_array() || !all_strings(m.at("required_libraries"))) {
    throw malformed("required_libraries");
  }
}

// Every file under root the manifest must list: all but the manifest and the unhashed directories.
std::vector<std::string> present_files(const fs::path& root) {
  const auto manifest = contract().at("manifest").get<std::string>();
  std::vector<std::string> names;
  for (const auto& entry : fs::recursive_directory_iterator(root)) {
    if (!entry.is_regular_file()) continue;
    const auto rel = entry.path().lexically_relative(root).generic_string();
    const auto& skipped = contract().at("unhashed_dirs");
    const bool unhashed = std::any_of(skipped.begin(), skipped.end(),
                                      [&](const json& dir) { return rel.rfind(dir.get<std::string>() + "/", 0) == 0; });
    if (rel != manifest && !unhashed) names.push_back(rel);
  }
  std::sort(names.begin(), names.end());
  return names;
}

// The same lines as kvexport.artifact.trace_digest: the contract's columns, tab-separated.
std::string trace_digest(const Manifest& manifest) {
  const std::string hash_prefix = "sha256:";
  const auto& files = manifest.json.at("files");
  std::string lines;
  for (const auto& step : manifest.json.at("trace").at(trace_field("steps"))) {
    std::string separator;
    for (const auto& column_json : contract().at("trace_digest").at("columns")) {
      const auto column = column_json.get<std::string>();
      const bool hashed = column.rfind(hash_prefix, 0) == 0;
      const auto value = step.value(hashed ? column.substr(hash_prefix.size()) : column, std::string());
      lines += separator + (hashed ? files.value(value, std::string()) : value);
      separator = "\t";
    }
    lines += "\n";
  }
  return sha256_hex(lines);
}

// A metadata entry as the contract encodes it; absent (or unreadable JSON) reads as null.
json metadata_value(const std::unordered_map<std::string, std::string>& metadata, const std::string& key,
                    const std::string& encoding) {
  const auto it = metadata.find(key);
  if (it == metadata.end()) return json();
  if (encoding == "string") return json(it->second);
  auto parsed = json::parse(it->second, nullptr, /*allow_exceptions=*/false);
  return parsed.is_discarded() ? json() : parsed;
}

std::map<std::string, at::Tensor> load_tensors(const fs::path& path) {
  const auto value = torch::pickle_load(read_bytes(path));
  if (!value.isGenericDict()) throw ReplayError(kUnusable, "trace file " + path.string() + " is not a dict");
  std::map<std::string, at::Tensor> tensors;
  for (const auto& item : value.toGenericDict()) {
    if (!item.key().isString() || !item.value().isTensor()) {
      throw ReplayError(kUnusable, "trace file " + path.string() + " holds a non-tensor entry");
    }
    tensors[item.key().toStringRef()] = item.value().toTensor();
  }
  return tensors;
}

}  // namespace

const TraceKeys& trace_keys() {
  static const TraceKeys keys{trace_field("expected_cached"), trace_field("expected_full"),
                              trace_field("expected_reference")};
  return keys;
}

Manifest read_manifest(const fs::path& root) {
  if (!fs::is_directory(root)) throw contract_failure("no_directory", {{"root", root.string()}});
  const auto path = root / contract().at("manifest").get<std::string>();
  if (!fs::is_regular_file(path)) throw contract_failure("manifest_missing", {{"root", root.string()}});
  Manifest m;
  m.root = root;
  const auto bytes = read_bytes(path);
  m.json = json::parse(bytes.begin(), bytes.end(), nullptr, /*allow_exceptions=*/false);
  if (m.json.is_discarded()) throw contract_failure("manifest_invalid", {{"path", path.string()}});
  check_manifest_shape(m.json, path);
  for (const auto& step : m.json.at("trace").at(trace_field("steps"))) {
    m.steps.push_back({step.at(trace_field("file")).get<std::string>(),
                       step.value(trace_field("reference_file"), std::string()),
                       step.at(trace_field("description")).get<std::string>(),
                       step.value(trace_field("expect_error"), std::string())});
  }
  m.required_libraries = m.json.at("required_libraries").get<std::vector<std::string>>();
  m.atol = m.json.at("tolerance").at("atol").get<double>();
  m.rtol = m.json.at("tolerance").at("rtol").get<double>();
  return m;
}

int check_files(const Manifest& manifest) {
  const auto files = manifest.json.at("files").get<std::map<std::string, std::string>>();
  const auto root = manifest.root.string();
  for (const auto& [rel, digest] : files) {
    if (!fs::is_regular_file(manifest.root / rel)) {
      throw contract_failure("listed_file_missing", {{"root", root}, {"file", rel}});
    }
    if (sha256_of(manifest.root / rel) != digest) throw contract_failure("file_modified", {{"file", rel}});
  }
  for (const auto& required : contract().at("required_files")) {
    const auto rel = required.get<std::string>();
    if (!fs::is_regular_file(manifest.root / rel)) {
      throw contract_failure("required_file_missing", {{"root", root}, {"file", rel}});
    }
  }
  for (const auto& rel : present_files(manifest.root)) {
    if (!files.count(rel)) throw contract_failure("file_unlisted", {{"file", rel}});
  }
  return static_cast<int>(files.size());
}

std::map<std::string, at::Tensor> load_step(const Manifest& manifest, const TraceStep& step) {
  auto tensors = load_tensors(manifest.root / step.file);
  if (!step.expect_error.empty()) return tensors;
  const auto& keys = trace_keys();
  for (const auto& key : {keys.expected_cached, keys.expected_full}) {
    if (!tensors.count(key)) throw ReplayError(kUnusable, "trace file " + step.file + " lacks " + key);
  }
  if (step.reference_file.empty()) {
    throw ReplayError(kUnusable, "trace step " + step.file + " lacks its " + trace_field("reference_file"));
  }
  auto reference = load_tensors(manifest.root / step.reference_file);
  if (!reference.count(keys.expected_reference)) {
    throw ReplayError(kUnusable, "trace file " + step.reference_file + " lacks " + keys.expected_reference);
  }
  tensors[keys.expected_reference] = reference.at(keys.expected_reference);
  return tensors;
}

void check_manifest_against_package(const Manifest& manifest,
                                    const std::unordered_map<std::string, std::string>& metadata) {
  for (const auto& pair : contract().at("package_metadata")) {
    const auto field = pair.at("field").get<std::string>();
    const auto expected =
        metadata_value(metadata, pair.at("key").get<std::string>(), pair.at("encoding").get<std::string>());
    if (manifest.json.value(field, json()) != expected) throw contract_failure("metadata_mismatch", {{"field", field}});
  }
  const auto& digest = contract().at("trace_digest");
  const auto it = metadata.find(digest.at("key").get<std::string>());
  if (it == metadata.end() || it->second != trace_digest(manifest)) {
    throw contract_failure("metadata_mismatch", {{"field", digest.at("field").get<std::string>()}});
  }
}

const json& contract() {
  static const json parsed = json::parse(kContractJson);
  return parsed;
}

ReplayError contract_failure(const std::string& rule, const std::map<std::string, std::string>& values) {
  const auto& f = contract().at("failures").at(rule);
  auto message = f.at("message").get<std::string>();
  for (const auto& [name, value] : values) {
    const auto placeholder = "{" + name + "}";
    for (auto at = message.find(placeholder); at != std::string::npos;
         at = message.find(placeholder, at + value.size())) {
      message.replace(at, placeholder.size(), value);
    }
  }
  return ReplayError(static_cast<ExitCode>(f.at("exit").get<int>()), message);
}

}  // namespace kvexport::replay
