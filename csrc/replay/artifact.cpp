#include "replay/artifact.h"

#include <openssl/evp.h>
#include <torch/serialize.h>

#include <fstream>
#include <iomanip>
#include <iterator>
#include <sstream>

namespace kvexport::replay {

namespace {

std::vector<char> read_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ReplayError(kUnusable, "cannot read " + path.string());
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

std::string sha256_hex(const std::vector<char>& bytes) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  if (EVP_Digest(bytes.data(), bytes.size(), digest, &length, EVP_sha256(), nullptr) != 1) {
    throw std::runtime_error("kvexport bug: EVP_Digest failed");
  }
  std::ostringstream hex;
  for (unsigned int i = 0; i < length; ++i) hex << std::hex << std::setw(2) << std::setfill('0') << int(digest[i]);
  return hex.str();
}

}  // namespace

Manifest read_manifest(const fs::path& root) {
  if (!fs::is_directory(root)) throw ReplayError(kUnusable, "artifact directory " + root.string() + " does not exist");
  const auto path = root / "manifest.json";
  if (!fs::is_regular_file(path)) {
    throw ReplayError(kUnusable, root.string() + " is not a kvexport artifact: manifest.json is missing");
  }
  Manifest m;
  m.root = root;
  try {
    const auto bytes = read_bytes(path);
    m.json = nlohmann::json::parse(bytes.begin(), bytes.end());
    for (const auto& step : m.json.at("trace").at("steps")) {
      m.steps.push_back({step.at("file").get<std::string>(), step.at("description").get<std::string>(),
                         step.value("expect_error", std::string())});
    }
    m.required_libraries = m.json.at("required_libraries").get<std::vector<std::string>>();
    m.atol = m.json.at("tolerance").at("atol").get<double>();
    m.rtol = m.json.at("tolerance").at("rtol").get<double>();
    m.json.at("files").get<std::map<std::string, std::string>>();
  } catch (const nlohmann::json::exception& e) {
    throw ReplayError(kUnusable, path.string() + " is not a usable manifest: " + e.what());
  }
  return m;
}

int check_files(const Manifest& manifest) {
  const auto files = manifest.json.at("files").get<std::map<std::string, std::string>>();
  for (const auto& [rel, digest] : files) {
    const auto path = manifest.root / rel;
    if (!fs::is_regular_file(path)) {
      throw ReplayError(kUnusable, "artifact " + manifest.root.string() + " is incomplete: " + rel +
                                       " is listed in the manifest but missing");
    }
    if (sha256_hex(read_bytes(path)) != digest) {
      throw ReplayError(kMismatch, rel + " does not match its sha256 in the manifest (modified or corrupted)");
    }
  }
  return static_cast<int>(files.size());
}

std::map<std::string, at::Tensor> load_step(const fs::path& path, bool expect_outputs) {
  const auto value = torch::pickle_load(read_bytes(path));
  if (!value.isGenericDict()) throw ReplayError(kUnusable, "trace file " + path.string() + " is not a dict");
  std::map<std::string, at::Tensor> tensors;
  for (const auto& item : value.toGenericDict()) {
    if (!item.key().isString() || !item.value().isTensor()) {
      throw ReplayError(kUnusable, "trace file " + path.string() + " holds a non-tensor entry");
    }
    tensors[item.key().toStringRef()] = item.value().toTensor();
  }
  for (const char* key : {"expected_cached", "expected_full"}) {
    if (expect_outputs && !tensors.count(key)) throw ReplayError(kUnusable, "trace file " + path.string() + " lacks " + key);
  }
  return tensors;
}

void check_manifest_against_package(const Manifest& manifest,
                                    const std::unordered_map<std::string, std::string>& metadata) {
  // The same lines as kvexport.artifact.trace_digest.
  const auto files = manifest.json.at("files");
  std::string lines;
  for (const auto& step : manifest.steps) {
    lines += step.file + "\t" + files.value(step.file, std::string()) + "\t" + step.expect_error + "\n";
  }
  auto from_metadata = [&](const char* key) {
    auto it = metadata.find(key);
    return it == metadata.end() ? nlohmann::json() : nlohmann::json::parse(it->second);
  };
  const auto digest = metadata.find("kvexport.trace_digest");
  const std::vector<std::pair<const char*, bool>> checks = {
      {"runtime_config", manifest.json.at("runtime_config") == from_metadata("kvexport.runtime_config")},
      {"tolerance", manifest.json.at("tolerance") == from_metadata("kvexport.tolerance")},
      {"required_libraries", manifest.json.at("required_libraries") == from_metadata("kvexport.required_libraries")},
      {"trace", digest != metadata.end() && digest->second == sha256_hex({lines.begin(), lines.end()})},
  };
  for (const auto& [field, agrees] : checks) {
    if (!agrees) {
      throw ReplayError(kMismatch, std::string("manifest.json was edited: its ") + field +
                                       " does not match model.pt2's metadata");
    }
  }
}

}  // namespace kvexport::replay
