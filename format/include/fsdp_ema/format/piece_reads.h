#pragma once

// The one way stored tensor bytes reach memory in a load: every read of a batch is split into
// chunks of at most kReadChunkBytes, the chunks are read (pread) on several threads, and a read
// that is hashed has its chunks fed to one streaming XXH3 state in order, so its digest is the
// format's checksum (XXH3-64 of the tensor's bytes) whatever the chunking and the threads.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>

#include "fsdp_ema/format/shard_file.h"

namespace fsdp_ema::format {

// Chunks of a read are at most this long: large enough that a pread's cost is in the copy, small
// enough that a 100 MB tensor spreads over every thread and a chunk is hashed from the cache
// soon after it was read.
inline constexpr uint64_t kReadChunkBytes = uint64_t{8} << 20;

// Bytes [offset, offset + length) of a stored tensor, copied to dst.
struct PieceRead {
  const ShardFile* file = nullptr;
  const TensorInfo* tensor = nullptr;
  uint64_t offset = 0;
  uint64_t length = 0;
  void* dst = nullptr;
  // Hash the bytes (only for a whole tensor: offset 0, length tensor->nbytes): read_pieces calls
  // on_hashed(index of this read, digest) once every chunk was read and hashed.
  bool hash = false;
};

// Runs every read, chunked, on up to `threads` threads (the caller's among them; 0: the
// machine's cores; one thread below two chunks in all). Chunks are taken in order, so the
// chunks of one read are read side by side and hashed, in order, as soon as they and all
// before them are in: by whichever thread finished the next one, while the others read on.
// Reads apply ShardFile::read's data checks. The first failure (in reads order among those
// that ran) is rethrown after all threads stopped; after one, no further chunk is started.
// on_hashed may throw (a checksum mismatch) and is called from any of the threads.
void read_pieces(std::span<const PieceRead> reads, size_t threads,
                 const std::function<void(size_t, uint64_t)>& on_hashed);

}  // namespace fsdp_ema::format
