// The safetensors container: 8-byte little-endian header length N, N bytes of JSON, then the data
// section. Parsing with every limit the format needs, and serializing our (aligned) headers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "fsdp_ema/format/dtype.h"
#include "fsdp_ema/format/shape.h"

namespace fsdp_ema::format {

// Header length limit of the reference implementation (safetensors' MAX_HEADER_SIZE).
inline constexpr uint64_t kMaxHeaderBytes = 100'000'000;
// Our writers pad the JSON with spaces so that 8 + N, the data start, is a multiple of this.
inline constexpr uint64_t kHeaderAlignment = 64;

// One tensor entry of a header. begin/end are relative to the data section.
struct HeaderTensor {
  std::string name;
  DType dtype = DType::kF32;
  Shape shape;
  uint64_t begin = 0;
  uint64_t end = 0;
};

// One tensor entry to serialize: views of the caller's name and shape.
struct HeaderEntry {
  std::string_view name;
  DType dtype = DType::kF32;
  std::span<const int64_t> shape;
  uint64_t begin = 0;
  uint64_t end = 0;
};

struct SafetensorsHeader {
  uint64_t header_bytes = 0;          // N
  uint64_t data_start = 0;            // 8 + N: file offset of the data section
  uint64_t file_bytes = 0;            // whole file, = data_start + the data section's size
  std::vector<HeaderTensor> tensors;  // sorted by begin (file order)
  bool has_metadata = false;          // a "__metadata__" entry was present
  std::map<std::string, std::string> metadata;  // its entries (all strings)
};

// Decodes the 8-byte little-endian header length and checks it against the limit and the file
// size. `file` names the file in error messages.
uint64_t parse_header_length(std::span<const std::byte> first8, uint64_t file_bytes,
                             const std::string& file);

// Parses and validates the JSON header of a file of `file_bytes` bytes whose header length is
// header_json.size(): JSON object, no duplicate keys, every entry with a known dtype, a shape of
// non-negative sizes and data_offsets [begin, end] with end - begin = numel * dtype size
// (overflow-checked), entries contiguous from 0 with no gap or overlap and ending exactly at the
// end of the file, "__metadata__" an object of strings. Unknown fields of an entry are ignored (as
// the reference implementation does).
SafetensorsHeader parse_safetensors_header(std::string_view header_json, uint64_t file_bytes,
                                           const std::string& file);

// The 8-byte length plus the JSON header for tensors already in file order (contiguous offsets),
// padded with trailing spaces so that its size is a multiple of `alignment`. The metadata entries
// keep the given order; pass include_metadata = false to write no "__metadata__" at all.
// With `value_offsets`, it receives the offset in the result of each metadata value's first
// character (just after its opening quote), in the metadata's order.
std::string serialize_safetensors_header(
    std::span<const HeaderEntry> tensors,
    const std::vector<std::pair<std::string, std::string>>& metadata, bool include_metadata = true,
    uint64_t alignment = kHeaderAlignment, std::vector<size_t>* value_offsets = nullptr);

}  // namespace fsdp_ema::format
