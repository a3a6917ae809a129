// Host side of fsdp_ema::update_ (alias ema_shard_update_): validation shared by every backend,
// and the per-backend kernels the registration tables point at.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <optional>
#include <utility>
#include <vector>

namespace fsdp_ema::ops {

using TensorList = c10::ArrayRef<at::Tensor>;

// Which checks validate_update runs. Fake/meta tensors have no storage, so no overlap check.
enum class UpdateChecks { kAll, kNoStorage };

// Checks every argument of one update call and throws (naming the argument, the index and both
// values) before anything is written. `decay_tensor` is null when decay came as a float.
void validate_update(TensorList ema, TensorList model, std::optional<double> decay,
                     const at::Tensor* decay_tensor, UpdateChecks checks);

// Reads a 0-dim CPU decay tensor (no device synchronization is involved) and range-checks it.
double cpu_decay_value(const at::Tensor& decay);

// Kernels registered for the dispatch keys; "_tensor" variants take decay as a 0-dim tensor.
//   ema:   [tensors]  fp32/fp64/bf16/fp16, updated in place
//   model: [tensors]  fp32/fp64/bf16/fp16, same shapes as ema
void update_cpu(TensorList ema, TensorList model, double decay);
void update_tensor_cpu(TensorList ema, TensorList model, const at::Tensor& decay);
void update_meta(TensorList ema, TensorList model, double decay);
void update_tensor_meta(TensorList ema, TensorList model, const at::Tensor& decay);
void update_cuda(TensorList ema, TensorList model, double decay);
void update_tensor_cuda(TensorList ema, TensorList model, const at::Tensor& decay);

}  // namespace fsdp_ema::ops

namespace fsdp_ema::ops {

// Contiguous views (or copies) of a validated call's tensors, in call order with empty pairs
// dropped. A non-contiguous EMA is updated through a contiguous copy that finish() writes back.
struct PreparedUpdate {
  std::vector<at::Tensor> ema;
  std::vector<at::Tensor> model;
  std::vector<std::pair<at::Tensor, at::Tensor>> write_back;  // (original ema, updated copy)
  void finish();
};
PreparedUpdate prepare_update(TensorList ema, TensorList model);

}  // namespace fsdp_ema::ops
