// Options shared by every file writer of the format (shard files, consolidated export).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <string>

#include "fsdp_ema/format/checksum.h"

namespace fsdp_ema::format {

// Fills `length` bytes of a tensor's data, starting at byte `offset` of that tensor, into `dst`.
// Called on the writing thread, in increasing offset order, with chunks of at most
// WriteOptions::chunk_bytes; `offset` and `dst` are multiples of the element size, and `dst`
// stays valid only for the call. While the callback fills one buffer, a background thread writes
// the previous one to the file.
using FillFn = std::function<void(uint64_t offset, uint64_t length, void* dst)>;

struct WriteOptions {
  // fsync the file before the rename and the directory after it. Off only for benchmarks and
  // scratch data: without it a crash can leave a renamed but empty or partial file.
  bool fsync = true;
  // Size of each staging buffer (and the largest chunk a FillFn gets). A multiple of 64.
  uint64_t chunk_bytes = uint64_t{32} << 20;
  // Number of staging buffers (>= 2): one filled while the others are written.
  size_t num_buffers = 2;
  // Optional allocator for the staging buffers, e.g. pinned host memory so that a FillFn can
  // copy device memory straight into them. Default: page-aligned operator new.
  std::function<void*(size_t bytes)> allocate_buffer;
  std::function<void(void* buffer)> free_buffer;

  // Block checksums (checksum.h): every tensor larger than this many bytes is also hashed per
  // block of it, so that a read of part of it verifies only what it reads. 0: none (what writers
  // before the extension wrote; readers then verify a partial read by hashing the whole piece).
  // A power of two in [kMinChecksumBlockBytes, kMaxChecksumBlockBytes] otherwise.
  uint64_t checksum_block_bytes = kChecksumBlockBytes;

  // Shard files only: the writing rank and the number of ranks (stored in the metadata).
  int64_t rank = 0;
  int64_t world_size = 1;
  // Shard files only: extra "__metadata__" entries. Keys must not be "format", "DCP_VERSION",
  // "DCP_SHARDING_INFO" or start with "fsdp_ema_".
  std::map<std::string, std::string> metadata;
};

}  // namespace fsdp_ema::format
