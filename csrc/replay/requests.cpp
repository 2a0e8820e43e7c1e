#include "replay/requests.h"

#include <torch/serialize.h>

#include <fstream>
#include <iterator>

#include "replay/artifact.h"

namespace kvexport::replay {

namespace {

std::vector<char> file_bytes(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ReplayError(kUnusable, "cannot read request file " + path.string());
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

std::map<std::string, at::Tensor> to_request(const c10::IValue& value, const std::filesystem::path& path) {
  if (!value.isGenericDict()) throw ReplayError(kUnusable, path.string() + ": every request must be a dict");
  std::map<std::string, at::Tensor> request;
  for (const auto& item : value.toGenericDict()) {
    if (!item.key().isString() || !item.value().isTensor()) {
      throw ReplayError(kUnusable, path.string() + ": a request must map names to tensors");
    }
    request[item.key().toStringRef()] = item.value().toTensor();
  }
  return request;
}

}  // namespace

std::vector<std::map<std::string, at::Tensor>> load_request_list(const std::filesystem::path& path) {
  c10::IValue value;
  try {
    value = torch::pickle_load(file_bytes(path));
  } catch (const c10::Error& e) {
    throw ReplayError(kUnusable, "request file " + path.string() + " is not a torch.save'd list of dicts");
  }
  if (!value.isList()) throw ReplayError(kUnusable, "request file " + path.string() + " must hold a list");
  std::vector<std::map<std::string, at::Tensor>> requests;
  for (const auto& item : value.toListRef()) requests.push_back(to_request(item, path));
  return requests;
}

}  // namespace kvexport::replay
