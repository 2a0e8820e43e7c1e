#include "replay/step_scorer.h"

#include "replay/artifact.h"
#include "replay/ops.h"
#include "runtime/batch_plan.h"

#include <ATen/ATen.h>

#ifdef KVEXPORT_WITH_CUDA
#include <ATen/cuda/CUDAGraph.h>
#include <c10/core/Event.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <list>
#include <map>
#include <tuple>

namespace kvexport::replay {

namespace {

const std::string& metadata_value(const std::unordered_map<std::string, std::string>& metadata, const char* key) {
  const auto it = metadata.find(key);
  if (it == metadata.end()) throw ReplayError(kUnusable, std::string("step.pt2 lacks the metadata ") + key);
  return it->second;
}

// The step program's inputs: views of begin_step's buffer, in StepLayout's order and offsets.
std::vector<at::Tensor> split(const at::Tensor& buffer, const runtime::StepLayout& layout) {
  std::vector<at::Tensor> parts;
  const auto sizes = layout.sizes(), offsets = layout.offsets();
  for (size_t i = 0; i < sizes.size(); ++i) parts.push_back(buffer.narrow(0, offsets[i], sizes[i]));
  parts[4] = parts[4].view({layout.users, layout.pages_per_user});
  parts[11] = parts[11].view({layout.tiles, 3});
  return parts;
}

}  // namespace

#ifdef KVEXPORT_WITH_CUDA
// One captured step per bucket, least recently used dropped first; each reads its own buffer.
struct StepScorer::Graphs {
  using Bucket = std::tuple<int64_t, int64_t, int64_t>;
  struct Captured {
    at::Tensor buffer, logits;
    std::unique_ptr<at::cuda::CUDAGraph> graph;
  };
  Graphs(c10::DeviceIndex index, int64_t max_rows, size_t max_graphs)
      : stream(c10::cuda::getStreamFromPool(false, index)),
        pool(at::cuda::graph_pool_handle()),
        max_rows(max_rows),
        max_graphs(max_graphs) {}
  c10::cuda::CUDAStream stream;
  at::cuda::MempoolId_t pool;
  int64_t max_rows;
  size_t max_graphs;
  std::map<Bucket, Captured> captured;
  std::list<Bucket> recent;  // most recently used first
};
#else
struct StepScorer::Graphs {};
#endif

StepScorer::StepScorer(std::unique_ptr<torch::inductor::AOTIModelPackageLoader> loader, c10::Device device,
                       bool cuda_graphs)
    : loader_(std::move(loader)), device_(device), placement_(at::empty({0}, at::TensorOptions().device(device))) {
  const auto metadata = loader_->get_metadata();
  runtime_ = metadata_value(metadata, "kvexport.runtime_name");
  runtime_config_ = metadata_value(metadata, "kvexport.runtime_config");
  limits_ = metadata_value(metadata, "kvexport.request_limits");
  max_prefix_length_ = std::stoll(metadata_value(metadata, "kvexport.max_prefix_length"));
#ifdef KVEXPORT_WITH_CUDA
  if (cuda_graphs && device.is_cuda()) {
    graphs_ = std::make_unique<Graphs>(device.index(), std::stoll(metadata_value(metadata, "kvexport.max_graph_rows")),
                                       std::stoull(metadata_value(metadata, "kvexport.max_graphs")));
  }
#else
  if (cuda_graphs && device.is_cuda()) {
    throw ReplayError(kUnusable, "this harness was built without CUDA: it cannot replay CUDA graphs");
  }
#endif
}

StepScorer::~StepScorer() = default;

size_t StepScorer::num_graphs() const {
#ifdef KVEXPORT_WITH_CUDA
  if (graphs_) return graphs_->captured.size();
#endif
  return 0;
}

at::Tensor StepScorer::score(const std::vector<at::Tensor>& request) {
  std::vector<c10::IValue> args = {runtime_, limits_};
  args.insert(args.end(), request.begin(), request.end());
  const auto checked = call_op("kvexport::check_request", std::move(args));
  const auto &user_ids = checked.at(0).toTensor(), &token_lengths = checked.at(1).toTensor(),
             &token_ids = checked.at(2).toTensor(), &num_candidates = checked.at(3).toTensor(),
             &candidate_ids = checked.at(4).toTensor();
  const auto planned = call_op("kvexport::begin_step", {runtime_, runtime_config_, user_ids, token_ids, token_lengths,
                                                        num_candidates, candidate_ids, placement_, max_prefix_length_});
  const auto layout = planned.at(1).toTensor();
  try {
    auto logits =
        run_step(planned.at(0).toTensor(), {layout.data_ptr<int64_t>(), layout.data_ptr<int64_t>() + layout.numel()});
    call_op("kvexport::end_batch", {runtime_, user_ids, logits});
    return logits;
  } catch (...) {
    call_op("kvexport::abort_batch", {runtime_});  // nothing is committed
    throw;
  }
}

at::Tensor StepScorer::run_step(const at::Tensor& staged, const std::vector<int64_t>& values) {
  const auto layout = runtime::StepLayout::from_vector(values);
  if (!graphs_) {
    return loader_->run(split(staged.to(device_, /*non_blocking=*/true), layout))
        .at(0)
        .narrow(0, 0, layout.real_candidates);
  }
#ifdef KVEXPORT_WITH_CUDA
  auto& g = *graphs_;
  // Every request on one stream of the harness's, so a replay never overlaps the next request's
  // copy into its buffer; the caller's stream waits for the logits.
  const auto caller = c10::cuda::getCurrentCUDAStream(device_.index());
  c10::Event before(c10::DeviceType::CUDA);
  before.record(caller);
  before.block(g.stream);
  at::Tensor logits;
  {
    const c10::cuda::CUDAStreamGuard on_stream(g.stream);
    const Graphs::Bucket bucket{layout.candidate_rows, layout.prefix_rows, layout.users};
    if (auto found = g.captured.find(bucket); found != g.captured.end()) {
      g.recent.remove(bucket);
      g.recent.push_front(bucket);
      found->second.buffer.copy_(staged, /*non_blocking=*/true);
      found->second.graph->replay();
      logits = found->second.logits.narrow(0, 0, layout.real_candidates).clone();
    } else {
      auto buffer = staged.to(device_, /*non_blocking=*/true);
      const auto inputs = split(buffer, layout);
      logits = loader_->run(inputs).at(0).narrow(0, 0, layout.real_candidates);
      if (layout.rows() <= g.max_rows) {
        // Records the same launches on the same buffer; nothing runs until a replay.
        auto graph = std::make_unique<at::cuda::CUDAGraph>();
        graph->capture_begin(g.pool, cudaStreamCaptureModeThreadLocal);
        auto captured = loader_->run(inputs).at(0);
        graph->capture_end();
        if (g.captured.size() == g.max_graphs) {
          g.captured.erase(g.recent.back());
          g.recent.pop_back();
        }
        g.captured[bucket] = {std::move(buffer), std::move(captured), std::move(graph)};
        g.recent.push_front(bucket);
      }
    }
  }
  c10::Event after(c10::DeviceType::CUDA);
  after.record(g.stream);
  after.block(caller);
  logits.record_stream(caller);
  return logits;
#else
  return {};
#endif
}

}  // namespace kvexport::replay
