// The bookkeeping of loads to device memory through two staging buffers (ops/staged_reads.h), on
// the CPU: the plan covers every row once, in order, inside the buffer; and a target whose copies
// run late (as a device's do: only when the buffer is waited for or at the end) still receives
// the stored bytes, which fails if the pipeline refills a buffer before waiting for its copies.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "checkpoint_fixture.h"
#include "fsdp_ema/format/checkpoint_dir.h"
#include "fsdp_ema/format/names.h"
#include "fsdp_ema/format/rows.h"
#include "fsdp_ema/format/shard_file.h"
#include "ops/staged_reads.h"

namespace {

using fsdp_ema::ops::kStageAlign;
using fsdp_ema::ops::plan_stages;
using fsdp_ema::ops::StageItem;
using fsdp_ema::ops::StagePlan;

// Every row of every item in exactly one segment, items and rows in order, every segment inside
// the buffer, aligned, and the segments of a step disjoint.
void check_plan(const std::vector<StageItem>& items, const StagePlan& plan) {
  std::vector<int64_t> next(items.size(), 0);
  size_t last_item = 0;
  for (size_t s = 0; s < plan.steps(); ++s) {
    ASSERT_LT(plan.step_begin[s], plan.step_begin[s + 1]) << "step " << s << " is empty";
    uint64_t end_of_previous = 0;
    for (size_t k = plan.step_begin[s]; k < plan.step_begin[s + 1]; ++k) {
      const auto& seg = plan.segments[k];
      ASSERT_GE(seg.item, last_item);
      last_item = seg.item;
      ASSERT_EQ(seg.row_begin, next[seg.item]) << "item " << seg.item;
      ASSERT_LT(seg.row_begin, seg.row_end);
      next[seg.item] = seg.row_end;
      ASSERT_EQ(seg.offset % kStageAlign, 0u);
      ASSERT_GE(seg.offset, end_of_previous);
      end_of_previous = seg.offset + static_cast<uint64_t>(seg.row_end - seg.row_begin) *
                                         items[seg.item].row_bytes;
      ASSERT_LE(end_of_previous, plan.buffer_bytes);
    }
  }
  ASSERT_EQ(plan.step_begin.empty() ? 0u : plan.step_begin.back(), plan.segments.size());
  for (size_t i = 0; i < items.size(); ++i) {
    const int64_t expected = items[i].row_bytes == 0 ? 0 : std::max<int64_t>(items[i].rows, 0);
    EXPECT_EQ(next[i], expected) << "item " << i;
  }
}

TEST(StagedReads, PlanCoversEveryRowOnceInsideTheBuffer) {
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<StageItem> items(1 + rng() % 40);
    for (auto& item : items) {
      item.rows = static_cast<int64_t>(rng() % 50);
      item.row_bytes = rng() % 4 == 0 ? 2 : 1 + rng() % 3000;
    }
    const uint64_t buffer = 1 + rng() % 20000;
    const StagePlan plan = plan_stages(items, buffer);
    check_plan(items, plan);
    // The buffer is what was asked for unless one row is larger.
    uint64_t widest = 0;
    for (const auto& item : items) {
      if (item.rows > 0) widest = std::max(widest, item.row_bytes);
    }
    EXPECT_EQ(plan.buffer_bytes,
              (std::max(std::max<uint64_t>(buffer, 1), widest) + kStageAlign - 1) / kStageAlign *
                  kStageAlign);
  }
}

TEST(StagedReads, PlanFillsBuffersAndSplitsLargeItems) {
  // 10 rows of 1000 bytes through 4096-byte buffers: 4 rows a step (4000 bytes), three steps.
  const std::vector<StageItem> items = {{10, 1000}};
  const StagePlan plan = plan_stages(items, 4096);
  check_plan(items, plan);
  ASSERT_EQ(plan.steps(), 3u);
  EXPECT_EQ(plan.segments[0].row_end, 4);
  EXPECT_EQ(plan.segments[2].row_end, 10);
  // Many small items share a step: 1000 items of 64 bytes in 64 KiB buffers is one step.
  const std::vector<StageItem> small(1000, StageItem{1, 64});
  EXPECT_EQ(plan_stages(small, 64 << 10).steps(), 1u);
  // Nothing to copy, no steps.
  EXPECT_EQ(plan_stages(std::vector<StageItem>{{0, 8}, {3, 0}}, 64).steps(), 0u);
  // 200,000 items plan in linear time (a quadratic plan would not finish in the test's limit).
  const std::vector<StageItem> many(200000, StageItem{3, 100});
  const StagePlan big = plan_stages(many, 1 << 20);
  check_plan(many, big);
}

// A target whose copies happen late: queued per buffer, run at acquire() of that buffer or at
// finish(). It also checks the protocol's order.
class LateTarget final : public fsdp_ema::ops::StageTarget {
 public:
  explicit LateTarget(std::vector<at::Tensor> dst) : dst_(std::move(dst)) {}
  std::byte* buffer(int b, uint64_t bytes) override {
    EXPECT_FALSE(pending_[b].size() && !released_[b]) << "buffer " << b << " reused mid-step";
    EXPECT_FALSE(released_[b] && !acquired_[b]) << "buffer " << b << " refilled before acquire";
    released_[b] = false;
    acquired_[b] = false;
    auto& buf = buffers_[b];
    if (buf.empty()) buf.resize(bytes);
    EXPECT_EQ(buf.size(), bytes);
    // Poison: a segment copied from a byte the read did not write shows up.
    std::memset(buf.data(), 0xA5, buf.size());
    return buf.data();
  }
  void copy(size_t item, uint64_t dst_offset, int b, uint64_t src_offset, uint64_t bytes) override {
    pending_[b].push_back({item, dst_offset, src_offset, bytes});
    ++copies;
  }
  void release(int b) override { released_[b] = true; }
  void acquire(int b) override {
    EXPECT_TRUE(released_[b]);
    run(b);
    acquired_[b] = true;
    ++acquires;
  }
  void finish() override {
    run(0);
    run(1);
    ++finishes;
  }
  int copies = 0, acquires = 0, finishes = 0;

 private:
  struct Copy {
    size_t item;
    uint64_t dst_offset, src_offset, bytes;
  };
  void run(int b) {
    for (const Copy& c : pending_[b]) {
      std::memcpy(static_cast<std::byte*>(dst_[c.item].data_ptr()) + c.dst_offset,
                  buffers_[b].data() + c.src_offset, c.bytes);
    }
    pending_[b].clear();
  }
  std::vector<at::Tensor> dst_;
  std::vector<std::byte> buffers_[2];
  std::vector<Copy> pending_[2];
  bool released_[2] = {false, false};
  bool acquired_[2] = {false, false};
};

TEST(StagedReads, LateCopiesStillDeliverTheStoredBytes) {
  const auto dir = fsdp_ema::testing::scratch_dir("late");
  std::map<std::string, at::Tensor> tensors = {
      {"a.big", at::randn({300, 70})},  // spans several buffers
      {"b.rows", at::arange(1000, at::kInt).reshape({100, 10})},
      {"c.scalar", at::scalar_tensor(2.5, at::kDouble)},
      {"d.empty", at::empty({0, 4})},
      {"e.bf16", at::randn({37, 3}).to(at::kBFloat16)},
      {"f.wide", at::randn({2, 3000})},  // a row larger than a buffer
  };
  for (int i = 0; i < 50; ++i) tensors["g.small" + std::to_string(100 + i)] = at::randn({i + 1});
  const int64_t world = 3;
  fsdp_ema::testing::write_sharded(dir, tensors, world);
  const auto ckpt = fsdp_ema::format::CheckpointDir::open(dir.string());
  for (int64_t rank = 0; rank < world; ++rank) {
    fsdp_ema::ops::RowsPlan plan;
    std::vector<at::Tensor> dst, expected;
    for (const auto& [name, t] : tensors) {
      const auto* info = &ckpt.tensor(name);
      plan.emplace_back(info, fsdp_ema::format::tensor_rows(info->shape, rank, world));
      const at::Tensor want = t.dim() == 0 ? t
                              : fsdp_ema::format::tensor_rows(info->shape, rank, world).size() == 0
                                  ? t.slice(0, 0, 0)
                                  : t.slice(0, plan.back().second.begin, plan.back().second.end);
      expected.push_back(want);
      dst.push_back(at::full_like(want, 0));
    }
    LateTarget target(dst);
    fsdp_ema::ops::run_staged_reads(ckpt, plan, target, /*buffer_bytes=*/4096);
    EXPECT_EQ(target.finishes, 1);
    EXPECT_GT(target.acquires, 2) << "the test should cycle the buffers several times";
    for (size_t i = 0; i < dst.size(); ++i) {
      EXPECT_TRUE(at::equal(dst[i], expected[i])) << plan[i].first->name << " rank " << rank;
    }
  }
  std::filesystem::remove_all(dir);
}

TEST(StagedReads, LateCopiesOfAShardFileDeliverItsBytes) {
  const auto dir = fsdp_ema::testing::scratch_dir("file");
  std::map<std::string, at::Tensor> tensors = {
      {"a.big", at::randn({300, 70})},
      {"b.scalar", at::scalar_tensor(-1.5, at::kDouble)},
      {"c.empty", at::empty({0, 4})},
      {"d.wide", at::randn({2, 3000})},
  };
  fsdp_ema::testing::write_sharded(dir, tensors, 1);
  const auto file =
      fsdp_ema::format::ShardFile::open((dir / fsdp_ema::format::shard_file_name(0, 1)).string());
  std::vector<const fsdp_ema::format::TensorInfo*> infos;
  std::vector<at::Tensor> dst, expected;
  for (const auto& [name, t] : tensors) {
    infos.push_back(&file.tensor(name));
    dst.push_back(at::full_like(t, 0));
    expected.push_back(t);
  }
  LateTarget target(dst);
  fsdp_ema::ops::run_staged_file_reads(file, infos, target, /*buffer_bytes=*/4096);
  EXPECT_GT(target.acquires, 2);
  for (size_t i = 0; i < dst.size(); ++i) {
    EXPECT_TRUE(at::equal(dst[i], expected[i])) << infos[i]->name;
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
