// Many independent byte copies in one go (the pack/unpack of gather_shards): one parallel region
// on the CPU, one kernel on CUDA (plus a fill launch per 1,000 segments for its device table).
#pragma once

#include <cstdint>

namespace fsdp_ema::kernels {

struct CopySegment {
  const void* src;
  void* dst;
  int64_t nbytes;
  int64_t first_block;  // CUDA only: index of the segment's first block (set by the host code)
};

// Bytes one CUDA block copies.
constexpr int64_t kCopyBlockBytes = 1 << 16;

void batched_copy_cpu(const CopySegment* segments, int64_t num_segments);

}  // namespace fsdp_ema::kernels
