// Writing one rank's shard file: the local shards of many tensors, with the metadata that lets
// DCP's HuggingFace reader, safetensors and our reader all use it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "fsdp_ema/format/dtype.h"
#include "fsdp_ema/format/names.h"  // shard_file_name
#include "fsdp_ema/format/shape.h"
#include "fsdp_ema/format/tensor_info.h"
#include "fsdp_ema/format/write_options.h"

namespace fsdp_ema::format {

// One local shard: the box [offsets, offsets + shape) of a tensor of global_shape.
// shape, offsets and global_shape have one entry per dimension (all empty for a 0-dim tensor).
// Data: host_data (numel * element size bytes, row-major, valid for the whole call) or fill;
// neither when the shard has no element.
struct TensorToWrite {
  std::string name;
  DType dtype = DType::kF32;
  Shape shape;
  Shape offsets;
  Shape global_shape;
  const void* host_data = nullptr;
  FillFn fill;

  // A whole (unsharded) tensor from host memory: offsets 0, global shape = shape.
  static TensorToWrite full(std::string name, DType dtype, Shape shape, const void* data);
};

// Writes one shard file at `path` atomically (temporary in the same directory, fsync, rename,
// directory fsync; see write_safetensors_file) and returns its size in bytes. Inputs are validated
// first: names unique, non-empty, valid UTF-8 and not "__metadata__"; one size, offset and global
// size per dimension, none negative; offsets + shape <= global shape; byte counts
// overflow-checked; rank in [0, world_size); exactly one data source for a non-empty shard.
// When `written` is not null it receives the file's description (for build_index).
uint64_t write_shard_file(const std::string& path, std::vector<TensorToWrite> tensors,
                          const WriteOptions& options = {}, ShardDescription* written = nullptr);

}  // namespace fsdp_ema::format
