// fsdp_ema::update_ (alias ema_shard_update_) and update_multi_ (update_ with K EMA lists of the
// same model tensors: one read of the model): the validation every kernel shares (the Meta ones
// too), and the CPU and Meta kernels; the CUDA ones are in update_cuda.cpp.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <optional>
#include <string>
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

// Reads a 0-dim CPU decay tensor (no device synchronization is involved) and range-checks it;
// errors start with `op` and name the argument `name`.
double cpu_decay_value(const at::Tensor& decay, const char* op, const std::string& name);

// update_multi_: `ema` holds K lists of model.size() tensors, profile-major (ema[k * N + i]
// pairs with model[i] and decays[k]). Either `decays` (floats) or `decay_tensors` (0-dim) is
// empty. The same checks as validate_update, over every profile, before anything is written.
void validate_update_multi(TensorList ema, TensorList model, c10::ArrayRef<double> decays,
                           TensorList decay_tensors, UpdateChecks checks);

// The pieces both validations are made of; error messages start with `op`.
// Per pair: defined, dtypes, devices, shapes, no internal overlap (ema[j] pairs with
// model[j % model.size()]).
void validate_pairs(const char* op, TensorList ema, TensorList model, UpdateChecks checks);
void validate_decay(const char* op, const std::string& name, double decay);
void validate_decay_tensor(const char* op, const std::string& name, const at::Tensor& decay,
                           c10::Device device, UpdateChecks checks);

// Kernels registered for the dispatch keys; "_tensor" variants take decay as a 0-dim tensor.
//   ema:   [tensors]  fp32/fp64/bf16/fp16, updated in place
//   model: [tensors]  fp32/fp64/bf16/fp16, same shapes as ema
void update_cpu(TensorList ema, TensorList model, double decay);
void update_tensor_cpu(TensorList ema, TensorList model, const at::Tensor& decay);
void update_meta(TensorList ema, TensorList model, double decay);
void update_tensor_meta(TensorList ema, TensorList model, const at::Tensor& decay);
void update_cuda(TensorList ema, TensorList model, double decay);
void update_tensor_cuda(TensorList ema, TensorList model, const at::Tensor& decay);

// update_multi_: K EMA lists of the same model tensors, one read of the model.
// Its kernels; "_tensor" variants take decays as 0-dim tensors.
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
// The float overloads with nothing to dispatch on (empty lists) or tensors on a device without a
// kernel: validate, so that the error names the bad argument ("ema is empty"), then refuse. The
// Tensor overloads always have a tensor to dispatch on.
void update_no_kernel(at::TensorList ema, at::TensorList model, double decay);
void update_multi_no_kernel(at::TensorList ema, at::TensorList model, c10::ArrayRef<double> decays);

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
// The same for update_multi_'s K profile-major lists: p.model holds the N' non-empty model
// tensors (each made contiguous once), p.ema the K * N' EMA tensors, profile-major again.
PreparedUpdate prepare_update_multi(TensorList ema, TensorList model);

}  // namespace fsdp_ema::ops
