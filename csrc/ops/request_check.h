// kvexport::check_request: every check that protects memory, runtime state and the package's
// declared limits, run inside the package before any other op reads the request.
#pragma once

#include <ATen/Tensor.h>

#include <string>
#include <tuple>
#include <vector>

namespace kvexport::ops {

// user_ids, token_lengths, token_ids, num_candidates, candidate_ids: what the rest of the graph reads.
using RequestTensors = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// Validates one request (host tensors) against limits_json (Config.request_limits_json) and
// returns, on the host, what the rest of the graph reads, so no kernel can index with an unchecked
// id: copies of user_ids, num_candidates and candidate_ids (with a query time, request limits'
// query_time_periods, each candidate id becomes (item << code bits) | the calendar code of its
// user's query time, context_ids' last column), each user's prefix length
// (token_lengths: C + 2h, or C + h with combined event tokens) and its prefix tokens laid out
// (token_ids, users one after another: its context ids, then item and action ids interleaved,
// i_1 a_1 i_2 a_2 ..., or one (item << bits) | action per event; the host counterpart of
// the model's prefix_tokens in kvexport/model/hstu.py, which the full recompute runs; the cache
// parity tests keep the two equal). The events are read once, checked as they are laid out.
// Reads nothing from a device, so it never waits for one.
// Throws runtime::RequestError(kInvalidRequest) with one line naming the field and value.
RequestTensors check_request(const std::string& limits_json, const at::Tensor& user_ids,
                             const at::Tensor& history_lengths, const at::Tensor& item_ids,
                             const at::Tensor& action_ids, const at::Tensor& context_ids,
                             const at::Tensor& num_candidates, const at::Tensor& candidate_ids);

// dtype (int64), rank and place of one request tensor, `name`d in the one-line refusal
// (RequestError kInvalidRequest): a request is read on the host, whatever the package's device,
// and nothing may read a tensor whose bytes are not int64.
void check_kind(const char* name, const at::Tensor& t, int64_t ndim);

// Contiguous copies of host tensors on `device`: on a GPU staged in one pinned buffer and copied
// asynchronously on the current stream (no wait for the device). All must be int64 on the host.
std::vector<at::Tensor> upload(at::TensorList host, const at::Device& device);

}  // namespace kvexport::ops
