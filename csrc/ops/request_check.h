// kvexport::check_request: every check that protects memory, runtime state and the package's
// declared limits, run inside the package before any other op reads the request.
#pragma once

#include <ATen/Tensor.h>

#include <string>
#include <tuple>
#include <vector>

namespace kvexport::ops {

using RequestTensors = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// Validates one request against limits_json (Config.request_limits_json) and returns copies of
// its tensors, which the rest of the graph reads, so no kernel can index with an unchecked id.
// Throws runtime::RequestError(kInvalidRequest) with one line naming the field and value.
RequestTensors check_request(const std::string& limits_json, const at::Tensor& user_ids,
                             const at::Tensor& history_lengths, const at::Tensor& item_ids,
                             const at::Tensor& action_ids, const at::Tensor& context_ids,
                             const at::Tensor& num_candidates, const at::Tensor& candidate_ids);

// dtype (int64), rank and device of one input, `name`d in the one-line refusal
// (RequestError kInvalidRequest): nothing else may read a tensor whose bytes are not int64.
void check_kind(const char* name, const at::Tensor& t, int64_t ndim, const at::Device& device);

// The tensors' values on the host, contiguous, in order; on a GPU in one device-to-host copy (one
// wait for the device, not one per tensor). All must have one dtype and device.
std::vector<at::Tensor> on_host(const std::vector<at::Tensor>& inputs);

}  // namespace kvexport::ops
