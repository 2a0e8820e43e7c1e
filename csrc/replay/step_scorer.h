// How the harness scores a request: through model.pt2, which plans and runs the whole request (as
// plain hosts do), or through step.pt2 after planning the request on the host (docs/design.md 3.9),
// on a GPU as one CUDA graph per bucket of sizes.
#pragma once

#include <ATen/Tensor.h>
#include <c10/core/Device.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>

#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace kvexport::replay {

class Scorer {
 public:
  virtual ~Scorer() = default;
  // The logits of one request (its signature's tensors, on the host). A refusal throws; why is
  // the runtime's last_error.
  virtual at::Tensor score(const std::vector<at::Tensor>& request) = 0;
};

class ModelScorer final : public Scorer {
 public:
  explicit ModelScorer(torch::inductor::AOTIModelPackageLoader& loader) : loader_(loader) {}
  at::Tensor score(const std::vector<at::Tensor>& request) override { return loader_.run(request).at(0); }

 private:
  torch::inductor::AOTIModelPackageLoader& loader_;
};

// step.pt2, loaded single-threaded (a CUDA graph can capture its run): check_request and
// begin_step on the host, one upload, the step program (or its graph), end_batch; abort_batch
// when anything between fails. Requests never overlap: the runtime serialises them from
// begin_step to end_batch. Planning's inputs come from step.pt2's metadata.
class StepScorer final : public Scorer {
 public:
  StepScorer(std::unique_ptr<torch::inductor::AOTIModelPackageLoader> loader, c10::Device device, bool cuda_graphs);
  ~StepScorer() override;
  at::Tensor score(const std::vector<at::Tensor>& request) override;
  const std::string& runtime() const { return runtime_; }
  size_t num_graphs() const;

 private:
  struct Graphs;  // the CUDA graphs (CUDA builds only)
  at::Tensor run_step(const at::Tensor& staged, const std::vector<int64_t>& layout);

  std::unique_ptr<torch::inductor::AOTIModelPackageLoader> loader_;
  c10::Device device_;
  at::Tensor placement_;
  std::string runtime_, runtime_config_, limits_;
  int64_t max_prefix_length_ = 0;
  std::unique_ptr<Graphs> graphs_;
};

}  // namespace kvexport::replay
