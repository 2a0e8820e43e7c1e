// Request files given to the harness on the command line (not part of an artifact).
#pragma once

#include <ATen/Tensor.h>

#include <filesystem>
#include <map>
#include <string>
#include <vector>

namespace kvexport::replay {

// A torch.save'd list of requests, each a dict of tensors (keys as in the package signature).
// Throws ReplayError(kUnusable) naming the file when it is not one.
std::vector<std::map<std::string, at::Tensor>> load_request_list(const std::filesystem::path& path);

}  // namespace kvexport::replay
