// CheckpointDir: resharding reads (any writer world size -> any reader world size), N-d boxes,
// checksum verification, and the directory-level corruption matrix.
#include "fsdp_ema/format/checkpoint_dir.h"

#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <random>
#include <thread>

#include "fsdp_ema/format/checksum.h"
#include "fsdp_ema/format/names.h"
#include "fsdp_ema/format/shard_writer.h"
#include "tests/format/fixture_model.h"
#include "tests/format/read_helpers.h"
#include "tests/format/test_util.h"

namespace fsdp_ema::format {
namespace {

using ::testing::AllOf;
using testing::error_of;
using testing::flip_byte;
using ::testing::HasSubstr;
using testing::RefTensor;
using testing::TempDir;

// torch.chunk's split of `rows` into `world` chunks, computed the way torch does it.
std::vector<RowRange> torch_chunk(int64_t rows, int64_t world) {
  std::vector<RowRange> out;
  const int64_t cs = (rows + world - 1) / world;
  for (int64_t b = 0; cs > 0 && b < rows; b += cs) out.push_back({b, std::min(b + cs, rows)});
  return out;
}

TEST(ChunkRows, MatchesTorchChunkForEveryRankIncludingEmptyOnes) {
  for (int64_t rows : {0, 1, 2, 3, 5, 7, 8, 10, 17, 100}) {
    for (int64_t world = 1; world <= 12; ++world) {
      const auto chunks = torch_chunk(rows, world);
      int64_t covered = 0;
      for (int64_t r = 0; r < world; ++r) {
        const RowRange got = chunk_rows(rows, r, world);
        if (static_cast<size_t>(r) < chunks.size()) {
          EXPECT_EQ(got, chunks[static_cast<size_t>(r)])
              << rows << " rows, rank " << r << "/" << world;
        } else {
          EXPECT_EQ(got.size(), 0) << rows << " rows, rank " << r << "/" << world;
        }
        covered += got.size();
      }
      EXPECT_EQ(covered, rows);
    }
  }
  EXPECT_EQ(chunk_rows(5, 3, 4), (RowRange{5, 5}));  // 5 over 4: 2, 2, 1, 0
  EXPECT_EQ(chunk_rows(3, 4, 5), (RowRange{3, 3}));
  EXPECT_EQ(chunk_rows(INT64_MAX, 2, 3).end, INT64_MAX);
  EXPECT_THAT(error_of([] { chunk_rows(4, 2, 2); }), HasSubstr("0 <= rank < world"));
  EXPECT_THAT(error_of([] { chunk_rows(4, 0, 0); }), HasSubstr("rank 0, world 0"));
}

std::vector<std::byte> rows_of(const RefTensor& t, RowRange r) {
  const auto rb = static_cast<size_t>(t.row_bytes());
  return {t.data.begin() + static_cast<ptrdiff_t>(r.begin * rb),
          t.data.begin() + static_cast<ptrdiff_t>(r.end * rb)};
}

TEST(CheckpointDir, ReshardingMatrixEveryWriterAndReaderWorldSize) {
  const auto model = testing::reference_model();
  for (int64_t w = 1; w <= 4; ++w) {
    TempDir dir;
    testing::write_checkpoint(dir.path(), model, w);
    const CheckpointDir ckpt = CheckpointDir::open(dir.path());
    EXPECT_EQ(ckpt.layout(), CheckpointLayout::kFsdpEma);
    EXPECT_EQ(ckpt.world_size(), w);
    ASSERT_EQ(ckpt.tensors().size(), model.size());
    for (const RefTensor& t : model) {
      const IndexTensor& it = ckpt.tensor(t.name);
      EXPECT_EQ(it.dtype, t.dtype);
      EXPECT_EQ(it.shape, t.shape);
      std::vector<std::byte> full(t.data.size());
      ckpt.read_full(t.name, full.data(), full.size());
      EXPECT_EQ(full, t.data) << t.name << " written by " << w;
      if (t.shape.empty()) continue;
      for (int64_t m = 1; m <= 5; ++m) {
        for (int64_t r = 0; r < m; ++r) {
          const RowRange rows = chunk_rows(t.shape[0], r, m);
          const auto want = rows_of(t, rows);
          std::vector<std::byte> got(want.size(), std::byte{0xee});
          testing::read_chunk(ckpt, t.name, r, m, got.data(), got.size());
          EXPECT_EQ(got, want) << t.name << ": written by " << w << ", rank " << r << " of " << m;
        }
      }
    }
    EXPECT_EQ(
        ckpt.verify_all(), ckpt.index().tensors.size() == 0 ? 0u : [&] {
          size_t n = 0;
          for (const auto& t : ckpt.tensors()) n += t.pieces.size();
          return n;
        }());
  }
}

TEST(CheckpointDir, ZeroDimAndEmptyTensors) {
  TempDir dir;
  const auto model = testing::reference_model();
  testing::write_checkpoint(dir.path(), model, 3);
  const CheckpointDir ckpt = CheckpointDir::open(dir.path());
  int64_t step = 0;
  ckpt.read_full("step", &step, sizeof(step));
  int64_t want;
  std::memcpy(&want, model[3].data.data(), 8);
  EXPECT_EQ(step, want);
  int64_t chunk = 0;  // every rank holds a 0-dim tensor whole (rows.h's tensor_rows)
  testing::read_chunk(ckpt, "step", 2, 3, &chunk, sizeof(chunk));
  EXPECT_EQ(chunk, want);
  ckpt.read_full("empty", nullptr, 0);
  testing::read_chunk(ckpt, "empty", 1, 3, nullptr, 0);
  EXPECT_EQ(ckpt.tensor_nbytes("empty"), 0u);
}

TEST(CheckpointDir, ReadArgumentsAreChecked) {
  TempDir dir;
  testing::write_checkpoint(dir.path(), testing::reference_model(), 2);
  const CheckpointDir ckpt = CheckpointDir::open(dir.path());
  std::vector<std::byte> buf(1000);
  EXPECT_THAT(error_of([&] { ckpt.read_full("nope", buf.data(), 4); }),
              HasSubstr("no tensor \"nope\" in this checkpoint"));
  EXPECT_THAT(
      error_of([&] { ckpt.read_full("layer.weight", buf.data(), 139); }),
      HasSubstr("destination has 139 bytes but the slice of shape [7, 5] of F32 needs 140"));
  EXPECT_THAT(error_of([&] { testing::read_rows(ckpt, "layer.weight", 3, 8, buf.data(), 100); }),
              HasSubstr("rows [3, 8) are not inside its 7 rows"));
  EXPECT_THAT(error_of([&] { testing::read_rows(ckpt, "layer.weight", 4, 3, buf.data(), 0); }),
              HasSubstr("rows [4, 3)"));
  const Shape off{0, 4}, shp{1, 2};
  EXPECT_THAT(error_of([&] { testing::read_slice(ckpt, "layer.weight", off, shp, buf.data(), 8); }),
              HasSubstr("is outside global shape [7, 5]"));
  EXPECT_THAT(error_of([&] { ckpt.read_flat("ids", 3, 11, buf.data(), 32); }),
              HasSubstr("elements [3, 11) are not inside its 10"));
}

// A 3-d tensor stored as a 2x3 grid of boxes split along dims 1 and 2 (as 2-d meshes do), by 6
// "ranks"; then arbitrary slices and flat ranges are read back.
class GridCheckpoint : public ::testing::Test {
 protected:
  void SetUp() override {
    ref_ = testing::make_ref("grid", DType::kF32, {4, 5, 7}, 99);
    const int64_t d1[] = {0, 2, 5}, d2[] = {0, 3, 5, 7};
    std::vector<ShardDescription> shards(6);
    int64_t rank = 0;
    for (int a = 0; a < 2; ++a) {
      for (int b = 0; b < 3; ++b, ++rank) {
        TensorToWrite t;
        t.name = "grid";
        t.dtype = DType::kF32;
        t.global_shape = ref_.shape;
        t.offsets = {0, d1[a], d2[b]};
        t.shape = {4, d1[a + 1] - d1[a], d2[b + 1] - d2[b]};
        box_.push_back(t.offsets);
        const Shape off = t.offsets, shp = t.shape;
        t.fill = [this, off, shp](uint64_t offset, uint64_t length, void* dst) {
          // Gather the box from the reference, element by element.
          auto* out = static_cast<std::byte*>(dst);
          for (uint64_t e = offset / 4; e < (offset + length) / 4; ++e) {
            const int64_t i = static_cast<int64_t>(e) / (shp[1] * shp[2]);
            const int64_t j = (static_cast<int64_t>(e) / shp[2]) % shp[1];
            const int64_t k = static_cast<int64_t>(e) % shp[2];
            std::memcpy(out + (e - offset / 4) * 4,
                        &ref_.data[static_cast<size_t>(
                            ((i + off[0]) * 35 + (j + off[1]) * 7 + k + off[2]) * 4)],
                        4);
          }
        };
        WriteOptions o;
        o.rank = rank;
        o.world_size = 6;
        o.chunk_bytes = 64;
        write_shard_file(dir_.file(shard_file_name(rank, 6)), {t}, o,
                         &shards[static_cast<size_t>(rank)]);
      }
    }
    write_index(dir_.path(), build_index(shards, 6));
  }
  float at(int64_t i, int64_t j, int64_t k) const {
    float v;
    std::memcpy(&v, &ref_.data[static_cast<size_t>((i * 35 + j * 7 + k) * 4)], 4);
    return v;
  }
  TempDir dir_;
  RefTensor ref_;
  std::vector<Shape> box_;
};

TEST_F(GridCheckpoint, EverySliceEqualsTheReference) {
  const CheckpointDir ckpt = CheckpointDir::open(dir_.path());
  EXPECT_EQ(ckpt.tensor("grid").pieces.size(), 6u);
  std::vector<std::byte> full(ref_.data.size());
  ckpt.read_full("grid", full.data(), full.size());
  EXPECT_EQ(full, ref_.data);
  std::mt19937 rng(5);
  for (int trial = 0; trial < 300; ++trial) {
    Shape off(3), shp(3);
    for (size_t d = 0; d < 3; ++d) {
      const int64_t n = ref_.shape[d];
      off[d] = static_cast<int64_t>(rng() % static_cast<uint32_t>(n + 1));
      shp[d] = static_cast<int64_t>(rng() % static_cast<uint32_t>(n - off[d] + 1));
    }
    std::vector<float> got(static_cast<size_t>(shp[0] * shp[1] * shp[2]), -1.0f);
    testing::read_slice(ckpt, "grid", off, shp, got.data(), got.size() * 4);
    for (int64_t i = 0; i < shp[0]; ++i) {
      for (int64_t j = 0; j < shp[1]; ++j) {
        for (int64_t k = 0; k < shp[2]; ++k) {
          const float want = at(off[0] + i, off[1] + j, off[2] + k);
          const float g = got[static_cast<size_t>((i * shp[1] + j) * shp[2] + k)];
          ASSERT_EQ(std::memcmp(&g, &want, 4), 0)
              << "slice " << shape_to_string(off) << " " << shape_to_string(shp);
        }
      }
    }
  }
}

TEST_F(GridCheckpoint, EveryFlatRangeEqualsTheReference) {
  const CheckpointDir ckpt = CheckpointDir::open(dir_.path());
  const uint64_t n = 4 * 5 * 7;
  for (uint64_t b = 0; b <= n; b += 3) {
    for (uint64_t e = b; e <= n; e += 5) {
      std::vector<std::byte> got((e - b) * 4);
      ckpt.read_flat("grid", b, e, got.data(), got.size(), /*verify=*/b == 0);
      ASSERT_TRUE(
          std::equal(got.begin(), got.end(), ref_.data.begin() + static_cast<ptrdiff_t>(b * 4)))
          << "[" << b << ", " << e << ")";
    }
  }
}

TEST_F(GridCheckpoint, RowsForEveryReaderWorldSize) {
  const CheckpointDir ckpt = CheckpointDir::open(dir_.path());
  for (int64_t m = 1; m <= 5; ++m) {
    for (int64_t r = 0; r < m; ++r) {
      const RowRange rows = chunk_rows(4, r, m);
      std::vector<std::byte> got(static_cast<size_t>(rows.size() * 35 * 4));
      testing::read_chunk(ckpt, "grid", r, m, got.data(), got.size());
      EXPECT_TRUE(std::equal(got.begin(), got.end(),
                             ref_.data.begin() + static_cast<ptrdiff_t>(rows.begin * 35 * 4)));
    }
  }
}

TEST(CheckpointDir, ConcurrentReadsAgree) {
  TempDir dir;
  const auto model = testing::reference_model();
  testing::write_checkpoint(dir.path(), model, 3);
  const CheckpointDir ckpt = CheckpointDir::open(dir.path());
  std::vector<std::thread> threads;
  std::atomic<int> mismatches{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int rep = 0; rep < 20; ++rep) {
        for (const RefTensor& ref : model) {
          std::vector<std::byte> got(ref.data.size());
          ckpt.read_full(ref.name, got.data(), got.size());
          if (got != ref.data) ++mismatches;
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(mismatches.load(), 0);
}

TEST(CheckpointDirCorruption, FlippedByteFailsTheReadThatTouchesItOnly) {
  TempDir dir;
  const auto model = testing::reference_model();
  testing::write_checkpoint(dir.path(), model, 2);
  const std::string file = dir.file(shard_file_name(1, 2));
  const uint64_t offset = ShardFile::open(file).tensor("layer.weight").data_offset + 3;
  flip_byte(file, offset);
  const CheckpointDir ckpt = CheckpointDir::open(dir.path());  // headers are fine
  std::vector<std::byte> buf(140);
  EXPECT_THAT(error_of([&] { ckpt.read_full("layer.weight", buf.data(), buf.size()); }),
              AllOf(HasSubstr(file), HasSubstr("tensor \"layer.weight\""),
                    HasSubstr("piece at offsets [4, 0]"), HasSubstr("checksum mismatch")));
  // Rows held by the intact piece read fine; the damaged piece is checked (whole) when touched.
  testing::read_rows(ckpt, "layer.weight", 0, 4, buf.data(), 80);
  EXPECT_THAT(error_of([&] { testing::read_rows(ckpt, "layer.weight", 6, 7, buf.data(), 20); }),
              HasSubstr("checksum mismatch"));
  EXPECT_THAT(error_of([&] { ckpt.verify_all(); }), HasSubstr("checksum mismatch"));
  ckpt.read_full("layer.weight", buf.data(), buf.size(), /*verify=*/false);
  EXPECT_NE(buf, model[0].data);
}

// No verdict is remembered: a piece damaged after one read fails the next read of the same object.
TEST(CheckpointDirCorruption, EveryReadOfOneObjectVerifiesAgain) {
  TempDir dir;
  const auto model = testing::reference_model();
  testing::write_checkpoint(dir.path(), model, 1);
  const std::string file = dir.file(shard_file_name(0, 1));
  const CheckpointDir ckpt = CheckpointDir::open(dir.path());
  std::vector<std::byte> buf(140);
  ckpt.read_full("layer.weight", buf.data(), buf.size());
  EXPECT_TRUE(ckpt.verify_piece("layer.weight", 0));
  flip_byte(file, ShardFile::open(file).tensor("layer.weight").data_offset);
  EXPECT_THAT(error_of([&] { ckpt.read_full("layer.weight", buf.data(), buf.size()); }),
              HasSubstr("checksum mismatch"));
  EXPECT_THAT(error_of([&] { ckpt.verify_piece("layer.weight", 0); }),
              HasSubstr("checksum mismatch"));
  EXPECT_THAT(error_of([&] { ckpt.verify_piece("layer.weight", 1); }), HasSubstr("no piece 1"));
}

class CheckpointDirBroken : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = root_.subdir("ckpt");
    testing::write_checkpoint(dir_, testing::reference_model(), 2);
    index_ = testing::read_text(index_path());
  }
  std::string index_path() const { return dir_ + "/fsdp_ema.index.json"; }
  std::string open_error() {
    return error_of([&] { CheckpointDir::open(dir_); });
  }
  void edit_index(const std::string& from, const std::string& to) {
    std::string text = index_;
    const size_t p = text.find(from);
    ASSERT_NE(p, std::string::npos) << from;
    text.replace(p, from.size(), to);
    testing::write_text(index_path(), text);
  }
  TempDir root_;
  std::string dir_;
  std::string index_;
};

TEST_F(CheckpointDirBroken, MissingIndexIsAnIncompleteCheckpoint) {
  ::unlink(index_path().c_str());
  EXPECT_THAT(open_error(), AllOf(HasSubstr(dir_), HasSubstr("incomplete checkpoint: "
                                                             "fsdp_ema.index.json missing")));
  // Even when a shard file is damaged too, the missing index is what is reported.
  testing::write_text(dir_ + "/shard-00000-of-00002.safetensors", "garbage");
  EXPECT_THAT(open_error(), HasSubstr("incomplete checkpoint"));
}

TEST_F(CheckpointDirBroken, MissingIndexWithOnlyAlternateShardNamesIsIncomplete) {
  // An overwrite writes shard-*.b.safetensors beside the committed files; if the index and the
  // plain files are gone, what is left is still our layout, never a plain safetensors directory.
  ::unlink(index_path().c_str());
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(::rename((dir_ + "/" + shard_file_name(r, 2)).c_str(),
                       (dir_ + "/" + alternate_shard_file_name(r, 2)).c_str()),
              0);
  }
  EXPECT_THAT(open_error(), AllOf(HasSubstr("incomplete checkpoint: fsdp_ema.index.json missing"),
                                  HasSubstr(alternate_shard_file_name(0, 2))));
}

TEST_F(CheckpointDirBroken, IndexNamingFilesOutsideTheDirectoryIsRefused) {
  edit_index("\"shard-00000-of-00002.safetensors\"", "\"../x.safetensors\"");
  EXPECT_THAT(open_error(), AllOf(HasSubstr("\"../x.safetensors\""), HasSubstr("plain file name")));
  edit_index("\"shard-00000-of-00002.safetensors\"", "\"/etc/passwd\"");
  EXPECT_THAT(open_error(), HasSubstr("\"/etc/passwd\" contains '/'"));
  edit_index("\"shard-00000-of-00002.safetensors\"", "\"a/b.safetensors\"");
  EXPECT_THAT(open_error(), HasSubstr("\"a/b.safetensors\" contains '/'"));
}

TEST_F(CheckpointDirBroken, IndexChecksumThatDisagreesWithTheFileIsRefused) {
  const size_t p = index_.find("xxh3-64:");
  const std::string sum = index_.substr(p, 24);
  std::string other = sum;
  other.back() = other.back() == '0' ? '1' : '0';
  edit_index(sum, other);
  EXPECT_THAT(open_error(), AllOf(HasSubstr("checksum " + other + " in the index but " + sum +
                                            " in the file header")));
}

TEST_F(CheckpointDirBroken, MissingPieceIsACoverageError) {
  // Drop the second piece of layer.weight from the index.
  const std::string piece =
      ",\n      {\"file\": \"shard-00001-of-00002.safetensors\", \"offsets\": [4, 0]";
  const size_t p = index_.find(piece);
  ASSERT_NE(p, std::string::npos);
  std::string text = index_;
  text.erase(p, text.find('}', p) + 1 - p);
  testing::write_text(index_path(), text);
  EXPECT_THAT(open_error(), AllOf(HasSubstr("tensor \"layer.weight\""),
                                  HasSubstr("pieces cover 20 of 35 elements"),
                                  HasSubstr("rows [4, 7) are not covered")));
}

TEST_F(CheckpointDirBroken, MissingShardFileIsNamed) {
  ::unlink((dir_ + "/shard-00001-of-00002.safetensors").c_str());
  EXPECT_THAT(open_error(), AllOf(HasSubstr("shard-00001-of-00002.safetensors"),
                                  HasSubstr("piece file missing")));
}

TEST_F(CheckpointDirBroken, IndexAndFileMustListTheSameTensors) {
  // A file rewritten with a tensor the index does not list.
  const auto model = testing::reference_model();
  auto shards = testing::local_shards(model, 1, 2);
  const float extra[2] = {1, 2};
  shards.push_back(TensorToWrite::full("extra", DType::kF32, {2}, extra));
  WriteOptions o;
  o.rank = 1;
  o.world_size = 2;
  write_shard_file(dir_ + "/shard-00001-of-00002.safetensors", shards, o);
  EXPECT_THAT(open_error(),
              AllOf(HasSubstr("tensor \"extra\""), HasSubstr("is not listed in the index")));
  // A file rewritten without a tensor the index lists.
  shards.pop_back();
  shards.erase(shards.begin());  // layer.weight
  write_shard_file(dir_ + "/shard-00001-of-00002.safetensors", shards, o);
  EXPECT_THAT(open_error(), AllOf(HasSubstr("shard-00001-of-00002.safetensors: tensor "
                                            "\"layer.weight\""),
                                  HasSubstr("listed in the index but missing from the file")));
}

TEST_F(CheckpointDirBroken, TruncatedShardFileIsRefusedAtOpen) {
  const std::string f = dir_ + "/shard-00001-of-00002.safetensors";
  std::filesystem::resize_file(f, std::filesystem::file_size(f) - 3);
  EXPECT_THAT(open_error(), AllOf(HasSubstr(f), HasSubstr("truncated")));
}

TEST_F(CheckpointDirBroken, StrayFilesAreReported) {
  EXPECT_TRUE(CheckpointDir::open(dir_).stray_files().empty());
  testing::write_text(dir_ + "/leftover.safetensors", "x");
  const CheckpointDir ckpt = CheckpointDir::open(dir_);
  EXPECT_EQ(ckpt.stray_files(), std::vector<std::string>{"leftover.safetensors"});
}

TEST(CheckpointDirLayouts, DirectoriesThatAreNoCheckpoint) {
  TempDir dir;
  EXPECT_THAT(error_of([&] { CheckpointDir::open(dir.path()); }),
              AllOf(HasSubstr(dir.path()), HasSubstr("not a checkpoint")));
  testing::write_text(dir.file(".metadata"), "\x80\x04pickle");
  testing::write_text(dir.file("__0_0.distcp"), "x");
  EXPECT_THAT(
      error_of([&] { CheckpointDir::open(dir.path()); }),
      AllOf(HasSubstr("native torch.distributed.checkpoint"), HasSubstr("pickle is never loaded")));
  EXPECT_THAT(error_of([&] { CheckpointDir::open(dir.file("none")); }),
              HasSubstr("not a directory"));
}

// The checked-in directory written by DCP's HuggingFaceStorageWriter from 4 ranks on a 2x2 mesh
// (make_dcp_hf_fixture.py), against the full tensors saved next to it.
class DcpFixture : public ::testing::Test {
 protected:
  static std::string data(const std::string& name) {
    return std::string(FSDP_EMA_FORMAT_TEST_DATA) + "/" + name;
  }
};

TEST_F(DcpFixture, ReadsEveryTensorOfADcpHuggingFaceShardedDirectory) {
  const CheckpointDir ckpt = CheckpointDir::open(data("dcp_hf_sharded"));
  const ShardFile ref = ShardFile::open(data("dcp_hf_sharded_reference.safetensors"));
  const auto ref_bytes = ref.map();
  EXPECT_EQ(ckpt.layout(), CheckpointLayout::kDcpHuggingFace);
  EXPECT_EQ(ckpt.world_size(), 4);
  EXPECT_EQ(ckpt.files().size(), 4u);
  ASSERT_EQ(ckpt.tensors().size(), ref.tensors().size());
  EXPECT_EQ(ckpt.tensor("layer.weight").pieces.size(), 4u);  // 2-d boxes
  EXPECT_EQ(ckpt.tensor("layer.bias").pieces.size(), 1u);    // replicated, stored once
  EXPECT_EQ(ckpt.tensor("embed").pieces.size(), 4u);         // one of them empty
  for (const TensorInfo& r : ref.tensors()) {
    const IndexTensor& t = ckpt.tensor(r.name);
    EXPECT_EQ(t.dtype, r.dtype) << r.name;
    EXPECT_EQ(t.shape, r.shape) << r.name;  // max of offsets + shape over the pieces
    std::vector<std::byte> got(r.nbytes);
    ckpt.read_full(r.name, got.data(), got.size());
    const auto want = ref_bytes->data(r);
    EXPECT_TRUE(std::equal(got.begin(), got.end(), want.begin())) << r.name;
    if (r.shape.empty()) continue;
    const uint64_t row = r.shape[0] == 0 ? 0 : r.nbytes / static_cast<uint64_t>(r.shape[0]);
    for (int64_t m = 1; m <= 5; ++m) {
      for (int64_t k = 0; k < m; ++k) {
        const RowRange rows = chunk_rows(r.shape[0], k, m);
        std::vector<std::byte> part(static_cast<size_t>(rows.size()) * row);
        testing::read_chunk(ckpt, r.name, k, m, part.data(), part.size());
        EXPECT_TRUE(std::equal(part.begin(), part.end(),
                               want.begin() + static_cast<ptrdiff_t>(rows.begin * row)))
            << r.name << " rank " << k << " of " << m;
      }
    }
  }
  EXPECT_EQ(ckpt.verify_all(), 0u);  // DCP stores no checksums
  EXPECT_TRUE(ckpt.stray_files().empty());
}

TEST_F(DcpFixture, MissingDcpFileIsRefusedByNameAndByCoverage) {
  // A hole in DCP's shard numbering (rank + 1) is named before anything is read.
  TempDir dir;
  for (const auto& e : std::filesystem::directory_iterator(data("dcp_hf_sharded"))) {
    if (e.path().filename() != "shard-00003-model-00001-of-00001.safetensors") {
      std::filesystem::copy_file(e.path(), dir.file(e.path().filename().string()));
    }
  }
  EXPECT_THAT(error_of([&] { CheckpointDir::open(dir.path()); }),
              HasSubstr("incomplete DCP checkpoint: files of shard 3 (rank 2) are missing but "
                        "shard 4 is present"));
  // Renumbered so that the names show no hole, the lost rank's 2-d pieces still leave a gap.
  std::filesystem::rename(dir.file("shard-00004-model-00001-of-00001.safetensors"),
                          dir.file("shard-00003-model-00001-of-00001.safetensors"));
  EXPECT_THAT(error_of([&] { CheckpointDir::open(dir.path()); }),
              HasSubstr("missing piece or gap"));
}

TEST_F(DcpFixture, MissingModelFileOfNIsRefused) {
  TempDir dir;
  const auto src = data("dcp_hf_sharded") + "/shard-00001-model-00001-of-00001.safetensors";
  std::filesystem::copy_file(src, dir.file("model-00001-of-00002.safetensors"));
  EXPECT_THAT(error_of([&] { CheckpointDir::open(dir.path()); }),
              HasSubstr("incomplete checkpoint: model file 2 of 2 is missing"));
}

TEST_F(DcpFixture, FilesThatDisagreeOnADtypeAreRefused) {
  TempDir dir;
  testing::write_bytes(
      dir.file("model-00001-of-00002.safetensors"),
      testing::raw_safetensors(
          R"({"__metadata__":{"format":"pt"},"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
          8));
  testing::write_bytes(
      dir.file("model-00002-of-00002.safetensors"),
      testing::raw_safetensors(
          R"({"__metadata__":{"format":"pt","DCP_SHARDING_INFO":"{\"w\":{\"saved_offsets\":[2]}}"},)"
          R"("w":{"dtype":"BF16","shape":[2],"data_offsets":[0,4]}})",
          4));
  EXPECT_THAT(error_of([&] { CheckpointDir::open(dir.path()); }),
              AllOf(HasSubstr("model-00002-of-00002.safetensors: tensor \"w\" is BF16"),
                    HasSubstr("model-00001-of-00002.safetensors has it as F32")));
}

TEST_F(DcpFixture, PlainSafetensorsFileFromPythonReadsAsAOneFileCheckpoint) {
  TempDir dir;
  std::filesystem::copy_file(data("python_safetensors.safetensors"), dir.file("model.safetensors"));
  const CheckpointDir ckpt = CheckpointDir::open(dir.path());
  EXPECT_EQ(ckpt.layout(), CheckpointLayout::kDcpHuggingFace);
  float w[12];
  ckpt.read_full("weight", w, sizeof(w));
  EXPECT_EQ(w[11], 4.5f);
  float rows[4];
  testing::read_chunk(ckpt, "weight", 1, 2, rows, sizeof(rows));  // 3 rows over 2: [2, 3)
  EXPECT_EQ(rows[0], 3.0f);
}

}  // namespace
}  // namespace fsdp_ema::format
