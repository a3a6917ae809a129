// What a shard file says about each tensor it holds, and about itself.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "fsdp_ema/format/dtype.h"
#include "fsdp_ema/format/shape.h"

namespace fsdp_ema::format {

// One tensor (a local shard: a box of the global tensor) in one shard file.
struct TensorInfo {
  std::string name;
  DType dtype = DType::kF32;
  Shape shape;         // local shape, as in the safetensors entry
  Shape offsets;       // global offset of element [0, ..., 0]; zeros when the file has none
  Shape global_shape;  // ours when stored ("fsdp_ema_global_shapes"), else offsets + shape
  std::optional<uint64_t> checksum;  // XXH3-64 of the bytes when stored ("fsdp_ema_checksums")
  uint64_t data_offset = 0;          // absolute byte offset in the file (naturally aligned in ours)
  uint64_t nbytes = 0;               // numel(shape) * dtype_size(dtype)
  // XXH3-64 of each block of the bytes ("fsdp_ema_block_checksums", checksum.h): stored for a
  // tensor of more than one block of its file's block size; empty otherwise.
  std::vector<uint64_t> block_checksums;
};

// One written (or read) shard file: everything the index needs from it.
struct ShardDescription {
  std::string file;                 // plain file name, e.g. "shard-00001-of-00004.safetensors"
  int64_t rank = 0;                 // the writing rank
  int64_t world_size = 1;           // number of writing ranks
  uint64_t file_bytes = 0;          // size of the file
  std::vector<TensorInfo> tensors;  // in file order
};

}  // namespace fsdp_ema::format
