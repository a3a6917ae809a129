// A TorchScript module scripted in Python (tests/make_scripted_module.py) that calls
// torch.ops.fsdp_ema.update_, loaded and run from C++ with torch::jit::load.
#include <gtest/gtest.h>
#include <torch/script.h>

#include <cstdlib>

#include "test_helpers.h"

namespace {

TEST(TorchScript, ScriptedModuleCallsUpdateFromCpp) {
  const char* path = std::getenv("FSDP_EMA_SCRIPTED_MODULE");
  ASSERT_NE(path, nullptr) << "run through ctest: the make_scripted_module fixture writes it";
  torch::jit::Module module = torch::jit::load(path);
  const at::Tensor weight = at::arange(6, at::kFloat).reshape({2, 3});
  // forward(decay tensor 0.5, decay float 0.5): ema = weight * (1 - 0.5 * 0.5) from zeros.
  const at::Tensor out = module.forward({at::scalar_tensor(0.5), 0.5}).toTensor();
  EXPECT_TRUE(at::allclose(out, weight * 0.75));
  // The module's own buffer was updated in place.
  for (const auto& buffer : module.named_buffers()) {
    if (buffer.name == "ema") EXPECT_TRUE(at::equal(buffer.value, out));
  }
}

}  // namespace
