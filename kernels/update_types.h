// Plain data shared by the host code in ops/ and the CPU/CUDA update kernels (no torch types, so
// the .cu files stay free of ATen headers).
#pragma once

#include <cstdint>

namespace fsdp_ema::kernels {

// Element types the update kernels handle (EMA and model sides alike).
enum class Dtype : uint8_t { kFloat32 = 0, kFloat64 = 1, kBFloat16 = 2, kFloat16 = 3 };
constexpr int kNumDtypes = 4;

inline constexpr int64_t dtype_size(Dtype d) {
  return d == Dtype::kFloat64 ? 8 : d == Dtype::kFloat32 ? 4 : 2;
}

// One contiguous (ema, model) pair: ema <- lerp(ema, model, 1 - decay).
struct UpdatePair {
  void* ema;
  const void* model;
  int64_t numel;
  Dtype ema_dtype;
  Dtype model_dtype;
};

}  // namespace fsdp_ema::kernels
