// Every validation error of fsdp_ema::update_: the message names the argument, the index and both
// values, and no tensor is written when it is raised.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <fsdp_ema/ops.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include "test_helpers.h"

namespace {

using ::testing::HasSubstr;

struct BadCall {
  std::string name;
  std::function<void(std::vector<at::Tensor>& ema, at::DeviceType device)> call;
  std::string message;
};

at::TensorOptions f32(at::DeviceType d) { return at::TensorOptions(d).dtype(at::kFloat); }

std::vector<at::Tensor> valid_ema(at::DeviceType d) {
  // The first pair is always valid: validation must complete before it is written.
  return {at::full({5}, 3.0, f32(d))};
}

std::vector<BadCall> bad_calls() {
  using V = std::vector<at::Tensor>;
  return {
      {"ListLengths", [](V& ema, auto d) { fsdp_ema::update_(ema, V{}, 0.5); },
       "ema has 1 tensors but model has 0"},
      {"Numel",
       [](V& ema, auto d) {
         ema.push_back(at::zeros({4096}, f32(d)));
         fsdp_ema::update_(ema, V{at::ones({5}, f32(d)), at::ones({4095}, f32(d))}, 0.5);
       },
       "ema[1] has 4096 elements but model[1] has 4095"},
      {"Shape",
       [](V& ema, auto d) {
         ema.push_back(at::zeros({2, 6}, f32(d)));
         fsdp_ema::update_(ema, V{at::ones({5}, f32(d)), at::ones({3, 4}, f32(d))}, 0.5);
       },
       "ema[1] has shape [2, 6] but model[1] has shape [3, 4]"},
      {"EmaDtype",
       [](V& ema, auto d) {
         ema.push_back(at::zeros({3}, at::TensorOptions(d).dtype(at::kLong)));
         fsdp_ema::update_(ema, V{at::ones({5}, f32(d)), at::ones({3}, f32(d))}, 0.5);
       },
       "ema[1] has dtype Long; expected Double, Float, Half or BFloat16"},
      {"ModelDtype",
       [](V& ema, auto d) {
         fsdp_ema::update_(ema, V{at::ones({5}, at::TensorOptions(d).dtype(at::kInt))}, 0.5);
       },
       "model[0] has dtype Int"},
      {"DecayAboveOne",
       [](V& ema, auto d) { fsdp_ema::update_(ema, V{at::ones({5}, f32(d))}, 1.5); },
       "decay must be in [0, 1], got 1.5"},
      {"DecayNegative",
       [](V& ema, auto d) { fsdp_ema::update_(ema, V{at::ones({5}, f32(d))}, -0.25); },
       "decay must be in [0, 1], got -0.25"},
      {"DecayNaN",
       [](V& ema, auto d) { fsdp_ema::update_(ema, V{at::ones({5}, f32(d))}, std::nan("")); },
       "decay must be in [0, 1], got nan"},
      {"DecayTensorShape",
       [](V& ema, auto d) { fsdp_ema::update_(ema, V{at::ones({5}, f32(d))}, at::full({1}, 0.5)); },
       "decay must be a 0-dim tensor, got shape [1]"},
      {"DecayTensorDtype",
       [](V& ema, auto d) {
         fsdp_ema::update_(ema, V{at::ones({5}, f32(d))}, at::scalar_tensor(1, at::kLong));
       },
       "decay must be a floating-point tensor, got dtype Long"},
      {"DecayCpuTensorOutOfRange",
       [](V& ema, auto d) {
         fsdp_ema::update_(ema, V{at::ones({5}, f32(d))}, at::scalar_tensor(2.0));
       },
       "decay must be in [0, 1], got 2"},
      {"EmaOverlapsModel",
       [](V& ema, auto d) {
         const at::Tensor shared = at::zeros({10}, f32(d));
         ema.push_back(shared.slice(0, 0, 6));
         fsdp_ema::update_(ema, V{at::ones({5}, f32(d)), shared.slice(0, 4, 10)}, 0.5);
       },
       "ema[1] overlaps model[1] in memory"},
      {"EmaOverlapsOtherEma",
       [](V& ema, auto d) {
         const at::Tensor shared = at::zeros({10}, f32(d));
         ema.push_back(shared.slice(0, 2, 5));
         ema.push_back(shared.slice(0, 4, 7));
         fsdp_ema::update_(
             ema, V{at::ones({5}, f32(d)), at::ones({3}, f32(d)), at::ones({3}, f32(d))}, 0.5);
       },
       "overlaps ema[1] in memory"},
      {"EmaIsItsOwnModel", [](V& ema, auto d) { fsdp_ema::update_(ema, V{ema[0]}, 0.5); },
       "ema[0] overlaps model[0] in memory"},
      {"StridedEmaOverlapsModel",
       [](V& ema, auto d) {
         const at::Tensor grid = at::zeros({4, 4}, f32(d));
         ema.push_back(grid.slice(1, 0, 4, 2));
         fsdp_ema::update_(ema, V{at::ones({5}, f32(d)), grid.slice(1, 2, 4)}, 0.5);
       },
       "ema[1] overlaps model[1] in memory"},
      {"ExpandedEma",
       [](V& ema, auto d) {
         ema.push_back(at::zeros({1}, f32(d)).expand({5}));
         fsdp_ema::update_(ema, V{at::ones({5}, f32(d)), at::ones({5}, f32(d))}, 0.5);
       },
       "ema[1] has internally overlapping memory"},
  };
}

class UpdateRejects : public ::testing::TestWithParam<std::tuple<at::DeviceType, size_t>> {};

TEST_P(UpdateRejects, BadInputNamesArgumentAndWritesNothing) {
  const auto [device, index] = GetParam();
  FSDP_EMA_SKIP_WITHOUT(device);
  const BadCall bad = bad_calls().at(index);
  std::vector<at::Tensor> ema = valid_ema(device);
  std::vector<at::Tensor> before;
  try {
    bad.call(ema, device);
    FAIL() << bad.name << ": no error raised";
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what_without_backtrace(), HasSubstr(bad.message)) << bad.name;
    EXPECT_THAT(e.what_without_backtrace(), HasSubstr("fsdp_ema::update_: "));
  }
  EXPECT_TRUE(at::equal(ema[0], at::full({5}, 3.0, f32(device)))) << bad.name;
  for (size_t i = 1; i < ema.size(); ++i) {
    if (ema[i].scalar_type() == at::kFloat && ema[i].numel() > 0 && ema[i].stride(0) != 0) {
      EXPECT_EQ(ema[i].abs().sum().item<double>(), 0.0) << bad.name << " wrote ema[" << i << "]";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Table, UpdateRejects,
                         ::testing::Combine(::testing::Values(at::kCPU, at::kCUDA),
                                            ::testing::Range(size_t{0}, bad_calls().size())),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param) == at::kCPU ? "CPU_"
                                                                                  : "CUDA_") +
                                  bad_calls().at(std::get<1>(info.param)).name;
                         });

TEST(UpdateRejects, EmptyListWithDecayTensor) {
  std::vector<at::Tensor> none;
  EXPECT_THAT([&] { fsdp_ema::update_(none, none, at::scalar_tensor(0.5)); },
              ::testing::ThrowsMessage<c10::Error>(HasSubstr("ema is empty")));
}

// From C++ an undefined tensor can reach the op: the error names the op and the argument.
TEST(UpdateRejects, UndefinedTensorsAreNamed) {
  std::vector<at::Tensor> ema = {at::Tensor(), at::zeros({3})};
  std::vector<at::Tensor> model = {at::ones({3}), at::ones({3})};
  EXPECT_THAT([&] { fsdp_ema::update_(ema, model, 0.5); },
              ::testing::ThrowsMessage<c10::Error>(
                  HasSubstr("fsdp_ema::update_: ema[0] is an undefined tensor")));
  EXPECT_THAT([&] { fsdp_ema::update_(ema, model, at::scalar_tensor(0.5)); },
              ::testing::ThrowsMessage<c10::Error>(
                  HasSubstr("fsdp_ema::update_: ema[0] is an undefined tensor")));
  std::vector<at::Tensor> all_undefined = {at::Tensor()};
  EXPECT_THAT([&] { fsdp_ema::update_(all_undefined, all_undefined, 0.5); },
              ::testing::ThrowsMessage<c10::Error>(HasSubstr("fsdp_ema::update_: ema[0]")));
  std::vector<at::Tensor> fine = {at::zeros({3})};
  EXPECT_THAT([&] { fsdp_ema::update_(fine, all_undefined, 0.5); },
              ::testing::ThrowsMessage<c10::Error>(
                  HasSubstr("fsdp_ema::update_: model[0] is an undefined tensor")));
  EXPECT_EQ(ema[1].sum().item<double>(), 0.0);
}

TEST(UpdateRejects, MixedDevicesAcrossPairs) {
  if (!fsdp_ema::testing::cuda_available()) GTEST_SKIP() << "no CUDA device";
  std::vector<at::Tensor> ema = {at::zeros({3}, f32(at::kCUDA)), at::zeros({3})};
  std::vector<at::Tensor> model = {at::ones({3}, f32(at::kCUDA)), at::ones({3})};
  EXPECT_THAT(
      [&] { fsdp_ema::update_(ema, model, 0.5); },
      ::testing::ThrowsMessage<c10::Error>(HasSubstr("ema[1] is on cpu but ema[0] is on cuda:0")));
  EXPECT_EQ(ema[0].sum().item<double>(), 0.0);
}

TEST(UpdateMeta, ValidatesShapesWithoutStorage) {
  const auto meta = at::TensorOptions(at::kMeta).dtype(at::kFloat);
  std::vector<at::Tensor> ema = {at::empty({4, 4}, meta)};
  fsdp_ema::update_(ema, std::vector<at::Tensor>{at::empty({4, 4}, meta)}, 0.5);
  EXPECT_THAT(
      [&] { fsdp_ema::update_(ema, std::vector<at::Tensor>{at::empty({16}, meta)}, 0.5); },
      ::testing::ThrowsMessage<c10::Error>(HasSubstr("ema[0] has shape [4, 4] but model[0]")));
}

}  // namespace
