// Public C++ API of the fsdp_ema operators. Each wrapper calls through the PyTorch dispatcher, so
// the kernel is picked by the tensors' device (CPU or CUDA), exactly as torch.ops.fsdp_ema.* does
// from Python. Linking fsdp_ema::fsdp_ema also registers the operators for TorchScript modules.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/intrusive_ptr.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace c10d {
class ProcessGroup;  // <torch/csrc/distributed/c10d/ProcessGroup.hpp>
}  // namespace c10d

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
// See the op reference in docs/OPERATORS.md.
int64_t save_shard(const std::string& directory, int64_t rank, int64_t world_size,
                   const std::vector<std::string>& names, c10::ArrayRef<at::Tensor> shards,
                   c10::ArrayRef<int64_t> offsets, c10::ArrayRef<int64_t> global_shapes,
                   bool fsync = true, bool overwrite = false);

// Writes <directory>/fsdp_ema.index.json (the commit marker) once all world_size shard files
// exist; refuses a committed directory unless overwrite. `metadata` (key, value, key, value, ...)
// goes into the index's "metadata" object. Returns the number of tensors.
int64_t commit_checkpoint(const std::string& directory, int64_t world_size, bool overwrite = false,
                          bool fsync = true, const std::vector<std::string>& metadata = {});

}  // namespace fsdp_ema

namespace fsdp_ema {

// Commit for compiled graphs: the number of tensors as a 0-dim int64 tensor on the device of
// `after` (the save_shard results it follows; not read).
at::Tensor commit_checkpoint(const std::string& directory, int64_t world_size,
                             c10::ArrayRef<at::Tensor> after, bool overwrite = false,
                             bool fsync = true);

// Tensors of a committed checkpoint (ours, or a DCP HuggingFace directory): whole (world_size 1)
// or the dim-0 rows torch.chunk(tensor, world_size)[rank] holds, on `device` (CPU by default;
// kMeta gives dtypes and shapes from the index without reading data). mmap: zero-copy CPU views
// of the files (opt-in; see CheckpointReader).
std::vector<at::Tensor> load_tensors(const std::string& directory,
                                     const std::vector<std::string>& names, int64_t rank = 0,
                                     int64_t world_size = 1, bool verify = true,
                                     std::optional<at::Device> device = std::nullopt,
                                     bool mmap = false);

// One shard file as save_shard wrote it.
struct ShardFileContents {
  std::vector<std::string> names;
  std::vector<at::Tensor> shards;      // local shards
  std::vector<int64_t> offsets;        // global offset of each shard, concatenated over dims
  std::vector<int64_t> global_shapes;  // global shape of each tensor, concatenated over dims
};
ShardFileContents load_shard(const std::string& path, bool verify = true,
                             std::optional<at::Device> device = std::nullopt, bool mmap = false);

// JSON: {"layout", "world_size", "tensors": {name: {"dtype", "shape"}}, "metadata"}.
std::string checkpoint_info(const std::string& directory);

// The dim-0 rows [begin, end) torch.chunk(tensor, world_size)[rank] holds of a tensor of `rows`
// rows (empty past the last chunk): FSDP2's Shard(0), what gather_shards and the loads split by.
std::pair<int64_t, int64_t> chunk_rows(int64_t rows, int64_t rank, int64_t world_size);

// Dim-0 shards (torch.chunk rows, possibly empty) of N tensors -> the N full tensors on every
// rank of a process group, with one all-gather (gloo on CPU, NCCL on CUDA).
//   shards: [N] this rank's rows of each tensor, all on one device
//   rows:   [N] each tensor's global dim-0 size
// Returns [rows[i], *shards[i].shape[1:]] for each i. Every rank must make the same call.
std::vector<at::Tensor> gather_shards(c10::ArrayRef<at::Tensor> shards, c10::ArrayRef<int64_t> rows,
                                      const std::string& group_name);
// Same, on a group made in C++ (c10d::ProcessGroupGloo / ProcessGroupNCCL over a TCPStore, say):
// registers it under a name first (register_process_group), then calls the op by that name.
std::vector<at::Tensor> gather_shards(c10::ArrayRef<at::Tensor> shards, c10::ArrayRef<int64_t> rows,
                                      const c10::intrusive_ptr<c10d::ProcessGroup>& group);

// The name under which the op (and torch.ops.fsdp_ema.gather_shards, c10d's functional
// collectives) resolves `group`: its own group name, registered with c10d if it was not yet;
// else (no name, or one another group holds) a fresh "fsdp_ema_group_<n>" set on the group and
// registered.
std::string register_process_group(const c10::intrusive_ptr<c10d::ProcessGroup>& group);

}  // namespace fsdp_ema
