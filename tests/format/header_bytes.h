// A whole safetensors file held in memory, parsed as ShardFile::open parses one on disk
// (parse_header_length, then parse_safetensors_header): for the fuzz target and the header tests.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "fsdp_ema/format/safetensors_header.h"

namespace fsdp_ema::format::testing {

inline SafetensorsHeader parse_safetensors_bytes(std::span<const std::byte> file,
                                                 const std::string& name) {
  const uint64_t n =
      parse_header_length(file.first(std::min<size_t>(8, file.size())), file.size(), name);
  std::string_view json(reinterpret_cast<const char*>(file.data()) + 8, n);
  return parse_safetensors_header(json, file.size(), name);
}

}  // namespace fsdp_ema::format::testing
