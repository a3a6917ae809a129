// Plain data shared by the host code in ops/ and the CPU/CUDA update kernels (no torch types, so
// the .cu files stay free of ATen headers). Element types are format::DType, from the one dtype
// table (fsdp_ema/format/dtype_table.h): the kernels take the rows with kRoleEma / kRoleModel, as
// the table's cpu_type / cuda_type columns give them.
#pragma once

#include <cstdint>
#include <type_traits>

#include "fsdp_ema/format/dtype_table.h"

namespace fsdp_ema::kernels {

// A type, as a value (for visitors).
template <typename T>
struct TypeTag {
  using type = T;
};

#if defined(__CUDACC__)
#define FSDP_EMA_HOST_DEVICE __host__ __device__
#else
#define FSDP_EMA_HOST_DEVICE
#endif

// The weight w = 1 - decay of ema <- lerp(ema, model, w) in the math type Op (float, or double
// for a double EMA): formed in double and rounded once, as torch.lerp, timm and ema-pytorch do
// with a Python float weight. Rounding decay to float first loses its low bits: the weight is then
// off by 1.7e-4 relative at decay 0.9999, 1.3e-2 at 0.999999. Every kernel forms it here.
template <typename Op>
FSDP_EMA_HOST_DEVICE inline Op ema_weight(double decay) {
  return static_cast<Op>(1.0 - decay);
}

// One contiguous (ema, model) pair: ema <- lerp(ema, model, 1 - decay).
struct UpdatePair {
  void* ema;
  const void* model;
  int64_t numel;
  format::DType ema_dtype;
  format::DType model_dtype;
};

}  // namespace fsdp_ema::kernels
