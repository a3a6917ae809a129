#include "ops/staged_reads.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <optional>

#include "fsdp_ema/format/piece_reads.h"

namespace fsdp_ema::ops {

namespace {

uint64_t align_up(uint64_t n) { return (n + kStageAlign - 1) / kStageAlign * kStageAlign; }

uint64_t segment_bytes(const StageSegment& seg, std::span<const StageItem> items) {
  return static_cast<uint64_t>(seg.row_end - seg.row_begin) * items[seg.item].row_bytes;
}

}  // namespace

StagePlan plan_stages(std::span<const StageItem> items, uint64_t buffer_bytes) {
  StagePlan plan;
  plan.buffer_bytes = align_up(std::max<uint64_t>(buffer_bytes, 1));
  for (const StageItem& item : items) {
    if (item.rows > 0) plan.buffer_bytes = std::max(plan.buffer_bytes, align_up(item.row_bytes));
  }
  plan.segments.reserve(items.size());
  uint64_t used = plan.buffer_bytes;  // no step open yet
  for (size_t i = 0; i < items.size(); ++i) {
    const StageItem& item = items[i];
    if (item.rows <= 0 || item.row_bytes == 0) continue;  // nothing to copy
    for (int64_t row = 0; row < item.rows;) {
      uint64_t offset = align_up(used);
      if (offset >= plan.buffer_bytes || plan.buffer_bytes - offset < item.row_bytes) {
        plan.step_begin.push_back(plan.segments.size());  // a new step, its buffer empty
        offset = 0;
      }
      const int64_t fit = static_cast<int64_t>((plan.buffer_bytes - offset) / item.row_bytes);
      const int64_t end = row + std::min(fit, item.rows - row);
      plan.segments.push_back({i, row, end, offset});
      used = offset + static_cast<uint64_t>(end - row) * item.row_bytes;
      row = end;
    }
  }
  plan.step_begin.push_back(plan.segments.size());
  if (plan.step_begin.size() == 1) plan.step_begin.clear();  // no steps at all
  return plan;
}

void run_stages(std::span<const StageItem> items, const StageReadFn& read, StageTarget& target,
                uint64_t buffer_bytes) {
  const StagePlan stages = plan_stages(items, buffer_bytes);
  for (size_t s = 0; s < stages.steps(); ++s) {
    const int b = static_cast<int>(s % 2);
    if (s >= 2) target.acquire(b);
    const auto segments =
        std::span(stages.segments)
            .subspan(stages.step_begin[s], stages.step_begin[s + 1] - stages.step_begin[s]);
    read(segments, target.buffer(b, stages.buffer_bytes), items);
    for (const StageSegment& seg : segments) {
      target.copy(seg.item, static_cast<uint64_t>(seg.row_begin) * items[seg.item].row_bytes, b,
                  seg.offset, segment_bytes(seg, items));
    }
    target.release(b);
  }
  target.finish();
}

namespace {

// A stored tensor as rows: dim 0's rows of the rest's bytes (one row for a 0-dim tensor).
StageItem item_of(const format::Shape& shape, format::DType dtype, int64_t rows) {
  uint64_t row_bytes = format::dtype_size(dtype);
  for (size_t d = 1; d < shape.size(); ++d) row_bytes *= static_cast<uint64_t>(shape[d]);
  return {shape.empty() ? 1 : rows, row_bytes};
}

}  // namespace

void run_staged_reads(const format::CheckpointDir& dir, const RowsPlan& plan, StageTarget& target,
                      uint64_t buffer_bytes) {
  std::vector<StageItem> items;
  items.reserve(plan.size());
  for (const auto& [tensor, rows] : plan) {
    items.push_back(item_of(tensor->shape, tensor->dtype, rows.size()));
  }
  std::vector<format::CheckpointDir::RowsRead> reads;
  auto read = [&](std::span<const StageSegment> segments, std::byte* buffer,
                  std::span<const StageItem> all) {
    reads.clear();
    for (const StageSegment& seg : segments) {
      const auto& [tensor, rows] = plan[seg.item];
      const format::RowRange range =
          tensor->shape.empty()
              ? rows
              : format::RowRange{rows.begin + seg.row_begin, rows.begin + seg.row_end};
      reads.push_back({tensor->name, range, buffer + seg.offset, segment_bytes(seg, all)});
    }
    // Verified already where asked (the caller's verify_pieces): read the bytes only.
    dir.read_rows_batch(reads, /*verify=*/false, read_threads());
  };
  run_stages(items, read, target, buffer_bytes);
}

namespace {

// Copies from two pinned buffers on the device's current stream; an event per buffer says when
// its copies are done.
class DeviceTarget final : public StageTarget {
 public:
  DeviceTarget(const std::vector<at::Tensor>& dst, at::Device device)
      : device_(device),
        stream_(c10::impl::VirtualGuardImpl(device.type()).getStream(device)),
        events_{c10::Event(device.type()), c10::Event(device.type())} {
    bytes_.reserve(dst.size());
    for (const at::Tensor& t : dst) bytes_.push_back(t.reshape({-1}).view(at::kByte));
  }
  ~DeviceTarget() override {
    // On an error between steps: the copies still in flight read the buffers; wait for them.
    for (auto& e : events_) {
      if (e.was_marked_for_recording()) e.synchronize();
    }
  }
  std::byte* buffer(int b, uint64_t bytes) override {
    at::Tensor& buf = buffers_[static_cast<size_t>(b)];
    if (!buf.defined()) {
      buf = at::empty({static_cast<int64_t>(bytes)},
                      at::TensorOptions().dtype(at::kByte).pinned_memory(true));
    }
    return static_cast<std::byte*>(buf.data_ptr());
  }
  void copy(size_t item, uint64_t dst_offset, int b, uint64_t src_offset, uint64_t bytes) override {
    const auto n = static_cast<int64_t>(bytes);
    bytes_[item]
        .narrow(0, static_cast<int64_t>(dst_offset), n)
        .copy_(buffers_[static_cast<size_t>(b)].narrow(0, static_cast<int64_t>(src_offset), n),
               /*non_blocking=*/true);
  }
  void release(int b) override { events_[static_cast<size_t>(b)].record(stream_); }
  void acquire(int b) override { events_[static_cast<size_t>(b)].synchronize(); }
  void finish() override {
    for (auto& e : events_) {
      if (e.was_marked_for_recording()) e.synchronize();
    }
  }

 private:
  at::Device device_;
  c10::Stream stream_;
  std::array<c10::Event, 2> events_;
  std::array<at::Tensor, 2> buffers_;
  std::vector<at::Tensor> bytes_;
};

// Runs `stage(target)` with a DeviceTarget over dst (one non-CPU device, contiguous).
template <typename F>
void stage_to_device(const std::vector<at::Tensor>& dst, F&& stage) {
  if (dst.empty()) return;
  const at::Device device = dst.front().device();
  for (const at::Tensor& t : dst) {
    TORCH_INTERNAL_ASSERT(t.device() == device && t.is_contiguous() && !device.is_cpu());
  }
  const c10::DeviceGuard guard(device);
  DeviceTarget target(dst, device);
  stage(target);
}

}  // namespace

void read_rows_to_device(const format::CheckpointDir& dir, const RowsPlan& plan,
                         const std::vector<at::Tensor>& dst) {
  stage_to_device(dst, [&](StageTarget& target) { run_staged_reads(dir, plan, target); });
}

void run_staged_file_reads(const format::ShardFile& file,
                           std::span<const format::TensorInfo* const> tensors, StageTarget& target,
                           uint64_t buffer_bytes) {
  std::vector<StageItem> items;
  items.reserve(tensors.size());
  for (const format::TensorInfo* t : tensors) {
    items.push_back(item_of(t->shape, t->dtype, t->shape.empty() ? 1 : t->shape[0]));
  }
  std::vector<format::PieceRead> reads;
  auto read = [&](std::span<const StageSegment> segments, std::byte* buffer,
                  std::span<const StageItem> all) {
    reads.clear();
    for (const StageSegment& seg : segments) {
      const uint64_t offset = static_cast<uint64_t>(seg.row_begin) * all[seg.item].row_bytes;
      reads.push_back({&file, tensors[seg.item], offset, segment_bytes(seg, all),
                       buffer + seg.offset, /*hash=*/false});
    }
    format::read_pieces(reads, read_threads(), [](size_t, uint64_t) {});
  };
  run_stages(items, read, target, buffer_bytes);
}

void read_file_to_device(const format::ShardFile& file,
                         std::span<const format::TensorInfo* const> tensors,
                         const std::vector<at::Tensor>& dst) {
  stage_to_device(dst, [&](StageTarget& target) { run_staged_file_reads(file, tensors, target); });
}

}  // namespace fsdp_ema::ops
