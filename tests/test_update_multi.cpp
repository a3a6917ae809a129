// fsdp_ema::update_multi_ through the dispatcher: K profiles equal K update_ calls bit for bit,
// and a bad call names the argument and writes nothing.
#include <ATen/ATen.h>
#include <fsdp_ema/ops.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "test_helpers.h"

namespace {

using fsdp_ema::testing::expect_ema_close;
using fsdp_ema::testing::reference_update;

class UpdateMulti : public ::testing::TestWithParam<at::DeviceType> {};

TEST_P(UpdateMulti, EqualsSeparateUpdatesBitForBit) {
  const at::DeviceType device = GetParam();
  FSDP_EMA_SKIP_WITHOUT(device);
  at::manual_seed(0);
  const std::vector<std::vector<int64_t>> sizes = {{}, {0}, {7}, {3, 5}, {70001}};
  const std::vector<at::ScalarType> ema_dtypes = {at::kFloat, at::kBFloat16, at::kDouble};
  const std::vector<double> decays = {0.9, 0.5, 0.999};
  std::vector<at::Tensor> model, flat, expected;
  for (const auto& s : sizes) model.push_back(at::randn(s).to(device, at::kBFloat16));
  for (size_t k = 0; k < decays.size(); ++k) {
    std::vector<at::Tensor> list;
    for (const auto& s : sizes) list.push_back(at::randn(s).to(device, ema_dtypes[k]));
    for (const auto& t : list) flat.push_back(t.clone());
    fsdp_ema::update_(list, model, decays[k]);
    expected.insert(expected.end(), list.begin(), list.end());
  }
  std::vector<at::Tensor> flat_t, original;
  for (const auto& t : flat) flat_t.push_back(t.clone());
  for (const auto& t : flat) original.push_back(t.clone());
  fsdp_ema::update_multi_(flat, model, decays);
  std::vector<at::Tensor> d;
  for (const double v : decays)
    d.push_back(at::scalar_tensor(v, at::TensorOptions(device).dtype(at::kDouble)));
  fsdp_ema::update_multi_(flat_t, model, d);
  for (size_t j = 0; j < flat.size(); ++j) {
    EXPECT_TRUE(at::equal(flat[j], expected[j])) << "ema[" << j << "]";
    EXPECT_TRUE(at::equal(flat_t[j], expected[j])) << "ema[" << j << "] (tensor decays)";
  }
  // And independently of update_: at::lerp in the EMA's math precision.
  for (size_t j = 0; j < flat.size(); ++j) {
    expect_ema_close(
        flat[j], reference_update(original[j], model[j % sizes.size()], decays[j / sizes.size()]));
  }
}

TEST_P(UpdateMulti, BadDecayNamesTheIndexAndWritesNothing) {
  const at::DeviceType device = GetParam();
  FSDP_EMA_SKIP_WITHOUT(device);
  std::vector<at::Tensor> model = {at::ones({4}, at::TensorOptions(device))};
  std::vector<at::Tensor> ema = {at::zeros({4}, at::TensorOptions(device)),
                                 at::zeros({4}, at::TensorOptions(device))};
  try {
    fsdp_ema::update_multi_(ema, model, std::vector<double>{0.5, -0.25});
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("decays[1] must be in [0, 1], got -0.25"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(ema[0].abs().sum().item<double>(), 0.0);
}

INSTANTIATE_TEST_SUITE_P(Devices, UpdateMulti, ::testing::Values(at::kCPU, at::kCUDA));

}  // namespace
