// Host side of fsdp_ema::update_multi_: K EMA lists of the same model tensors, one read of the
// model. Validation is update_'s (ops/update.h), over every profile.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

namespace fsdp_ema::ops {

// Kernels registered for the dispatch keys; "_tensor" variants take decays as 0-dim tensors.
//   ema:    [K * N tensors] fp32/fp64/bf16/fp16, profile-major: ema[k * N + i] is EMA k of
//           model[i], updated in place with decays[k]
//   model:  [N tensors]     fp32/fp64/bf16/fp16, same shapes as their EMAs
//   decays: [K]             floats in [0, 1], or 0-dim floating tensors (CPU or the device)
void update_multi_cpu(at::TensorList ema, at::TensorList model, c10::ArrayRef<double> decays);
void update_multi_tensor_cpu(at::TensorList ema, at::TensorList model, at::TensorList decays);
void update_multi_meta(at::TensorList ema, at::TensorList model, c10::ArrayRef<double> decays);
void update_multi_tensor_meta(at::TensorList ema, at::TensorList model, at::TensorList decays);
void update_multi_cuda(at::TensorList ema, at::TensorList model, c10::ArrayRef<double> decays);
void update_multi_tensor_cuda(at::TensorList ema, at::TensorList model, at::TensorList decays);

}  // namespace fsdp_ema::ops
