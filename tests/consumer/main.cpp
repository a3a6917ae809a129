// Links fsdp_ema through its installed CMake package and runs the op through the dispatcher.
#include <ATen/ATen.h>
#include <fsdp_ema/ops.h>

#include <cstdio>

int main() {
  std::vector<at::Tensor> ema = {at::zeros({4})};
  std::vector<at::Tensor> model = {at::ones({4})};
  fsdp_ema::update_(ema, model, 0.75);
  const double got = ema[0].sum().item<double>();
  std::printf("consumer: sum after update = %.4f\n", got);
  return got == 1.0 ? 0 : 1;  // 4 elements x 0.25
}
