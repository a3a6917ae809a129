// Shared helpers for the C++ tests.
#pragma once

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <string>
#include <vector>

namespace fsdp_ema::testing {

inline at::ScalarType opmath(at::ScalarType t) {
  return t == at::kDouble ? at::kDouble : at::kFloat;
}

// Independent reference: at::lerp in the EMA's math precision.
inline at::Tensor reference_update(const at::Tensor& ema, const at::Tensor& model, double decay) {
  const auto om = opmath(ema.scalar_type());
  return at::lerp(ema.to(om), model.to(om), 1.0 - decay).to(ema.scalar_type());
}

// Equal up to one rounding step of the EMA dtype (fused vs unfused multiply-add).
inline void expect_ema_close(const at::Tensor& actual, const at::Tensor& expected) {
  ASSERT_EQ(actual.sizes(), expected.sizes());
  if (actual.numel() == 0) return;
  const double eps = actual.scalar_type() == at::kDouble  ? 2.3e-16
                     : actual.scalar_type() == at::kFloat ? 1.2e-7
                     : actual.scalar_type() == at::kHalf  ? 9.8e-4
                                                          : 7.9e-3;
  const auto a = actual.cpu().to(at::kDouble);
  const auto b = expected.cpu().to(at::kDouble);
  const double err = ((a - b).abs() - (b.abs() * eps + eps)).max().item<double>();
  EXPECT_LE(err, 0.0) << "max |actual - expected| exceeds one rounding step";
}

inline bool cuda_available() { return torch::cuda::is_available(); }

#define FSDP_EMA_SKIP_WITHOUT(device)                                  \
  if ((device) == at::kCUDA && !::fsdp_ema::testing::cuda_available()) \
  GTEST_SKIP() << "no CUDA device"

}  // namespace fsdp_ema::testing
