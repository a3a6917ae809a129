// The read pipeline (read_plan.h, read_exec.h): block checksums as written, plans that read only
// what a request needs (plus at most one block per piece edge), reads equal to the reference for
// every writer and reader world size, every thread count and every block layout (block checksums,
// whole-piece checksums only as older writers wrote, none), every read hashing what it reads
// (again on every call), staged reads through two buffers whose copies run late, and streamed
// verification across calls.
#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <thread>

#include "fsdp_ema/format/checkpoint_dir.h"
#include "fsdp_ema/format/checksum.h"
#include "fsdp_ema/format/names.h"
#include "fsdp_ema/format/read_exec.h"
#include "fsdp_ema/format/read_plan.h"
#include "tests/format/fixture_model.h"
#include "tests/format/read_helpers.h"
#include "tests/format/test_util.h"

namespace fsdp_ema::format {
namespace {

using ::testing::AllOf;
using testing::error_of;
using testing::flip_byte;
using ::testing::HasSubstr;
using testing::InPlaceWriter;
using testing::RefTensor;
using testing::TempDir;

// 3 chunks and an odd tail: 2,796,203 rows of 12 bytes.
constexpr int64_t kRows = static_cast<int64_t>((3 * kReadChunkBytes + 36) / 12);

std::vector<RefTensor> large_model() {
  return {testing::make_ref("big", DType::kF32, {kRows, 3}, 21),
          testing::make_ref("small", DType::kBF16, {5, 2}, 22),
          testing::make_ref("step", DType::kI64, {}, 23)};
}

// Small tensors with small blocks: every edge case of the block split in a few KiB.
std::vector<RefTensor> blocky_model() {
  return {testing::make_ref("w", DType::kF32, {97, 13}, 31),  // 5044 bytes: 79 blocks of 64
          testing::make_ref("b", DType::kBF16, {7}, 32),      // one block
          testing::make_ref("m", DType::kBool, {301}, 33),
          testing::make_ref("s", DType::kI64, {}, 34),
          testing::make_ref("e", DType::kF32, {0, 4}, 35)};
}

WriteOptions with_blocks(uint64_t block_bytes) {
  WriteOptions o;
  o.fsync = false;
  o.checksum_block_bytes = block_bytes;
  return o;
}

// The reference bytes of rows [begin, end) of t (all of a 0-dim tensor).
std::vector<std::byte> rows_of(const RefTensor& t, RowRange rows) {
  if (t.shape.empty()) return t.data;
  const auto rb = static_cast<size_t>(t.row_bytes());
  return {t.data.begin() + static_cast<ptrdiff_t>(rows.begin * rb),
          t.data.begin() + static_cast<ptrdiff_t>(rows.end * rb)};
}

// Rows rank r of `readers` holds of every tensor, read as one plan on `threads` threads; the
// plan's bytes read come back in `read_bytes`.
std::vector<std::vector<std::byte>> read_rank(const CheckpointDir& ckpt,
                                              const std::vector<RefTensor>& model, int64_t r,
                                              int64_t readers, size_t threads, bool verify,
                                              uint64_t* read_bytes = nullptr) {
  std::vector<ReadRequest> requests;
  std::vector<uint64_t> sizes;
  std::vector<std::vector<std::byte>> got;
  for (const RefTensor& t : model) {
    ReadRequest q;
    q.tensor = ckpt.stored(ckpt.index_of(t.name));
    q.rows = tensor_rows(t.shape, r, readers);
    q.dst = requests.size();
    requests.push_back(q);
    got.emplace_back(rows_of(t, q.rows).size(), std::byte{0xcd});
    sizes.push_back(got.back().size());
  }
  const ReadPlan plan = ckpt.plan(requests, sizes, {verify, nullptr});
  if (read_bytes != nullptr) *read_bytes = plan.read_bytes;
  std::vector<std::byte*> dst;
  for (auto& g : got) dst.push_back(g.data());
  execute_reads(plan, dst, {threads, nullptr});
  return got;
}

TEST(BlockChecksums, WrittenPerBlockForTensorsOfMoreThanOneBlock) {
  TempDir dir;
  const auto model = blocky_model();
  testing::write_checkpoint(dir.path(), model, 1, with_blocks(64));
  const ShardFile file = ShardFile::open(dir.file(shard_file_name(0, 1)));
  EXPECT_EQ(file.header().block_bytes, 64u);
  EXPECT_EQ(file.metadata().at(std::string(kMetaBlockBytes)), "64");
  const TensorInfo& w = file.tensor("w");
  ASSERT_EQ(w.block_checksums.size(), (w.nbytes + 63) / 64);
  for (size_t k = 0; k < w.block_checksums.size(); ++k) {
    const size_t n = std::min<size_t>(64, w.nbytes - 64 * k);
    EXPECT_EQ(w.block_checksums[k], checksum_of(model[0].data.data() + 64 * k, n)) << k;
  }
  EXPECT_TRUE(file.tensor("b").block_checksums.empty());  // one block: its checksum is the tensor's
  EXPECT_EQ(*file.tensor("w").checksum, checksum_of(model[0].data));
  EXPECT_EQ(file.verify_all(), 5u);
  // Writers without the extension (checksum_block_bytes 0) write neither key.
  TempDir old;
  testing::write_checkpoint(old.path(), model, 1, with_blocks(0));
  const ShardFile v1 = ShardFile::open(old.file(shard_file_name(0, 1)));
  EXPECT_EQ(v1.header().block_bytes, 0u);
  EXPECT_EQ(v1.metadata().count(std::string(kMetaBlockChecksums)), 0u);
  EXPECT_TRUE(v1.tensor("w").block_checksums.empty());
}

TEST(BlockChecksums, StreamedHasherEqualsTheBlocksOfAnySplit) {
  const auto bytes = testing::pattern_bytes(1000, 5, DType::kU8);
  for (size_t step : {1, 7, 64, 100, 1000}) {
    TensorHasher h(bytes.size(), 64);
    for (size_t pos = 0; pos < bytes.size(); pos += step) {
      h.update(bytes.data() + pos, std::min(step, bytes.size() - pos));
    }
    EXPECT_EQ(h.digest(), checksum_of(bytes));
    const auto& blocks = h.blocks();
    ASSERT_EQ(blocks.size(), 16u) << step;
    EXPECT_EQ(blocks[15], checksum_of(bytes.data() + 960, 40));
  }
}

// Every writer world size, reader world size and block layout, on 1 and 3 threads: the rows equal
// the reference, and a verified read of blocked pieces reads at most its own bytes plus one block
// per edge of every piece it touches.
TEST(ReadPipeline, ReshardedReadsEqualTheReferenceAndReadOnlyTheirBlocks) {
  const auto model = blocky_model();
  for (uint64_t block : {uint64_t{0}, uint64_t{64}, uint64_t{1024}}) {
    for (int64_t writers : {1, 2, 3}) {
      TempDir dir;
      testing::write_checkpoint(dir.path(), model, writers, with_blocks(block));
      const CheckpointDir ckpt = CheckpointDir::open(dir.path());
      for (int64_t readers : {1, 2, 3, 5}) {
        for (int64_t r = 0; r < readers; ++r) {
          for (size_t threads : {1, 3}) {
            for (bool verify : {true, false}) {
              uint64_t read = 0;
              const auto got = read_rank(ckpt, model, r, readers, threads, verify, &read);
              uint64_t own = 0, edges = 0;
              for (size_t i = 0; i < model.size(); ++i) {
                const RowRange rows = tensor_rows(model[i].shape, r, readers);
                EXPECT_EQ(got[i], rows_of(model[i], rows))
                    << model[i].name << " block " << block << " writers " << writers << " readers "
                    << readers << " rank " << r;
                own += got[i].size();
                edges += 2 * ckpt.tensors()[ckpt.index_of(model[i].name)].pieces.size();
              }
              if (verify && block == 64) EXPECT_LE(read, own + edges * 64);
              if (!verify) EXPECT_EQ(read, own);
            }
          }
        }
      }
    }
  }
}

TEST(ReadPipeline, LargePiecesReadWholeOrInPartOnEveryThreadCount) {
  const auto model = large_model();
  for (uint64_t block : {uint64_t{0}, kChecksumBlockBytes}) {
    TempDir dir;
    testing::write_checkpoint(dir.path(), model, 1, with_blocks(block));
    const CheckpointDir ckpt = CheckpointDir::open(dir.path());
    for (size_t threads : {1, 2, 8}) {
      for (int64_t readers : {1, 3}) {
        for (int64_t r = 0; r < readers; ++r) {
          const auto got = read_rank(ckpt, model, r, readers, threads, true);
          EXPECT_EQ(got[0], rows_of(model[0], tensor_rows(model[0].shape, r, readers)))
              << "block " << block << " threads " << threads << " rank " << r << "/" << readers;
        }
      }
    }
  }
}

// The damage is found by whichever read touches it, each time: no verdict is remembered.
TEST(ReadPipeline, EveryReadHashesWhatItReadsAgain) {
  for (uint64_t block : {uint64_t{0}, uint64_t{64}}) {
    TempDir dir;
    const auto model = blocky_model();
    testing::write_checkpoint(dir.path(), model, 1, with_blocks(block));
    const std::string file = dir.file(shard_file_name(0, 1));
    const CheckpointDir ckpt = CheckpointDir::open(dir.path());
    std::vector<std::byte> buf(model[0].data.size());
    ckpt.read_full("w", buf.data(), buf.size());
    EXPECT_EQ(buf, model[0].data);
    // Byte 70 of "w" (block 1 of 64-byte blocks), changed in place after the first read.
    flip_byte(file, ShardFile::open(file).tensor("w").data_offset + 70);
    EXPECT_THAT(error_of([&] { ckpt.read_full("w", buf.data(), buf.size()); }),
                AllOf(HasSubstr(file), HasSubstr("tensor \"w\""), HasSubstr("checksum mismatch")))
        << block;
    EXPECT_THAT(error_of([&] { ckpt.verify_piece("w", 0); }), HasSubstr("checksum mismatch"));
    // Rows 10.. (bytes 520..) never touch block 1: read with blocks; whole-hashed without them.
    std::vector<std::byte> tail(87 * 52);
    if (block == 64) {
      testing::read_rows(ckpt, "w", 10, 97, tail.data(), tail.size());
      EXPECT_TRUE(std::equal(tail.begin(), tail.end(), model[0].data.begin() + 520));
      EXPECT_THAT(error_of([&] { testing::read_rows(ckpt, "w", 1, 2, tail.data(), 52); }),
                  AllOf(HasSubstr("checksum mismatch in block 1"), HasSubstr("bytes 64 to 128")));
      // Rows 2..9 (bytes 104..468): their head edge block, 1, is read through a buffer and
      // checked whole, so the change at byte 70 (outside the rows) refuses the read too.
      EXPECT_THAT(error_of([&] { testing::read_rows(ckpt, "w", 2, 9, tail.data(), 7 * 52); }),
                  HasSubstr("checksum mismatch in block 1"));
    } else {
      EXPECT_THAT(
          error_of([&] { testing::read_rows(ckpt, "w", 10, 97, tail.data(), tail.size()); }),
          HasSubstr("checksum mismatch"));
    }
  }
}

// A second thread rewrites bytes of the file in place (pwrite, and through a shared mapping,
// whose writes move neither mtime nor ctime) while reads run: every read returns the stored
// bytes or raises; none returns a changed byte.
TEST(ReadPipeline, FileChangedInPlaceDuringReadsNeverYieldsChangedBytes) {
  for (uint64_t block : {uint64_t{0}, uint64_t{256}}) {
    for (bool mapped_writes : {false, true}) {
      TempDir dir;
      const std::vector<RefTensor> model = {testing::make_ref("w", DType::kF32, {4096, 16}, 41)};
      testing::write_checkpoint(dir.path(), model, 2, with_blocks(block));
      const std::string file = dir.file(shard_file_name(0, 2));
      const TensorInfo info = ShardFile::open(file).tensor("w");
      const CheckpointDir ckpt = CheckpointDir::open(dir.path());
      InPlaceWriter writer(file, info.data_offset, info.nbytes, mapped_writes);
      int wrong = 0, refused = 0, right = 0;
      for (int trial = 0; trial < 60; ++trial) {
        const int64_t readers = 1 + trial % 3;
        const int64_t r = trial % readers;
        try {
          const auto got = read_rank(ckpt, model, r, readers, 2, true);
          (got[0] == rows_of(model[0], tensor_rows(model[0].shape, r, readers)) ? right : wrong)++;
        } catch (const FormatError&) {
          ++refused;
        }
      }
      EXPECT_EQ(wrong, 0) << "block " << block << " mapped " << mapped_writes << ": " << right
                          << " right, " << refused << " refused";
    }
  }
}

TEST(ReadPipeline, CheckPassReadsAndVerifiesWithoutWriting) {
  TempDir dir;
  const auto model = blocky_model();
  testing::write_checkpoint(dir.path(), model, 2, with_blocks(64));
  const CheckpointDir ckpt = CheckpointDir::open(dir.path());
  ReadRequest q;
  q.tensor = ckpt.stored(ckpt.index_of("w"));
  q.rows = {3, 90};
  const uint64_t bytes = 87 * 52;
  const ReadPlan plan = ckpt.plan(std::span(&q, 1), std::span(&bytes, 1));
  std::byte* none = nullptr;
  execute_reads(plan, std::span(&none, 1));  // fine: nothing to write, nothing wrong
  flip_byte(dir.file(shard_file_name(1, 2)),
            ShardFile::open(dir.file(shard_file_name(1, 2))).tensor("w").data_offset);
  EXPECT_THAT(error_of([&] { execute_reads(plan, std::span(&none, 1)); }),
              HasSubstr("checksum mismatch"));
}

TEST(ReadPipeline, RequestsAreCheckedBeforeAnyRead) {
  TempDir dir;
  testing::write_checkpoint(dir.path(), large_model(), 1);
  const CheckpointDir ckpt = CheckpointDir::open(dir.path());
  std::vector<ReadRequest> requests(2);
  requests[0].tensor = ckpt.stored(ckpt.index_of("small"));
  requests[0].rows = {0, 5};
  requests[1] = requests[0];
  requests[1].rows = {0, 6};  // past its 5 rows
  requests[1].dst = 1;
  const std::vector<uint64_t> sizes = {20, 24};
  EXPECT_THAT(error_of([&] { ckpt.plan(requests, sizes); }),
              HasSubstr("rows [0, 6) are not inside its 5 rows"));
  const std::vector<uint64_t> short_dst = {19, 24};
  requests.resize(1);
  EXPECT_THAT(error_of([&] { ckpt.plan(requests, short_dst); }),
              HasSubstr("destination has 19 bytes"));
  requests[0].dst = 5;
  EXPECT_THAT(error_of([&] { ckpt.plan(requests, short_dst); }),
              HasSubstr("destination has no bytes"));
}

// Streamed verification: a piece without block checksums read in consecutive ranges, call after
// call, is read once in all (not once per call) and judged when its last byte comes in.
TEST(ReadPipeline, SessionStreamsConsecutiveRangesOfAPieceOnce) {
  TempDir dir;
  const auto model = blocky_model();
  testing::write_checkpoint(dir.path(), model, 1, with_blocks(0));
  const std::string file = dir.file(shard_file_name(0, 1));
  const CheckpointDir ckpt = CheckpointDir::open(dir.path());
  const uint64_t n = model[0].data.size() / 4;  // elements
  auto read_in_parts = [&](const std::shared_ptr<ReadSession>& session) {
    std::vector<std::byte> out(model[0].data.size());
    for (uint64_t e = 0; e < n; e += 100) {
      const uint64_t end = std::min(n, e + 100);
      ckpt.read_flat("w", e, end, out.data() + 4 * e, 4 * (end - e), true, session);
    }
    return out;
  };
  EXPECT_EQ(read_in_parts(std::make_shared<ReadSession>()), model[0].data);
  // Rows 10..15 of it: without a session, the whole piece is read (and hashed) to place them;
  // with one, the first rows of a piece are read alone and start its stream.
  const std::vector<int64_t> middle{10, 0}, first{0, 0}, shape{5, 13};
  ReadRequest q;
  q.tensor = ckpt.stored(ckpt.index_of("w"));
  q.box_offsets = middle;
  q.box_shape = shape;
  const uint64_t bytes = 5 * 52;
  EXPECT_EQ(ckpt.plan(std::span(&q, 1), std::span(&bytes, 1), {true, nullptr}).read_bytes,
            model[0].data.size());
  q.box_offsets = first;
  EXPECT_EQ(
      ckpt.plan(std::span(&q, 1), std::span(&bytes, 1), {true, std::make_shared<ReadSession>()})
          .read_bytes,
      bytes);
  // Parts out of order: read whole where the stream is elsewhere, and the session says that what
  // the stream returned before was never judged (the attack's gap: [0, 100), then [200, n), then
  // [100, 200) left the first part unverified with no error).
  {
    auto session = std::make_shared<ReadSession>();
    std::vector<std::byte> out(model[0].data.size());
    auto part = [&](uint64_t e0, uint64_t e1) {
      ckpt.read_flat("w", e0, e1, out.data() + 4 * e0, 4 * (e1 - e0), true, session);
    };
    part(0, 100);
    part(200, n);
    part(100, 200);
    EXPECT_EQ(out, model[0].data);
    EXPECT_THAT(error_of([&] { session->check_complete(); }),
                AllOf(HasSubstr("tensor \"w\""), HasSubstr("read in parts out of order")));
    auto in_order = std::make_shared<ReadSession>();
    part(0, 0);  // nothing
    for (uint64_t e = 0; e < n; e += 300) {
      ckpt.read_flat("w", e, std::min(n, e + 300), out.data() + 4 * e,
                     4 * (std::min(n, e + 300) - e), true, in_order);
    }
    in_order->check_complete();
  }
  // Damage in the last rows: the call that reads them raises.
  flip_byte(file, ShardFile::open(file).tensor("w").data_offset + model[0].data.size() - 1);
  EXPECT_THAT(error_of([&] { read_in_parts(std::make_shared<ReadSession>()); }),
              HasSubstr("checksum mismatch"));
}

// A target whose copies happen late: queued per buffer, run at acquire() of that buffer or at
// finish(); it checks the protocol's order and poisons every buffer it hands out.
class LateTarget final : public StageTarget {
 public:
  explicit LateTarget(std::vector<std::vector<std::byte>>& dst) : dst_(dst) {}
  std::byte* buffer(int b, uint64_t bytes) override {
    EXPECT_FALSE(released_[b] && !acquired_[b]) << "buffer " << b << " refilled before acquire";
    released_[b] = false;
    acquired_[b] = false;
    auto& buf = buffers_[b];
    if (buf.empty()) buf.resize(bytes);
    EXPECT_EQ(buf.size(), bytes);
    std::memset(buf.data(), 0xA5, buf.size());
    return buf.data();
  }
  void copy(size_t dst, uint64_t dst_offset, int b, uint64_t src_offset, uint64_t bytes) override {
    EXPECT_LE(src_offset + bytes, buffers_[b].size());
    EXPECT_LE(dst_offset + bytes, dst_[dst].size());
    pending_[b].push_back({dst, dst_offset, src_offset, bytes});
    copied += bytes;
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
  uint64_t copied = 0;
  int acquires = 0, finishes = 0;

 private:
  struct Copy {
    size_t dst;
    uint64_t dst_offset, src_offset, bytes;
  };
  void run(int b) {
    for (const Copy& c : pending_[b]) {
      std::memcpy(dst_[c.dst].data() + c.dst_offset, buffers_[b].data() + c.src_offset, c.bytes);
    }
    pending_[b].clear();
  }
  std::vector<std::vector<std::byte>>& dst_;
  std::vector<std::byte> buffers_[2];
  std::vector<Copy> pending_[2];
  bool released_[2] = {false, false};
  bool acquired_[2] = {false, false};
};

TEST(StagedReads, LateCopiesStillDeliverTheStoredBytes) {
  auto model = blocky_model();
  model.push_back(testing::make_ref("wide", DType::kF32, {2, 300}, 36));  // a chunk > buffer
  for (int i = 0; i < 50; ++i) {
    model.push_back(testing::make_ref("g.small" + std::to_string(100 + i), DType::kF32, {i + 1},
                                      static_cast<uint32_t>(100 + i)));
  }
  for (uint64_t block : {uint64_t{0}, uint64_t{64}}) {
    TempDir dir;
    testing::write_checkpoint(dir.path(), model, 3, with_blocks(block));
    const CheckpointDir ckpt = CheckpointDir::open(dir.path());
    for (int64_t readers : {1, 2}) {
      for (int64_t r = 0; r < readers; ++r) {
        std::vector<ReadRequest> requests;
        std::vector<uint64_t> sizes;
        std::vector<std::vector<std::byte>> got;
        for (const RefTensor& t : model) {
          ReadRequest q;
          q.tensor = ckpt.stored(ckpt.index_of(t.name));
          q.rows = tensor_rows(t.shape, r, readers);
          q.dst = requests.size();
          requests.push_back(q);
          got.emplace_back(rows_of(t, q.rows).size(), std::byte{0});
          sizes.push_back(got.back().size());
        }
        const ReadPlan plan = ckpt.plan(requests, sizes);
        LateTarget target(got);
        execute_staged(plan, target, 2, /*buffer_bytes=*/512);
        EXPECT_EQ(target.finishes, 1);
        EXPECT_GT(target.acquires, 2) << "the test should cycle the buffers several times";
        EXPECT_EQ(target.copied, plan.placed_bytes);
        for (size_t i = 0; i < model.size(); ++i) {
          EXPECT_EQ(got[i], rows_of(model[i], requests[i].rows))
              << model[i].name << " block " << block << " rank " << r;
        }
      }
    }
  }
}

TEST(StagedReads, LayoutPutsEveryChunkInsideTheBufferInOrder) {
  TempDir dir;
  const auto model = large_model();
  testing::write_checkpoint(dir.path(), model, 2);
  const CheckpointDir ckpt = CheckpointDir::open(dir.path());
  ReadRequest q;
  q.tensor = ckpt.stored(ckpt.index_of("big"));
  q.rows = {0, kRows};
  const uint64_t bytes = model[0].data.size();
  const ReadPlan plan = ckpt.plan(std::span(&q, 1), std::span(&bytes, 1));
  const StageLayout layout = stage_layout(plan, 3 * kReadChunkBytes);
  uint64_t total = 0;
  for (size_t c = 0; c < layout.step_of.size(); ++c) {
    EXPECT_EQ(layout.offset_of[c] % kStageAlign, 0u);
    EXPECT_LE(layout.offset_of[c] + layout.chunk_length[c], layout.buffer_bytes);
    if (c > 0 && layout.step_of[c] == layout.step_of[c - 1]) {
      EXPECT_GE(layout.offset_of[c], layout.offset_of[c - 1] + layout.chunk_length[c - 1]);
    } else if (c > 0) {
      EXPECT_EQ(layout.step_of[c], layout.step_of[c - 1] + 1);
    }
    total += layout.chunk_length[c];
  }
  EXPECT_EQ(total, plan.read_bytes);
  EXPECT_GE(layout.steps, 2u);
}

// A block-checked chunk that fails is never copied: the device gets verified bytes only.
TEST(StagedReads, ABadBlockIsRefusedBeforeItsBytesAreCopied) {
  TempDir dir;
  const auto model = large_model();
  testing::write_checkpoint(dir.path(), model, 1);
  const std::string file = dir.file(shard_file_name(0, 1));
  const TensorInfo big = ShardFile::open(file).tensor("big");
  flip_byte(file, big.data_offset + 2 * kReadChunkBytes + 5);  // in the third chunk
  const CheckpointDir ckpt = CheckpointDir::open(dir.path());
  ReadRequest q;
  q.tensor = ckpt.stored(ckpt.index_of("big"));
  q.rows = {0, kRows};
  const uint64_t bytes = big.nbytes;
  std::vector<std::vector<std::byte>> got(1, std::vector<std::byte>(bytes));
  LateTarget target(got);
  EXPECT_THAT(error_of([&] {
                execute_staged(ckpt.plan(std::span(&q, 1), std::span(&bytes, 1)), target, 2,
                               kReadChunkBytes);
              }),
              HasSubstr("checksum mismatch in block 64"));
  EXPECT_EQ(target.copied, 2 * kReadChunkBytes);  // the two chunks before it, nothing after
}

TEST(ReadPipeline, ColdFileReadsAheadAndStaysExact) {
  TempDir dir;
  const auto model = large_model();
  testing::write_checkpoint(dir.path(), model, 1);
  const std::string path = dir.file(shard_file_name(0, 1));
  {
    const int fd = ::open(path.c_str(), O_RDONLY);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::fsync(fd), 0);
    ASSERT_EQ(::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED), 0);
    ::close(fd);
  }
  const CheckpointDir ckpt = CheckpointDir::open(dir.path());
  const auto got = read_rank(ckpt, model, 0, 1, 2, true);
  EXPECT_EQ(got[0], model[0].data);
  const ShardFile& file = ckpt.shard_file(shard_file_name(0, 1));
  file.prefetch_if_cold(file.file_bytes() + 4096, uint64_t{1} << 40);
  file.prefetch_if_cold(0, 0);
}

}  // namespace
}  // namespace fsdp_ema::format
