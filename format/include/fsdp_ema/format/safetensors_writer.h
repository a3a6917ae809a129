// Writing one safetensors file atomically: tensors ordered for natural alignment, data streamed
// through double-buffered chunks by a background writer thread, checksums computed on the way.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "fsdp_ema/format/dtype.h"
#include "fsdp_ema/format/shape.h"
#include "fsdp_ema/format/write_options.h"

namespace fsdp_ema::format {

// One tensor to write; exactly one data source unless nbytes is 0. Name and shape are views of the
// caller's storage, which outlives the write_safetensors_file call.
struct RawTensor {
  std::string_view name;
  DType dtype = DType::kF32;
  std::span<const int64_t> shape;
  uint64_t nbytes = 0;  // must equal numel(shape) * dtype_size(dtype); the caller checked it
  const void* host_data = nullptr;
  FillFn fill;
};

struct RawWriteResult {
  uint64_t file_bytes = 0;
  std::vector<size_t> order;        // file order: order[k] = input index of the k-th tensor
  std::vector<uint64_t> checksums;  // XXH3-64 per input index
  // Per input index: its block checksums (options.checksum_block_bytes; empty for a tensor of at
  // most one block, or with block checksums off).
  std::vector<std::vector<uint64_t>> block_checksums;
  std::vector<uint64_t> data_offset;  // absolute file offset per input index
  uint64_t header_checksum = 0;       // XXH3-64 of the file's first 8 + header-length bytes
};

// Builds the "__metadata__" entries once the tensors' checksums are known (they are called twice:
// first with zero checksums to size the header, then with the real ones; the two results must have
// the same serialized length, which holds for fixed-width checksum strings).
using MetadataFn = std::function<std::vector<std::pair<std::string, std::string>>(
    std::span<const uint64_t> checksums_by_input_index)>;

// For metadata whose only checksum-dependent bytes are fixed-width digits: once the data is
// written, patches those digits into `header` (serialized with the zero checksums; see
// serialize_safetensors_header for `value_offsets`) in place of a second serialization.
using HeaderPatchFn = std::function<void(std::string& header, std::span<const size_t> value_offsets,
                                         const RawWriteResult& result)>;

// The file order of the tensors: descending element size, then name. Every data offset is then a
// multiple of its element size with no padding (the data section starts 64-aligned).
std::vector<size_t> file_order(std::span<const RawTensor> tensors);

// Writes `path` through "<dir>/.<name>.tmp-<pid>-<random>": data, then the header, fsync, rename
// over `path`, directory fsync. On any error (including one thrown by a FillFn) the temporary is
// removed and the error rethrown; `path` is then untouched.
// `order`, when given, is file_order(tensors) already computed by the caller; with `patch`,
// `metadata` is called once (zero checksums) and the header serialized once.
RawWriteResult write_safetensors_file(const std::string& path, std::span<const RawTensor> tensors,
                                      const MetadataFn& metadata, const WriteOptions& options,
                                      std::vector<size_t> order = {},
                                      const HeaderPatchFn& patch = {});

}  // namespace fsdp_ema::format
