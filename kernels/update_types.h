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
#define FSDP_EMA_FORCE_INLINE __forceinline__
#else
#define FSDP_EMA_HOST_DEVICE
#define FSDP_EMA_FORCE_INLINE inline __attribute__((always_inline))
#endif

// The weight w = 1 - decay of ema <- lerp(ema, model, w) in the math type Op (float, or double
// for a double EMA): formed in double and rounded once, as torch.lerp, timm and ema-pytorch do
// with a Python float weight. Rounding decay to float first loses its low bits: the weight is then
// off by 1.7e-4 relative at decay 0.9999, 1.3e-2 at 0.999999. Every kernel forms it here.
template <typename Op>
FSDP_EMA_HOST_DEVICE inline Op ema_weight(double decay) {
  return static_cast<Op>(1.0 - decay);
}

// torch.lerp's two-sided form of ema <- lerp(ema, model, w), exact at both ends (decay 0 copies
// the model, decay 1 keeps the EMA): from the EMA's side while the weight is below one half, from
// the model's side above. Every update kernel computes through these two, with V its math type:
// the CPU's scalar loop (float or double), its vector loop (at::vec's float vectors) and the CUDA
// kernel (float or double).
template <typename Op>
FSDP_EMA_HOST_DEVICE FSDP_EMA_FORCE_INLINE bool lerp_from_ema(Op w) {
  return w < Op(0.5);
}

// a * b + c in math type V: as written for scalars (nvcc fuses it into one FMA, the host compiler
// as its -ffp-contract says), one fused multiply-add for at::vec vectors (update_cpu_impl.h
// specializes it).
template <typename V>
struct LerpMath {
  FSDP_EMA_HOST_DEVICE static FSDP_EMA_FORCE_INLINE V mul_add(V a, V b, V c) { return a * b + c; }
};

// w: the weight; one_minus_w: 1 - w in V; from_ema: lerp_from_ema(w).
template <typename V>
FSDP_EMA_HOST_DEVICE FSDP_EMA_FORCE_INLINE V lerp_two_sided(V e, V m, V w, V one_minus_w,
                                                            bool from_ema) {
  return from_ema ? LerpMath<V>::mul_add(w, m - e, e) : m - (m - e) * one_minus_w;
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
