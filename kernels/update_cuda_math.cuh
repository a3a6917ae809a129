// Device helpers of the CUDA update kernel (update_cuda.cu): the element types of the dtype table,
// conversions to and from the math type, and 16-byte packs.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "kernels/update_types.h"

namespace fsdp_ema::kernels::cuda_math {

// Calls f(TypeTag<T>{}) with T the CUDA element type of update dtype d (the dtype table's
// cuda_type column); nothing for a dtype the update does not take (the ops refuse it first).
template <typename F>
__device__ __forceinline__ void visit_update_type(format::DType d, F&& f) {
  switch (d) {
#define FSDP_EMA_X(id, name, size, floating, torch, python, roles, cpu_type, cuda_type) \
  case format::DType::id:                                                               \
    if constexpr (!std::is_void_v<cuda_type>) f(TypeTag<cuda_type>{});                  \
    return;
    FSDP_EMA_DTYPES(FSDP_EMA_X)
#undef FSDP_EMA_X
  }
}

template <typename Op, typename T>
__device__ __forceinline__ Op to_op(T x) {
  return static_cast<Op>(x);
}
template <>
__device__ __forceinline__ float to_op<float, __nv_bfloat16>(__nv_bfloat16 x) {
  return __bfloat162float(x);
}
template <>
__device__ __forceinline__ double to_op<double, __nv_bfloat16>(__nv_bfloat16 x) {
  return static_cast<double>(__bfloat162float(x));
}
template <>
__device__ __forceinline__ float to_op<float, __half>(__half x) {
  return __half2float(x);
}
template <>
__device__ __forceinline__ double to_op<double, __half>(__half x) {
  return static_cast<double>(__half2float(x));
}

template <typename T, typename Op>
__device__ __forceinline__ T from_op(Op x) {
  return static_cast<T>(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_op<__nv_bfloat16, float>(float x) {
  return __float2bfloat16_rn(x);
}
template <>
__device__ __forceinline__ __half from_op<__half, float>(float x) {
  return __float2half_rn(x);
}

// V elements of T, loaded and stored as 16-byte words (V * sizeof(T) is a multiple of 16).
template <typename T, int V>
struct alignas(16) Pack {
  static constexpr int kWords = static_cast<int>(sizeof(T)) * V / 16;
  T v[V];
  __device__ __forceinline__ void load(const T* src) {
#pragma unroll
    for (int k = 0; k < kWords; ++k) {
      reinterpret_cast<uint4*>(v)[k] = reinterpret_cast<const uint4*>(src)[k];
    }
  }
  __device__ __forceinline__ void store(T* dst) const {
#pragma unroll
    for (int k = 0; k < kWords; ++k) {
      reinterpret_cast<uint4*>(dst)[k] = reinterpret_cast<const uint4*>(v)[k];
    }
  }
};

}  // namespace fsdp_ema::kernels::cuda_math
