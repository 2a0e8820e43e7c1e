// The Hopper (sm_90a) path of the CUDA attention: warp-specialised, wgmma on the tensor cores
// (paged_attention_sm90.cu). Built only when CUTLASS's headers are found (KVEXPORT_WITH_SM90).
#pragma once

#include "ops/attention_cuda_params.h"

#include <cuda_runtime_api.h>

#include <cstdint>

namespace kvexport::ops::sm90 {

enum class Element { kBFloat16, kHalf };

// Whether the Hopper kernel takes this head size (the others fall back to the sm80 kernel).
bool supports_head_dim(int head_dim);

// Consumer warpgroups (64 query rows each) for a batch whose widest tile has max_tile_rows rows.
int consumers_for(int64_t max_tile_rows);

// Blocks of the kernel for (element, head_dim, consumers) resident on `device` at once; raises the
// kernel's dynamic shared-memory limit on first use there. Returns the CUDA error of a failed call.
cudaError_t resident_blocks(Element element, int head_dim, int consumers, int device, int64_t* blocks);

// One block per (tile, head, key chunk): p.chunks and p.chunk_keys are set, and p.partial when
// chunks > 1 (the caller adds the chunks and the candidates' self term then).
cudaError_t launch(const AttentionParams& p, Element element, int64_t num_tiles, int consumers, cudaStream_t stream);

}  // namespace kvexport::ops::sm90
