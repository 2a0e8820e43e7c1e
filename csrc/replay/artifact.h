// The artifact directory as the replay harness sees it: manifest, file hashes, trace steps.
#pragma once

#include <ATen/Tensor.h>

#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <unordered_map>
#include <vector>

namespace kvexport::replay {

namespace fs = std::filesystem;

// Exit codes shared with `kvexport verify`.
enum ExitCode { kPass = 0, kMismatch = 1, kUnusable = 2 };

// An error that ends the run with an exit code and a one-line message.
struct ReplayError : std::runtime_error {
  ReplayError(ExitCode code, const std::string& message) : std::runtime_error(message), code(code) {}
  ExitCode code;
};

struct TraceStep {
  std::string file;
  std::string description;
  std::string expect_error;  // non-empty: the step must fail with this message, cache unchanged
};

struct Manifest {
  fs::path root;
  nlohmann::json json;
  std::vector<TraceStep> steps;
  std::vector<std::string> required_libraries;
  double atol = 0, rtol = 0;
};

// Parses OUT/manifest.json (kUnusable when absent or malformed).
Manifest read_manifest(const fs::path& root);
// Compares every listed file with its sha256 (kMismatch naming the file); returns the count.
int check_files(const Manifest& manifest);
// A recorded step: the request tensors by name plus expected_cached and expected_full (absent
// for a step that must fail).
std::map<std::string, at::Tensor> load_step(const fs::path& path, bool expect_outputs);
// manifest.json must agree with the metadata compiled into model.pt2 (kMismatch otherwise).
void check_manifest_against_package(const Manifest& manifest,
                                    const std::unordered_map<std::string, std::string>& metadata);

}  // namespace kvexport::replay
