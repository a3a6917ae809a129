// Loads into device memory through two pinned host buffers (issue 29, step 3): while the device
// copies step k out of one buffer, the file is read into the other for step k + 1, so a load to
// the GPU costs about max(read, host-to-device) rather than their sum, with a fixed amount of
// pinned memory (twice kStageBytes) whatever the checkpoint's size.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "fsdp_ema/format/checkpoint_dir.h"
#include "fsdp_ema/format/shard_file.h"
#include "ops/reads.h"

namespace fsdp_ema::ops {

// One staging buffer's size: large enough that a copy's fixed cost is small against its bytes,
// small enough that two of them stay cheap to pin and a load of a few tensors still overlaps.
inline constexpr uint64_t kStageBytes = uint64_t{64} << 20;

// What is staged: per destination, its rows (1 for a 0-dim tensor) and the bytes of one row.
struct StageItem {
  int64_t rows = 0;
  uint64_t row_bytes = 0;
};

// Rows [row_begin, row_end) of item `item`, at `offset` in the step's buffer.
struct StageSegment {
  size_t item = 0;
  int64_t row_begin = 0;
  int64_t row_end = 0;
  uint64_t offset = 0;
};

// Steps in order; step s fills buffer s % 2 with segments [step_begin[s], step_begin[s + 1]).
// Items are cut at row boundaries only, in order, every row in exactly one segment; a segment
// starts on a kStageAlign boundary. buffer_bytes is the requested size, or one row where a row is
// larger (rounded up to kStageAlign).
struct StagePlan {
  uint64_t buffer_bytes = 0;
  std::vector<StageSegment> segments;
  std::vector<size_t> step_begin;  // one more entry than steps
  size_t steps() const { return step_begin.empty() ? 0 : step_begin.size() - 1; }
};

inline constexpr uint64_t kStageAlign = 64;

// Linear in the number of items and steps.
StagePlan plan_stages(std::span<const StageItem> items, uint64_t buffer_bytes);

// Where staged bytes go. run_staged_reads calls, per step: acquire(b) before it reads into buffer
// b a second time or later (wait until the copies out of b are done), buffer(b) (the same memory
// every time), copy() once per segment (may be asynchronous: the bytes must stay in the buffer
// until a later acquire(b) or finish()), then release(b) once the step's copies are issued;
// finish() once at the end (wait for every copy).
class StageTarget {
 public:
  virtual ~StageTarget() = default;
  virtual std::byte* buffer(int b, uint64_t bytes) = 0;
  virtual void copy(size_t item, uint64_t dst_offset, int b, uint64_t src_offset,
                    uint64_t bytes) = 0;
  virtual void release(int b) = 0;
  virtual void acquire(int b) = 0;
  virtual void finish() = 0;
};

// The pipeline over any source: for each step of plan_stages(items, buffer_bytes), `read`
// fills the buffer with the step's segments (at their offsets), then their copies are issued.
using StageReadFn = std::function<void(std::span<const StageSegment> segments, std::byte* buffer,
                                       std::span<const StageItem> items)>;
void run_stages(std::span<const StageItem> items, const StageReadFn& read, StageTarget& target,
                uint64_t buffer_bytes = kStageBytes);

// Reads plan[i]'s rows, through the target's two buffers, to item i of `target`. Pieces are
// read unhashed: with verify, the caller verifies them first (verify_pieces), so that a bad file
// is refused before the first destination byte is written.
void run_staged_reads(const format::CheckpointDir& dir, const RowsPlan& plan, StageTarget& target,
                      uint64_t buffer_bytes = kStageBytes);

// Tensors of one shard file, whole, through the target's two buffers to item i for tensors[i],
// unhashed (the caller verifies first).
void run_staged_file_reads(const format::ShardFile& file,
                           std::span<const format::TensorInfo* const> tensors, StageTarget& target,
                           uint64_t buffer_bytes = kStageBytes);

// Tensors of one shard file, whole, into dst[i] for tensors[i] (as read_rows_to_device: one
// device, contiguous, the stored dtype and shape), unhashed: the caller verifies first.
void read_file_to_device(const format::ShardFile& file,
                         std::span<const format::TensorInfo* const> tensors,
                         const std::vector<at::Tensor>& dst);

// plan[i]'s rows into dst[i]: contiguous tensors on one non-CPU device, of the stored dtype and
// of exactly those rows' shape. Copies run on the device's current stream, from pinned buffers;
// they are complete when this returns. The pieces must have been verified already (or not be).
void read_rows_to_device(const format::CheckpointDir& dir, const RowsPlan& plan,
                         const std::vector<at::Tensor>& dst);

}  // namespace fsdp_ema::ops
