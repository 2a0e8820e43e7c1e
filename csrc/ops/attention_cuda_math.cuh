// Device helpers shared by the CUDA attention kernels (paged_attention_cuda.cu and the Hopper
// path, paged_attention_sm90.cu): conversions, the SiLU variants, 16-bit pairs in one register.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace kvexport::ops {

__device__ __forceinline__ float to_float(float x) {
  return x;
}
__device__ __forceinline__ float to_float(__half x) {
  return __half2float(x);
}
__device__ __forceinline__ float to_float(__nv_bfloat16 x) {
  return __bfloat162float(x);
}

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// Exact SiLU (expf, IEEE division; no fast math): the reference comparison of float32 and the
// fp32 self term.
__device__ __forceinline__ float silu(float x) {
  return x / (1.0f + expf(-x));
}

// SiLU of the score tiles, whose result is rounded to bf16/fp16 (relative error 2^-9 / 2^-12)
// right after: __expf (ex2.approx, at most 2 + 1.2 |x| ulp: about 1e-6 relative at |x| = 7) and
// an approximate division are far inside that rounding, and the exact versions would cost more
// issue slots than the tensor-core work of the tile.
__device__ __forceinline__ float silu_fast(float x) {
  return __fdividef(x, 1.0f + __expf(-x));
}

// The same for bf16 weights, in one multi-function-unit instruction instead of two:
// SiLU(x) = h + h tanh(h) with h = x / 2, tanh.approx's error (about 2^-11 relative to 1) below the
// 2^-9 of the bf16 rounding that follows. Not for fp16, whose rounding is 8 times finer.
__device__ __forceinline__ float silu_tanh(float x) {
  const float h = 0.5f * x;
  float t;
  asm("tanh.approx.f32 %0, %1;" : "=f"(t) : "f"(h));
  return fmaf(h, t, h);
}

template <typename T>
__device__ __forceinline__ float silu_weight(float x) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return silu_tanh(x);
  } else {
    return silu_fast(x);
  }
}

// Two floats as one register of two 16-bit values (lo in the low half: the lower column).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  const __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

template <typename T>
__device__ __forceinline__ float2 unpack2(uint32_t bits);
template <>
__device__ __forceinline__ float2 unpack2<__nv_bfloat16>(uint32_t bits) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&bits));
}
template <>
__device__ __forceinline__ float2 unpack2<__half>(uint32_t bits) {
  return __half22float2(*reinterpret_cast<const __half2*>(&bits));
}

__device__ __forceinline__ uint32_t load_pair(const void* p) {
  return *static_cast<const uint32_t*>(p);
}

}  // namespace kvexport::ops
