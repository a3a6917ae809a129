// read_pieces and CheckpointDir::read_rows_batch: reads split into chunks on several threads,
// each whole piece hashed in order, so the digest is the format's (XXH3-64 of the bytes).
#include "fsdp_ema/format/piece_reads.h"

#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include "fsdp_ema/format/checkpoint_dir.h"
#include "fsdp_ema/format/checksum.h"
#include "fsdp_ema/format/names.h"
#include "tests/format/fixture_model.h"
#include "tests/format/test_util.h"

namespace fsdp_ema::format {
namespace {

using ::testing::AllOf;
using testing::error_of;
using testing::flip_byte;
using ::testing::HasSubstr;
using testing::RefTensor;
using testing::TempDir;

// 3 chunks and an odd tail: 2,796,203 rows of 12 bytes.
constexpr int64_t kRows = static_cast<int64_t>((3 * kReadChunkBytes + 36) / 12);

std::vector<RefTensor> large_model() {
  return {testing::make_ref("big", DType::kF32, {kRows, 3}, 21),
          testing::make_ref("small", DType::kBF16, {5, 2}, 22),
          testing::make_ref("step", DType::kI64, {}, 23)};
}

TEST(ReadPieces, ChunkedHashIsTheChecksumOfTheBytesForEveryThreadCount) {
  TempDir dir;
  const auto model = large_model();
  testing::write_checkpoint(dir.path(), model, 1);
  const ShardFile file = ShardFile::open(dir.file(shard_file_name(0, 1)));
  const TensorInfo& big = file.tensor("big");
  ASSERT_GT(big.nbytes, 3 * kReadChunkBytes);
  for (size_t threads : {1, 2, 3, 8}) {
    std::vector<std::byte> got(big.nbytes);
    const PieceRead read{&file, &big, 0, big.nbytes, got.data(), /*hash=*/true};
    uint64_t digest = 0;
    int calls = 0;
    read_pieces(std::span(&read, 1), threads, [&](size_t i, uint64_t d) {
      EXPECT_EQ(i, 0u);
      digest = d;
      ++calls;
    });
    EXPECT_EQ(calls, 1) << threads << " threads";
    EXPECT_EQ(got, model[0].data) << threads << " threads";
    EXPECT_EQ(digest, checksum_of(model[0].data)) << threads << " threads";
    EXPECT_EQ(digest, *big.checksum) << threads << " threads";
  }
}

TEST(ReadPieces, PartialReadsOverChunkBoundariesCopyExactly) {
  TempDir dir;
  const auto model = large_model();
  testing::write_checkpoint(dir.path(), model, 1);
  const ShardFile file = ShardFile::open(dir.file(shard_file_name(0, 1)));
  const TensorInfo& big = file.tensor("big");
  const uint64_t offset = kReadChunkBytes - 5, length = 2 * kReadChunkBytes + 11;
  std::vector<std::byte> got(length);
  const PieceRead read{&file, &big, offset, length, got.data(), /*hash=*/false};
  read_pieces(std::span(&read, 1), 4, [](size_t, uint64_t) { FAIL() << "nothing is hashed"; });
  EXPECT_TRUE(std::equal(got.begin(), got.end(), model[0].data.begin() + offset));
}

// A file dropped from the page cache: the reads advise the kernel ahead of them (the cold branch
// of ShardFile::prefetch_if_cold) and still copy and hash exactly; a hint past the end or of an
// absurd length raises nothing.
TEST(ReadPieces, ColdFileReadsAheadAndStaysExact) {
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
  const ShardFile file = ShardFile::open(path);
  const TensorInfo& big = file.tensor("big");
  std::vector<std::byte> got(big.nbytes);
  const PieceRead read{&file, &big, 0, big.nbytes, got.data(), /*hash=*/true};
  uint64_t digest = 0;
  read_pieces(std::span(&read, 1), 2, [&](size_t, uint64_t d) { digest = d; });
  EXPECT_EQ(got, model[0].data);
  EXPECT_EQ(digest, *big.checksum);
  file.prefetch_if_cold(file.file_bytes() + 4096, uint64_t{1} << 40);
  file.prefetch_if_cold(0, 0);
}

TEST(ReadRowsBatch, WholeAndPartialReadsOfEveryWriterWorldSizeEqualTheReference) {
  const auto model = large_model();
  for (int64_t writers : {1, 2, 3}) {
    TempDir dir;
    testing::write_checkpoint(dir.path(), model, writers);
    for (int64_t readers : {1, 2}) {
      const CheckpointDir ckpt = CheckpointDir::open(dir.path());
      std::vector<std::vector<std::byte>> got;
      std::vector<CheckpointDir::RowsRead> reads;
      std::vector<std::vector<std::byte>> want;
      for (const RefTensor& t : model) {
        for (int64_t r = 0; r < readers; ++r) {
          const RowRange rows = tensor_rows(t.shape, r, readers);
          const size_t rb = t.shape.empty() ? t.data.size() : static_cast<size_t>(t.row_bytes());
          const size_t begin = t.shape.empty() ? 0 : static_cast<size_t>(rows.begin) * rb;
          const size_t n = t.shape.empty() ? rb : static_cast<size_t>(rows.size()) * rb;
          want.emplace_back(t.data.begin() + static_cast<ptrdiff_t>(begin),
                            t.data.begin() + static_cast<ptrdiff_t>(begin + n));
          got.emplace_back(n);
        }
      }
      size_t k = 0;
      for (const RefTensor& t : model) {
        for (int64_t r = 0; r < readers; ++r, ++k) {
          reads.push_back({t.name, tensor_rows(t.shape, r, readers), got[k].data(), got[k].size()});
        }
      }
      ckpt.read_rows_batch(reads, /*verify=*/true, 2);
      EXPECT_EQ(got, want) << writers << " writers, " << readers << " readers";
    }
  }
}

TEST(ReadRowsBatch, FlippedByteInTheLastChunkIsRefusedNamingTheFile) {
  TempDir dir;
  const auto model = large_model();
  testing::write_checkpoint(dir.path(), model, 1);
  const std::string path = dir.file(shard_file_name(0, 1));
  const TensorInfo big = ShardFile::open(path).tensor("big");
  flip_byte(path, big.data_offset + big.nbytes - 1);
  std::vector<std::byte> buf(big.nbytes);
  const CheckpointDir ckpt = CheckpointDir::open(dir.path());
  const CheckpointDir::RowsRead read{"big", {0, kRows}, buf.data(), buf.size()};
  for (size_t threads : {1, 2}) {
    EXPECT_THAT(error_of([&] { ckpt.read_rows_batch(std::span(&read, 1), true, threads); }),
                AllOf(HasSubstr(path), HasSubstr("tensor \"big\""), HasSubstr("checksum mismatch")))
        << threads << " threads";
  }
  // A partial read touching only intact rows still verifies the whole piece first.
  const CheckpointDir::RowsRead first_rows{"big", {0, 10}, buf.data(), 120};
  EXPECT_THAT(error_of([&] { ckpt.read_rows_batch(std::span(&first_rows, 1), true, 2); }),
              HasSubstr("checksum mismatch"));
  // The shard file's own reads (load_shard's path) refuse it too.
  const ShardFile file = ShardFile::open(path, /*verify_checksums=*/false);
  const PieceRead whole{&file, &file.tensor("big"), 0, big.nbytes, buf.data(), true};
  EXPECT_THAT(error_of([&] {
                read_pieces(std::span(&whole, 1), 2,
                            [&](size_t, uint64_t d) { file.check_digest(file.tensor("big"), d); });
              }),
              AllOf(HasSubstr(path), HasSubstr("checksum mismatch")));
}

TEST(ReadRowsBatch, ArgumentsAreCheckedBeforeAnyRead) {
  TempDir dir;
  testing::write_checkpoint(dir.path(), large_model(), 1);
  const CheckpointDir ckpt = CheckpointDir::open(dir.path());
  std::vector<std::byte> buf(20, std::byte{0x5a});
  const std::vector<CheckpointDir::RowsRead> reads = {
      {"small", {0, 5}, buf.data(), 20},  // fine
      {"small", {0, 6}, buf.data(), 24},  // past its 5 rows
  };
  EXPECT_THAT(error_of([&] { ckpt.read_rows_batch(reads, true, 2); }),
              HasSubstr("rows [0, 6) are not inside its 5 rows"));
  EXPECT_EQ(buf, std::vector<std::byte>(20, std::byte{0x5a}));
  const CheckpointDir::RowsRead short_dst{"small", {0, 5}, buf.data(), 19};
  EXPECT_THAT(error_of([&] { ckpt.read_rows_batch(std::span(&short_dst, 1), true, 2); }),
              HasSubstr("destination has 19 bytes"));
}

}  // namespace
}  // namespace fsdp_ema::format
