// libFuzzer target: the safetensors header parser (plus our metadata interpretation and checksum
// checks) and the index parser, both on every input. Parsers must throw FormatError or succeed;
// anything else (a crash, a sanitizer report, another exception type) is a bug.
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "fsdp_ema/format/checksum.h"
#include "fsdp_ema/format/error.h"
#include "fsdp_ema/format/index.h"
#include "fsdp_ema/format/safetensors_header.h"
#include "fsdp_ema/format/shard_file.h"
#include "tests/format/header_bytes.h"

namespace fmt = fsdp_ema::format;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  try {
    fmt::ShardHeader h =
        fmt::interpret_shard_header(fmt::testing::parse_safetensors_bytes(bytes, "fuzz"), "fuzz");
    // Invariants of an accepted header: every tensor inside the input, byte counts consistent.
    for (const fmt::TensorInfo& t : h.tensors) {
      if (t.data_offset > size || t.nbytes > size - t.data_offset) __builtin_trap();
      if (fmt::nbytes(t.shape, t.dtype) != t.nbytes) __builtin_trap();
      if (t.checksum) (void)fmt::checksum_of(bytes.subspan(t.data_offset, t.nbytes));
    }
  } catch (const fmt::FormatError&) {
  }
  std::optional<fmt::CheckpointIndex> index;
  try {
    index = fmt::parse_index_json(std::string_view(reinterpret_cast<const char*>(data), size),
                                  "fuzz.index.json");
  } catch (const fmt::FormatError&) {
  }
  if (index) {
    // An accepted index round-trips through its own serialization: the text parses (a
    // FormatError here is a bug, not a rejected input) and serializes to the same text, so
    // nothing (a name, a shape, a checksum, the metadata) is lost or changed on the way.
    const std::string text = fmt::index_to_json(*index);
    std::optional<fmt::CheckpointIndex> again;
    try {
      again = fmt::parse_index_json(text, "again");
    } catch (const fmt::FormatError&) {
      __builtin_trap();
    }
    if (fmt::index_to_json(*again) != text) __builtin_trap();
  }
  return 0;
}
