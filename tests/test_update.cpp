// Numerics of fsdp_ema::update_ through the dispatcher, for every dtype pair and size case.
#include <ATen/ATen.h>
#include <fsdp_ema/ops.h>
#include <gtest/gtest.h>

#include <tuple>
#include <vector>

#include "test_helpers.h"

namespace {

using fsdp_ema::testing::expect_ema_close;
using fsdp_ema::testing::reference_update;

const std::vector<std::vector<int64_t>> kSizes = {{},     {0},    {1},    {7},
                                                  {3, 5}, {1023}, {4097}, {70001}};

struct Case {
  std::vector<at::Tensor> ema;
  std::vector<at::Tensor> model;
};

Case make_case(at::ScalarType ema_dtype, at::ScalarType model_dtype, at::DeviceType device,
               const std::vector<std::vector<int64_t>>& sizes = kSizes) {
  at::manual_seed(0);
  Case c;
  for (const auto& s : sizes) {
    c.ema.push_back(at::randn(s).to(device, ema_dtype));
    c.model.push_back(at::randn(s).to(device, model_dtype));
  }
  return c;
}

std::vector<at::Tensor> clones(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> out;
  for (const auto& t : tensors) out.push_back(t.clone());
  return out;
}

// Bit-equal tensor by tensor.
void expect_all_equal(const std::vector<at::Tensor>& actual,
                      const std::vector<at::Tensor>& expected) {
  ASSERT_EQ(actual.size(), expected.size());
  for (size_t i = 0; i < actual.size(); ++i) EXPECT_TRUE(at::equal(actual[i], expected[i])) << i;
}

// update_ with `decay`, each tensor checked against the at::lerp reference of its values before.
void expect_update_matches_lerp(std::vector<at::Tensor>& ema, const std::vector<at::Tensor>& model,
                                double decay) {
  std::vector<at::Tensor> expected;
  for (size_t i = 0; i < ema.size(); ++i) {
    expected.push_back(reference_update(ema[i], model[i], decay));
  }
  fsdp_ema::update_(ema, model, decay);
  for (size_t i = 0; i < ema.size(); ++i) expect_ema_close(ema[i], expected[i]);
}

class UpdateDtypes
    : public ::testing::TestWithParam<std::tuple<at::DeviceType, at::ScalarType, at::ScalarType>> {
};

TEST_P(UpdateDtypes, MatchesLerpReference) {
  const auto [device, ema_dtype, model_dtype] = GetParam();
  FSDP_EMA_SKIP_WITHOUT(device);
  Case c = make_case(ema_dtype, model_dtype, device);
  expect_update_matches_lerp(c.ema, c.model, 0.9);
}

const std::vector<at::ScalarType> kDtypes = {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf};

INSTANTIATE_TEST_SUITE_P(AllPairs, UpdateDtypes,
                         ::testing::Combine(::testing::Values(at::kCPU, at::kCUDA),
                                            ::testing::ValuesIn(kDtypes),
                                            ::testing::ValuesIn(kDtypes)));

class UpdateDevices : public ::testing::TestWithParam<at::DeviceType> {};

TEST_P(UpdateDevices, DecayTensorMatchesDecayFloat) {
  const at::DeviceType device = GetParam();
  FSDP_EMA_SKIP_WITHOUT(device);
  Case a = make_case(at::kFloat, at::kBFloat16, device);
  std::vector<at::Tensor> b = clones(a.ema);
  fsdp_ema::update_(a.ema, a.model, 0.75);
  fsdp_ema::update_(b, a.model, at::scalar_tensor(0.75, at::TensorOptions(device)));
  expect_all_equal(a.ema, b);
}

TEST_P(UpdateDevices, AliasRunsTheSameKernel) {
  const at::DeviceType device = GetParam();
  FSDP_EMA_SKIP_WITHOUT(device);
  Case a = make_case(at::kHalf, at::kFloat, device);
  std::vector<at::Tensor> b = clones(a.ema);
  fsdp_ema::update_(a.ema, a.model, 0.6);
  fsdp_ema::ema_shard_update_(b, a.model, 0.6);
  expect_all_equal(a.ema, b);
}

TEST_P(UpdateDevices, DecayZeroCopiesAndDecayOneKeepsExactly) {
  const at::DeviceType device = GetParam();
  FSDP_EMA_SKIP_WITHOUT(device);
  Case c = make_case(at::kFloat, at::kFloat, device);
  std::vector<at::Tensor> before = clones(c.ema);
  fsdp_ema::update_(c.ema, c.model, 1.0);
  expect_all_equal(c.ema, before);
  fsdp_ema::update_(c.ema, c.model, 0.0);
  expect_all_equal(c.ema, c.model);
}

TEST_P(UpdateDevices, MisalignedAndStridedTensors) {
  const at::DeviceType device = GetParam();
  FSDP_EMA_SKIP_WITHOUT(device);
  at::manual_seed(3);
  const at::Tensor base_e = at::randn({4099}).to(device);
  const at::Tensor base_m = at::randn({4099}).to(device, at::kBFloat16);
  const at::Tensor grid_e = at::randn({64, 48}).to(device);
  const at::Tensor grid_m = at::randn({48, 64}).to(device, at::kHalf);
  std::vector<at::Tensor> ema = {base_e.slice(0, 1, 4098), grid_e.slice(1, 0, 48, 3)};
  std::vector<at::Tensor> model = {base_m.slice(0, 2, 4099), grid_m.t().slice(1, 0, 16)};
  const at::Tensor untouched = grid_e.clone();
  expect_update_matches_lerp(ema, model, 0.8);
  // Columns outside the strided view keep their values.
  EXPECT_TRUE(at::equal(grid_e.slice(1, 1, 48, 3), untouched.slice(1, 1, 48, 3)));
  EXPECT_TRUE(at::equal(grid_e.slice(1, 2, 48, 3), untouched.slice(1, 2, 48, 3)));
}

TEST_P(UpdateDevices, HundredsOfTensorsInOneCall) {
  const at::DeviceType device = GetParam();
  FSDP_EMA_SKIP_WITHOUT(device);
  std::vector<std::vector<int64_t>> sizes;
  for (int i = 0; i < 500; ++i) sizes.push_back({(i * 7919) % 5000});
  Case c = make_case(at::kFloat, at::kBFloat16, device, sizes);
  expect_update_matches_lerp(c.ema, c.model, 0.99);
}

TEST_P(UpdateDevices, DecayTensorOnTheCpuForDeviceTensors) {
  const at::DeviceType device = GetParam();
  FSDP_EMA_SKIP_WITHOUT(device);
  Case c = make_case(at::kBFloat16, at::kFloat, device, {{1000}});
  const at::Tensor expected = reference_update(c.ema[0], c.model[0], 0.3);
  fsdp_ema::update_(c.ema, c.model, at::scalar_tensor(0.3, at::kDouble));
  expect_ema_close(c.ema[0], expected);
}

INSTANTIATE_TEST_SUITE_P(Devices, UpdateDevices, ::testing::Values(at::kCPU, at::kCUDA),
                         [](const auto& info) {
                           return info.param == at::kCPU ? std::string("CPU") : std::string("CUDA");
                         });

TEST(UpdateBuild, ReportsWhetherCudaKernelsAreBuilt) {
  // A CUDA machine must run a CUDA build: otherwise the CUDA cases above would silently fall to
  // "no kernel registered" errors rather than skips.
  if (fsdp_ema::testing::cuda_available()) EXPECT_TRUE(fsdp_ema::built_with_cuda());
}

}  // namespace
