// Public C++ API of the fsdp_ema operators. Each wrapper calls through the PyTorch dispatcher, so
// the kernel is picked by the tensors' device (CPU or CUDA), exactly as torch.ops.fsdp_ema.* does
// from Python. Linking fsdp_ema::fsdp_ema also registers the operators for TorchScript modules.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <string>
#include <vector>

namespace fsdp_ema {

// ema[i] <- ema[i] + (1 - decay) * (model[i] - ema[i]) for every pair, in one fused call
// (computed in torch.lerp's two-sided form, so decay 0 copies and decay 1 keeps exactly).
//   ema:   [tensors] fp32/fp64/bf16/fp16, updated in place, no memory shared with any other tensor
//   model: [tensors] fp32/fp64/bf16/fp16, model[i].sizes() == ema[i].sizes()
//   decay: in [0, 1]
// Math runs in fp32, or fp64 for an fp64 EMA. Everything is validated before anything is written.
void update_(c10::ArrayRef<at::Tensor> ema, c10::ArrayRef<at::Tensor> model, double decay);

// Same, with decay as a 0-dim floating tensor on the CPU or on the tensors' device. A device
// tensor is read by the kernel (no host synchronization, CUDA-graph safe); its range is therefore
// not checked. A CPU tensor is read on the host and range-checked.
void update_(c10::ArrayRef<at::Tensor> ema, c10::ArrayRef<at::Tensor> model,
             const at::Tensor& decay);

// Aliases under the seed recipe's name.
void ema_shard_update_(c10::ArrayRef<at::Tensor> ema, c10::ArrayRef<at::Tensor> model,
                       double decay);
void ema_shard_update_(c10::ArrayRef<at::Tensor> ema, c10::ArrayRef<at::Tensor> model,
                       const at::Tensor& decay);

// K EMA lists of the same model tensors from one read of the model (4 + 8K bytes per fp32
// element instead of 12K for K update_ calls), each list getting exactly what
// update_(ema_k, model, decays[k]) gives it.
//   ema:    [K * N tensors] profile-major: ema[k * N + i] is EMA k of model[i]
//   model:  [N tensors]
//   decays: [K] in [0, 1] (floats), or 0-dim floating tensors on the CPU or the tensors' device
void update_multi_(c10::ArrayRef<at::Tensor> ema, c10::ArrayRef<at::Tensor> model,
                   c10::ArrayRef<double> decays);
void update_multi_(c10::ArrayRef<at::Tensor> ema, c10::ArrayRef<at::Tensor> model,
                   c10::ArrayRef<at::Tensor> decays);

// Whether this build of the library carries CUDA kernels.
bool built_with_cuda();

}  // namespace fsdp_ema

namespace fsdp_ema {

// Writes one rank's local shards to <directory>/shard-<rank>-of-<world_size>.safetensors
// atomically; returns the file's size in bytes. offsets / global_shapes hold one entry per
// dimension of each shard, concatenated in shard order. A committed directory is refused unless
// overwrite (the old checkpoint then stays loadable until commit_checkpoint(overwrite=true)).
// See the op reference in README.md.
int64_t save_shard(const std::string& directory, int64_t rank, int64_t world_size,
                   const std::vector<std::string>& names, c10::ArrayRef<at::Tensor> shards,
                   c10::ArrayRef<int64_t> offsets, c10::ArrayRef<int64_t> global_shapes,
                   bool fsync = true, bool overwrite = false);

// Writes <directory>/fsdp_ema.index.json (the commit marker) once all world_size shard files
// exist; refuses a committed directory unless overwrite. Returns the number of tensors.
int64_t commit_checkpoint(const std::string& directory, int64_t world_size, bool overwrite = false,
                          bool fsync = true);

}  // namespace fsdp_ema
