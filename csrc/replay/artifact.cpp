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

std::string sha256_hex(const fs::path& path) {
  const auto bytes = read_bytes(path);
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  if (EVP_Digest(bytes.data(), bytes.size(), digest, &length, EVP_sha256(), nullptr) != 1) {
    throw std::runtime_error("kvexport bug: EVP_Digest failed for " + path.string());
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
      m.steps.push_back({step.at("file").get<std::string>(), step.at("description").get<std::string>()});
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
    if (sha256_hex(path) != digest) {
      throw ReplayError(kMismatch, rel + " does not match its sha256 in the manifest (modified or corrupted)");
    }
  }
  return static_cast<int>(files.size());
}

std::map<std::string, at::Tensor> load_step(const fs::path& path) {
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
    if (!tensors.count(key)) throw ReplayError(kUnusable, "trace file " + path.string() + " lacks " + key);
  }
  return tensors;
}

}  // namespace kvexport::replay
