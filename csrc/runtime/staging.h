// Host buffers for host-to-device copies that do not wait for the device.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace kvexport::runtime {

// A host buffer of `count` int64 values to fill and then copy to `device` with
// .to(device, /*non_blocking=*/true): pinned when `device` is a GPU, so that the copy is
// asynchronous on the current stream (from pageable memory it would wait for the device), and
// kept by torch's host allocator until the copy has run.
inline at::Tensor staging_buffer(int64_t count, const at::Device& device) {
  return at::empty({count}, at::TensorOptions().dtype(at::kLong).pinned_memory(device.is_cuda()));
}

}  // namespace kvexport::runtime
