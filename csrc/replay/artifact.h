// The artifact directory as the replay harness sees it: manifest, file hashes, trace steps.
// Its rules (files, fields, metadata pairs, trace keys, failures) come from kvexport/contract.json,
// compiled in (replay/contract.h); `kvexport verify` follows the same file.
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

// The contract (kvexport/contract.json, compiled in) and its failure `rule` with the message's {name}
// placeholders filled in.
const nlohmann::json& contract();
ReplayError contract_failure(const std::string& rule, const std::map<std::string, std::string>& values);

struct TraceStep {
  std::string file;
  std::string reference_file;  // the float32 reference output; empty for a step that must fail
  std::string description;
  std::string expect_error;  // non-empty: the step must fail with this error code, cache unchanged
};

// The trace files' tensor keys, as the contract names them.
struct TraceKeys {
  std::string expected_cached, expected_full, expected_reference;
};
const TraceKeys& trace_keys();

struct Manifest {
  fs::path root;
  nlohmann::json json;
  std::vector<TraceStep> steps;
  std::vector<std::string> required_libraries;
  double atol = 0, rtol = 0;
};

// Parses OUT/manifest.json and checks its fields (kUnusable when absent or malformed).
Manifest read_manifest(const fs::path& root);
// Every listed file against its sha256, the required files, then unlisted files; returns the
// count of listed files. Throws the contract's failure naming the file.
int check_files(const Manifest& manifest);
// A recorded step: the request tensors by name plus, unless the step must fail, its expected
// outputs under trace_keys() (the eager ones from its file, the reference from its reference file).
std::map<std::string, at::Tensor> load_step(const Manifest& manifest, const TraceStep& step);
// manifest.json must agree with the metadata compiled into model.pt2 (kMismatch otherwise).
void check_manifest_against_package(const Manifest& manifest,
                                    const std::unordered_map<std::string, std::string>& metadata);

}  // namespace kvexport::replay
