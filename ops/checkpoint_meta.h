// The checkpoint ops as the dispatcher sees them: one kernel per dispatch key (CPU, CUDA, Meta)
// around the host code of ops/checkpoint.h, so that every op with a tensor result traces under
// torch.compile(fullgraph=True) with nothing but torch.ops.load_library.
//
// Why the file-reading ops go through a private op with a `target` tensor: FakeTensorMode derives
// the device of a Meta kernel's results from its tensor inputs, and load_tensors / load_shard have
// none ("Could not find common device"). Their public schemas are therefore
// CompositeImplicitAutograd kernels that make an empty tensor on the requested device and call
// `_load_tensors` / `_load_shard` with it: the private op dispatches on that tensor (CPU, CUDA,
// Meta), and under tracing its Meta kernel reads only the index / header (dtypes and shapes, no
// tensor data).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace fsdp_ema::ops {

// A tracer's fake tensors reach Meta kernels as meta tensors that still carry the Python key;
// a real meta tensor does not. Only the latter has no data behind it.
bool is_real_meta(const at::Tensor& t);

// names, local shards, concatenated global offsets, concatenated global shapes.
using ShardContents = std::tuple<std::vector<std::string>, std::vector<at::Tensor>,
                                 std::vector<int64_t>, std::vector<int64_t>>;

// --- save_shard
// ----------------------------------------------------------------------------------- CUDA kernel:
// ops::save_shard, with the byte count on the shards' device (where FakeTensorMode puts the Meta
// kernel's result, so compiled and eager calls agree).
at::Tensor save_shard_cuda(c10::string_view directory, int64_t rank, int64_t world_size,
                           const std::vector<std::string>& names, at::TensorList shards,
                           at::IntArrayRef offsets, at::IntArrayRef global_shapes, bool fsync,
                           bool overwrite);
// Validates what it can without data and returns a 0-dim int64 meta tensor. Real meta tensors
// (not a tracer's fake ones) are refused: they have no data to save.
at::Tensor save_shard_meta(c10::string_view directory, int64_t rank, int64_t world_size,
                           const std::vector<std::string>& names, at::TensorList shards,
                           at::IntArrayRef offsets, at::IntArrayRef global_shapes, bool fsync,
                           bool overwrite);

// --- commit_checkpoint.after
// ---------------------------------------------------------------------- commit_checkpoint,
// returning the number of tensors as a 0-dim int64 tensor on the device of the first non-CPU tensor
// of `after` (CPU when there is none). `after` (the save_shard results) is not read: it makes the
// commit depend on the saves inside a graph.
at::Tensor commit_after(c10::string_view directory, int64_t world_size, at::TensorList after,
                        bool overwrite, bool fsync);
at::Tensor commit_after_meta(c10::string_view directory, int64_t world_size, at::TensorList after,
                             bool overwrite, bool fsync);

// --- load_tensors, load_tensors.after (CompositeImplicitAutograd) and _load_tensors --------------
std::vector<at::Tensor> load_tensors_entry(c10::string_view directory,
                                           const std::vector<std::string>& names, int64_t rank,
                                           int64_t world_size, bool verify,
                                           std::optional<at::Device> device, bool mmap);
std::vector<at::Tensor> load_tensors_after_entry(c10::string_view directory,
                                                 const std::vector<std::string>& names,
                                                 at::TensorList after, int64_t rank,
                                                 int64_t world_size, bool verify,
                                                 std::optional<at::Device> device, bool mmap);
// _load_tensors on CPU and CUDA: ops::load_tensors onto target's device.
//   target: an empty tensor on the device to load to (only its device is used)
//   after:  tensors on target's device the load must follow in a graph (not read)
std::vector<at::Tensor> load_tensors_to(const at::Tensor& target, at::TensorList after,
                                        c10::string_view directory,
                                        const std::vector<std::string>& names, int64_t rank,
                                        int64_t world_size, bool verify, bool mmap);
// Reads the index only: meta tensors with each result's dtype and shape.
std::vector<at::Tensor> load_tensors_meta(const at::Tensor& target, at::TensorList after,
                                          c10::string_view directory,
                                          const std::vector<std::string>& names, int64_t rank,
                                          int64_t world_size, bool verify, bool mmap);

// --- load_shard (CompositeImplicitAutograd) and _load_shard --------------------------------------
ShardContents load_shard_entry(c10::string_view path, bool verify, std::optional<at::Device> device,
                               bool mmap);
ShardContents load_shard_to(const at::Tensor& target, c10::string_view path, bool verify,
                            bool mmap);
// Reads the file's header only.
ShardContents load_shard_meta(const at::Tensor& target, c10::string_view path, bool verify,
                              bool mmap);

}  // namespace fsdp_ema::ops
