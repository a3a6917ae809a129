#include "ops/common/tracing.h"

#include <ATen/ops/empty.h>

namespace fsdp_ema::ops {

bool is_real_meta(const at::Tensor& t) {
  return t.is_meta() && !t.key_set().has(c10::DispatchKey::Python);
}

at::Device result_device(at::TensorList tensors) {
  for (const at::Tensor& t : tensors) {
    if (!t.device().is_cpu()) return t.device();
  }
  return at::kCPU;
}

at::Tensor target_on(std::optional<at::Device> device) {
  return at::empty({0}, at::TensorOptions().dtype(at::kByte).device(device.value_or(at::kCPU)));
}

at::TensorOptions meta_options(at::ScalarType dtype) {
  return at::TensorOptions().device(at::kMeta).dtype(dtype);
}

}  // namespace fsdp_ema::ops
