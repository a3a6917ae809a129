// fsdp_ema::save_shard: one rank's local shards into one safetensors file of a checkpoint
// directory, atomically (format::save_shard_to_dir: the directory created if missing, the shared
// lock, what an overwrite writes). Its CPU (and no-tensor), CUDA and Meta kernels, and the one
// validation they share.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/string_view.h>

#include <string>
#include <vector>

namespace fsdp_ema::ops {

// Writes one rank's local shards to <directory>/shard-<rank>-of-<world_size>.safetensors (with
// overwrite, into a committed directory: under a name its index does not reference, see
// fsdp_ema/format/layout.h; without, a committed directory is refused).
//   names:         [N]    fully qualified names
//   shards:        [N]    local shards (any device; CUDA staged through pinned memory)
//   offsets:       [sum of shards[i].dim()]  global offset of each shard, concatenated
//   global_shapes: [sum of shards[i].dim()]  global shape of each tensor, concatenated
// Returns the file's size in bytes (0-dim int64 CPU tensor).
at::Tensor save_shard(c10::string_view directory, int64_t rank, int64_t world_size,
                      const std::vector<std::string>& names, at::TensorList shards,
                      at::IntArrayRef offsets, at::IntArrayRef global_shapes, bool fsync,
                      bool overwrite);
// CUDA: the same, with the byte count on the shards' device (where FakeTensorMode puts the Meta
// kernel's result, so compiled and eager calls agree).
at::Tensor save_shard_cuda(c10::string_view directory, int64_t rank, int64_t world_size,
                           const std::vector<std::string>& names, at::TensorList shards,
                           at::IntArrayRef offsets, at::IntArrayRef global_shapes, bool fsync,
                           bool overwrite);
// Meta: the validation that needs no data; a 0-dim int64 meta tensor. Real meta tensors (not a
// tracer's fake ones) are refused: they have no data to save.
at::Tensor save_shard_meta(c10::string_view directory, int64_t rank, int64_t world_size,
                           const std::vector<std::string>& names, at::TensorList shards,
                           at::IntArrayRef offsets, at::IntArrayRef global_shapes, bool fsync,
                           bool overwrite);

}  // namespace fsdp_ema::ops
