// The read pipeline, stages 2 and 3 (read + verify, then place; read_plan.h plans): a plan's units
// are read in chunks (pread, on several threads, read-ahead advised on cold files), each chunk
// verified as soon as it is in memory (its blocks, or its piece's in-order hash), and its bytes
// placed: read straight into a host destination where the unit is direct, else copied out of the
// buffer they were read into and verified in. No byte reaches a destination from any read but
// the one that hashed it, so another process rewriting the files meanwhile can make a load fail,
// never return bytes other than the stored ones.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "fsdp_ema/format/read_plan.h"

namespace fsdp_ema::format {

// Chunks of a read are at most this long (a multiple of the block size for block-checked units):
// large enough that a pread's cost is in the copy, small enough that a 100 MB tensor spreads over
// every thread and a chunk is hashed from the cache soon after it was read.
inline constexpr uint64_t kReadChunkBytes = uint64_t{8} << 20;

struct ExecOptions {
  // Threads to read on (the caller's among them); 0: the machine's cores. One below two chunks.
  size_t threads = 0;
  // Zero-copy opt-in: the mapping of each file the plan reads (ShardFile::map; the caller's, so
  // that the bytes verified are the ones its views hold), where the units' bytes are verified
  // instead of read; destinations must all be null (nothing is placed).
  std::function<const ShardMapping&(const ShardFile&)> mapped;
};

// Runs the plan into host memory: dst[i] is destination i's first byte, or null to read and
// verify its bytes without keeping them (a check pass). A failure (a read error, a checksum or
// data-check mismatch) is rethrown after every thread stopped; no chunk starts after one, but
// destinations may then hold some of what was read, the failing chunk's bytes included where it
// was read straight into its destination (it is judged once there). Callers that must not write
// unverified bytes run a check pass first (load_into_).
void execute_reads(const ReadPlan& plan, std::span<std::byte* const> dst,
                   const ExecOptions& options = {});

// Where staged reads go (a device, through two host buffers). execute_staged calls, per step:
// acquire(b) before it reads into buffer b a second time or later (wait until the copies out of
// b are done), buffer(b, bytes) (the same memory every time), copy() once per placed range
// (asynchronous is fine: the bytes stay in the buffer until a later acquire(b) or finish()),
// then release(b) once the step's copies are issued; finish() once at the end.
class StageTarget {
 public:
  virtual ~StageTarget() = default;
  virtual std::byte* buffer(int b, uint64_t bytes) = 0;
  virtual void copy(size_t dst, uint64_t dst_offset, int b, uint64_t src_offset,
                    uint64_t bytes) = 0;
  virtual void release(int b) = 0;
  virtual void acquire(int b) = 0;
  virtual void finish() = 0;
};

// One staging buffer's size: large enough that a copy's fixed cost is small against its bytes,
// small enough that two of them stay cheap to pin and a load of a few tensors still overlaps.
inline constexpr uint64_t kStageBytes = uint64_t{64} << 20;
// Chunks start on this boundary in a staging buffer.
inline constexpr uint64_t kStageAlign = 64;

// Runs the plan through the target's two buffers: chunks in plan order fill a buffer (at
// kStageAlign boundaries; a buffer is at least one chunk), each chunk is verified in the buffer,
// then the step's placements are issued as copies while the next step is read into the other
// buffer. A block-checked chunk is verified before any of its bytes is copied; a piece with a
// whole-piece checksum only is judged when its last chunk is in (a mismatch then raises after
// its earlier chunks were copied).
void execute_staged(const ReadPlan& plan, StageTarget& target, size_t threads = 0,
                    uint64_t buffer_bytes = kStageBytes);

// The step layout execute_staged uses (for tests): chunk c of the plan goes to step
// step_of[c] at offset offset_of[c] of its buffer, of `buffer_bytes` bytes.
struct StageLayout {
  uint64_t buffer_bytes = 0;
  size_t steps = 0;
  std::vector<size_t> step_of;
  std::vector<uint64_t> offset_of;
  std::vector<uint64_t> chunk_length;
};
StageLayout stage_layout(const ReadPlan& plan, uint64_t buffer_bytes = kStageBytes);

}  // namespace fsdp_ema::format
