// A C++ host of a kvexport package: libtorch and the op library, no Python, no config file.
//
//   host OUT [LIBRARY.so ...]
//
// OUT is an artifact directory written by `kvexport build`; further LIBRARY.so arguments are op
// libraries the manifest's required_libraries names besides kvexport_ops (fbgemm_gpu_py.so for a
// package built with fbgemm's jagged ops). Scores the first request of OUT's trace, then the same
// request with int32 candidate ids (the package must refuse it), asks the runtime why, and scores
// the first request again. See docs/hosting.md.
#include <dlfcn.h>

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/serialize.h>

#include <cstdio>
#include <fstream>
#include <iterator>
#include <limits>
#include <string>
#include <vector>

namespace {

// The package's input order (its "kvexport.signature" metadata).
const std::vector<std::string> kSignature = {"user_ids",   "history_lengths", "item_ids",     "action_ids",
                                             "context_ids", "num_candidates", "candidate_ids"};

std::vector<char> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + path);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// The runtime's record of this thread's last failed request: (code, message).
std::pair<std::string, std::string> last_error(const std::string& runtime) {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("kvexport::last_error", "");
  std::vector<c10::IValue> stack{runtime};
  op.callBoxed(&stack);
  return {stack.at(0).toStringRef(), stack.at(1).toStringRef()};
}

int run(int argc, char** argv) {
  const std::string out = argv[1];
  // The package calls kvexport:: ops by name: their library must be loaded, globally, first.
  std::vector<std::string> libraries = {out + "/lib/libkvexport_ops.so"};
  libraries.insert(libraries.end(), argv + 2, argv + argc);
  for (const auto& library : libraries) {
    if (!dlopen(library.c_str(), RTLD_NOW | RTLD_GLOBAL)) {
      std::fprintf(stderr, "error: cannot load %s: %s\n", library.c_str(), dlerror());
      return 2;
    }
  }
  torch::inductor::AOTIModelPackageLoader loader(out + "/model.pt2");
  auto metadata = loader.get_metadata();
  const std::string runtime = metadata.at("kvexport.runtime_name");
  std::string signature = "[";
  for (const auto& name : kSignature) signature += (signature.size() > 1 ? ", \"" : "\"") + name + "\"";
  if (metadata.at("kvexport.signature") != signature + "]") {
    std::fprintf(stderr, "error: unexpected signature %s\n", metadata.at("kvexport.signature").c_str());
    return 2;
  }

  // A trace step is a torch.save'd dict: the request's tensors plus the expected logits.
  const auto step = torch::pickle_load(read_file(out + "/trace/step_0000.pt")).toGenericDict();
  std::vector<at::Tensor> request;
  for (const auto& name : kSignature) request.push_back(step.at(name).toTensor());
  const auto expected = step.at("expected_full").toTensor();

  auto score = [&](const char* tag) {
    const auto logits = loader.run(request).at(0);
    const double error = logits.sizes() == expected.sizes() ? (logits - expected).abs().max().item<double>()
                                                            : std::numeric_limits<double>::infinity();
    std::printf("%s shape [%lld, %lld] max_abs_err %.3e\n", tag, static_cast<long long>(logits.size(0)),
                static_cast<long long>(logits.dim() > 1 ? logits.size(1) : 0), error);
    std::fflush(stdout);
  };

  score("good");
  auto bad = request;
  bad.back() = bad.back().to(at::kInt);  // candidate_ids as int32: the package takes int64 only
  try {
    loader.run(bad);
    std::puts("bad accepted");
  } catch (const std::exception&) {  // one catchable error; its text is not parsed
    std::puts("bad refused");
  }
  const auto [code, message] = last_error(runtime);
  std::printf("last_error %s: %s\n", code.c_str(), message.c_str());
  std::fflush(stdout);
  score("again");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s OUT [LIBRARY.so ...]\n", argv[0]);
    return 2;
  }
  try {
    return run(argc, argv);
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what_without_backtrace());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
  }
  return 1;
}
