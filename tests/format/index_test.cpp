// fsdp_ema.index.json: building, writing (commit), reading, coverage and path validation.
#include "fsdp_ema/format/index.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include "fsdp_ema/format/checksum.h"
#include "fsdp_ema/format/shard_file.h"
#include "fsdp_ema/format/shard_writer.h"
#include "tests/format/fixture_model.h"
#include "tests/format/read_helpers.h"
#include "tests/format/test_util.h"

namespace fsdp_ema::format {
namespace {

using ::testing::AllOf;
using testing::error_of;
using ::testing::HasSubstr;
using testing::TempDir;

IndexPiece piece(std::string file, Shape offsets, Shape shape) {
  return IndexPiece{std::move(file), std::move(offsets), std::move(shape), 0x1234};
}

TEST(Index, WriteThenReadGivesTheSameIndex) {
  TempDir dir;
  const CheckpointIndex written =
      testing::write_checkpoint(dir.path(), testing::reference_model(), 3);
  const CheckpointIndex read = read_index(dir.path());
  EXPECT_EQ(read.format_version, 1);
  EXPECT_EQ(read.world_size, 3);
  ASSERT_EQ(read.tensors.size(), written.tensors.size());
  for (size_t i = 0; i < read.tensors.size(); ++i) {
    const IndexTensor& a = written.tensors[i];
    const IndexTensor& b = read.tensors[i];
    EXPECT_EQ(a.name, b.name);
    EXPECT_EQ(a.dtype, b.dtype);
    EXPECT_EQ(a.shape, b.shape);
    ASSERT_EQ(a.pieces.size(), b.pieces.size()) << a.name;
    for (size_t p = 0; p < a.pieces.size(); ++p) {
      EXPECT_EQ(a.pieces[p].file, b.pieces[p].file);
      EXPECT_EQ(a.pieces[p].offsets, b.pieces[p].offsets);
      EXPECT_EQ(a.pieces[p].shape, b.pieces[p].shape);
      EXPECT_EQ(a.pieces[p].checksum, b.pieces[p].checksum);
    }
  }
  // The 0-dim tensor is one piece with no offsets, written by rank 0.
  const IndexTensor* step = read.find("step");
  ASSERT_NE(step, nullptr);
  ASSERT_EQ(step->pieces.size(), 1u);
  EXPECT_EQ(step->pieces[0].file, "shard-00000-of-00003.safetensors");
  EXPECT_TRUE(step->pieces[0].offsets.empty());
  EXPECT_EQ(read.find("nope"), nullptr);
  EXPECT_EQ(index_to_json(read), testing::read_text(dir.file("fsdp_ema.index.json")));
}

TEST(Index, MetadataRoundTrips) {
  TempDir dir;
  const auto model = testing::reference_model();
  ShardDescription d;
  write_shard_file(dir.file(shard_file_name(0, 1)), testing::local_shards(model, 0, 1), {}, &d);
  CheckpointIndex index = build_index({&d, 1}, 1, {{"step", "1000"}, {"note", "\"quoted\"\n"}});
  write_index(dir.path(), index);
  const CheckpointIndex back = read_index(dir.path());
  EXPECT_EQ(back.metadata.at("step"), "1000");
  EXPECT_EQ(back.metadata.at("note"), "\"quoted\"\n");
}

TEST(Index, RefusesToOverwriteACommittedCheckpoint) {
  TempDir dir;
  const CheckpointIndex index =
      testing::write_checkpoint(dir.path(), testing::reference_model(), 2);
  const std::string before = testing::read_text(dir.file("fsdp_ema.index.json"));
  CheckpointIndex changed = index;
  changed.metadata["x"] = "y";
  EXPECT_THAT(
      error_of([&] { write_index(dir.path(), changed); }),
      AllOf(HasSubstr("checkpoint already committed"), HasSubstr(dir.file("fsdp_ema.index.json"))));
  EXPECT_EQ(testing::read_text(dir.file("fsdp_ema.index.json")), before);
  write_index(dir.path(), changed, /*overwrite=*/true);
  EXPECT_EQ(read_index(dir.path()).metadata.at("x"), "y");
  // No temporaries left behind.
  for (const std::string& n : testing::list_names(dir.path())) EXPECT_NE(n.front(), '.') << n;
}

TEST(Index, BuildFromDirectoryReadsEveryRanksHeader) {
  TempDir dir;
  const auto model = testing::reference_model();
  const CheckpointIndex expected = [&] {
    TempDir other;
    return testing::write_checkpoint(other.path(), model, 4);
  }();
  for (int64_t r = 0; r < 4; ++r) {
    WriteOptions o;
    o.rank = r;
    o.world_size = 4;
    write_shard_file(dir.file(shard_file_name(r, 4)), testing::local_shards(model, r, 4), o);
  }
  const CheckpointIndex built = testing::index_of_rank_files(dir.path(), 4);
  EXPECT_EQ(index_to_json(built), index_to_json(expected));
  ::unlink(dir.file(shard_file_name(2, 4)).c_str());
  EXPECT_THAT(error_of([&] { testing::index_of_rank_files(dir.path(), 4); }),
              HasSubstr("missing shard file shard-00002-of-00004.safetensors (rank 2 of 4"));
  EXPECT_THAT(error_of([&] { testing::index_of_rank_files(dir.path(), 3); }),
              HasSubstr("missing shard file shard-00000-of-00003.safetensors"));
}

TEST(Index, BuildRefusesAFileWhoseHeaderNamesAnotherRank) {
  TempDir dir;
  const auto model = testing::reference_model();
  // Each rank's file under the other rank's name: the headers say who wrote them.
  uint64_t bytes[2] = {0, 0};
  for (int64_t r = 0; r < 2; ++r) {
    WriteOptions o;
    o.rank = r;
    o.world_size = 2;
    bytes[r] = write_shard_file(dir.file(shard_file_name(1 - r, 2)),
                                testing::local_shards(model, r, 2), o);
  }
  EXPECT_THAT(error_of([&] { testing::index_of_rank_files(dir.path(), 2); }),
              AllOf(HasSubstr(shard_file_name(0, 2)),
                    HasSubstr("not the fsdp_ema shard file of rank 0 of 2 (metadata says rank 1 "
                              "of 2)")));
  const ShardDescription d = describe_shard_file(dir.file(shard_file_name(0, 2)), 1, 2);
  EXPECT_EQ(d.file, "");
  EXPECT_EQ(d.rank, 1);
  EXPECT_EQ(d.world_size, 2);
  EXPECT_EQ(d.file_bytes, bytes[1]);
  EXPECT_EQ(d.tensors.size(), testing::local_shards(model, 1, 2).size());
}

TEST(Index, BuildRejectsRanksThatDisagree) {
  ShardDescription a{"shard-00000-of-00002.safetensors", 0, 2, 0, {}};
  ShardDescription b{"shard-00001-of-00002.safetensors", 1, 2, 0, {}};
  TensorInfo t{"w", DType::kF32, {2}, {0}, {4}, 1, 0, 8};
  a.tensors = {t};
  t.offsets = {2};
  t.dtype = DType::kBF16;
  b.tensors = {t};
  std::vector<ShardDescription> shards = {a, b};
  EXPECT_THAT(error_of([&] { build_index(shards, 2); }),
              AllOf(HasSubstr("tensor \"w\""), HasSubstr("dtype BF16 but shard-00000")));
  shards[1].tensors[0].dtype = DType::kF32;
  shards[1].tensors[0].global_shape = {5};
  EXPECT_THAT(error_of([&] { build_index(shards, 2); }), HasSubstr("global shape [5] but"));
  shards[1].tensors[0].global_shape = {4};
  EXPECT_EQ(build_index(shards, 2).tensors.at(0).pieces.size(), 2u);
  shards[1].rank = 0;
  EXPECT_THAT(error_of([&] { build_index(shards, 2); }), HasSubstr("out of range or repeated"));
  shards[1].rank = 1;
  shards[1].world_size = 3;
  EXPECT_THAT(error_of([&] { build_index(shards, 2); }), HasSubstr("for world size 3, not 2"));
  shards[1].world_size = 2;
  shards[1].tensors[0].checksum.reset();
  EXPECT_THAT(error_of([&] { build_index(shards, 2); }), HasSubstr("has no checksum"));
}

TEST(Coverage, AcceptsExactTilingsIncludingGridsAndEmptyPieces) {
  IndexTensor t{"w", DType::kF32, {4, 6}, {}};
  t.pieces = {piece("a.safetensors", {0, 0}, {2, 3}), piece("b.safetensors", {0, 3}, {2, 3}),
              piece("c.safetensors", {2, 0}, {2, 3}), piece("d.safetensors", {2, 3}, {2, 3}),
              piece("e.safetensors", {4, 0}, {0, 6})};
  check_coverage(t, "idx");
  IndexTensor s{"s", DType::kF32, {}, {piece("a.safetensors", {}, {})}};
  check_coverage(s, "idx");
  IndexTensor e{"e", DType::kF32, {0, 3}, {piece("a.safetensors", {0, 0}, {0, 3})}};
  check_coverage(e, "idx");
}

TEST(Coverage, GapsOverlapsAndOutOfBoundsPiecesAreNamed) {
  IndexTensor gap{"w", DType::kF32, {9, 2}, {}};
  gap.pieces = {piece("a.safetensors", {0, 0}, {3, 2}), piece("c.safetensors", {6, 0}, {3, 2})};
  EXPECT_THAT(error_of([&] { check_coverage(gap, "idx"); }),
              AllOf(HasSubstr("idx: tensor \"w\": pieces cover 12 of 18 elements"),
                    HasSubstr("missing piece or gap: rows [3, 6) are not covered")));

  IndexTensor overlap{"w", DType::kF32, {4, 4}, {}};
  overlap.pieces = {piece("a.safetensors", {0, 0}, {3, 4}), piece("b.safetensors", {2, 0}, {2, 4})};
  EXPECT_THAT(error_of([&] { check_coverage(overlap, "idx"); }),
              AllOf(HasSubstr("tensor \"w\": pieces overlap"),
                    HasSubstr("a.safetensors at offsets [0, 0] with shape [3, 4]"),
                    HasSubstr("b.safetensors at offsets [2, 0] with shape [2, 4]")));

  // One row held twice, one row missing: the element counts add up to the total.
  IndexTensor twice{"w", DType::kF32, {6, 2}, {}};
  twice.pieces = {piece("a.safetensors", {0, 0}, {3, 2}), piece("b.safetensors", {2, 0}, {3, 2})};
  EXPECT_THAT(error_of([&] { check_coverage(twice, "idx"); }),
              AllOf(HasSubstr("pieces overlap"), HasSubstr("b.safetensors at offsets [2, 0]")));

  // Overlap hidden from a volume check: one piece missing, another doubled.
  IndexTensor swapped{"w", DType::kF32, {2, 4}, {}};
  swapped.pieces = {piece("a.safetensors", {0, 0}, {1, 2}), piece("b.safetensors", {0, 0}, {1, 2}),
                    piece("c.safetensors", {1, 0}, {1, 4})};
  EXPECT_THAT(error_of([&] { check_coverage(swapped, "idx"); }), HasSubstr("pieces overlap"));

  // Column splits: the sweep runs along dim 1.
  IndexTensor cols{"w", DType::kF32, {3, 8}, {}};
  cols.pieces = {piece("a.safetensors", {0, 0}, {3, 4}), piece("b.safetensors", {0, 3}, {3, 5})};
  EXPECT_THAT(error_of([&] { check_coverage(cols, "idx"); }), HasSubstr("pieces overlap"));

  IndexTensor out{"w", DType::kF32, {4}, {piece("a.safetensors", {2}, {3})}};
  EXPECT_THAT(error_of([&] { check_coverage(out, "idx"); }),
              HasSubstr("piece in a.safetensors at offsets [2] with shape [3] lies outside global "
                        "shape [4] in dimension 0"));
  IndexTensor dims{"w", DType::kF32, {4}, {piece("a.safetensors", {0, 0}, {4, 1})}};
  EXPECT_THAT(error_of([&] { check_coverage(dims, "idx"); }),
              HasSubstr("does not have 1 dimensions"));
  IndexTensor scalars{
      "s", DType::kF32, {}, {piece("a.safetensors", {}, {}), piece("b.safetensors", {}, {})}};
  EXPECT_THAT(error_of([&] { check_coverage(scalars, "idx"); }),
              HasSubstr("both hold the 0-dim tensor"));
  IndexTensor missing{"w", DType::kF32, {4}, {}};
  CheckpointIndex index;
  index.tensors = {missing};
  EXPECT_THAT(error_of([&] { validate_index(index, "idx"); }), HasSubstr("has no pieces"));
}

TEST(IndexPaths, FileNamesMustBePlainNamesInsideTheDirectory) {
  const std::pair<std::string, const char*> bad[] = {
      {"../x.safetensors", "contains '/'"},         {"/etc/passwd", "contains '/'"},
      {"a/b.safetensors", "contains '/'"},          {"..", "starts with '.'"},
      {".hidden.safetensors", "starts with '.'"},   {"", "is empty"},
      {std::string("x\0y.safetensors", 15), "NUL"}, {"a\\b.safetensors", "contains '\\'"},
      {"passwd", "does not end in .safetensors"},
  };
  for (const auto& [bad_name, why] : bad) {
    const std::string& name = bad_name;  // clang 14 cannot capture a structured binding
    EXPECT_THAT(error_of([&] { check_piece_file_name(name, "idx"); }),
                AllOf(HasSubstr("idx: piece file name"), HasSubstr(why)))
        << name;
  }
  check_piece_file_name("shard-00000-of-00002.safetensors", "idx");
}

TEST(IndexPaths, ReadIndexRefusesTraversalAndSymlinksOutOfTheDirectory) {
  TempDir root;
  const std::string dir = root.subdir("ckpt");
  testing::write_checkpoint(dir, testing::reference_model(), 1);
  const std::string good = testing::read_text(dir + "/fsdp_ema.index.json");
  auto with_file = [&](const std::string& name) {
    std::string text = good;
    const std::string from = "\"shard-00000-of-00001.safetensors\"";
    for (size_t p = text.find(from); p != std::string::npos; p = text.find(from, p + 1)) {
      text.replace(p, from.size(), "\"" + name + "\"");
    }
    testing::write_text(dir + "/fsdp_ema.index.json", text);
    return error_of([&] { read_index(dir); });
  };
  EXPECT_THAT(with_file("../x.safetensors"),
              AllOf(HasSubstr("\"../x.safetensors\""), HasSubstr("must be a plain file name")));
  EXPECT_THAT(with_file("/etc/passwd"), HasSubstr("\"/etc/passwd\" contains '/'"));
  EXPECT_THAT(with_file("a/b.safetensors"), HasSubstr("\"a/b.safetensors\" contains '/'"));
  EXPECT_THAT(with_file("gone.safetensors"),
              AllOf(HasSubstr("gone.safetensors"), HasSubstr("piece file missing")));
  // A symbolic link inside the directory that points outside it.
  testing::write_text(root.file("outside.safetensors"), "x");
  ASSERT_EQ(::symlink("../outside.safetensors", (dir + "/link.safetensors").c_str()), 0);
  EXPECT_THAT(with_file("link.safetensors"),
              AllOf(HasSubstr("link.safetensors"), HasSubstr("outside the checkpoint directory")));
}

TEST(IndexJson, MalformedIndicesAreRefusedWithTheReason) {
  const std::string piece_json =
      R"({"file": "a.safetensors", "offsets": [0], "shape": [4], "checksum": "xxh3-64:0000000000000001"})";
  auto index_with = [&](const std::string& tensors,
                        const std::string& head =
                            R"("format": "fsdp_ema", "format_version": 1, "world_size": 1)") {
    return "{" + head + ", \"tensors\": {" + tensors + "}}";
  };
  const std::string good_tensor =
      R"("w": {"dtype": "F32", "shape": [4], "pieces": [)" + piece_json + "]}";
  EXPECT_EQ(parse_index_json(index_with(good_tensor), "i").tensors.at(0).name, "w");
  struct Case {
    std::string text;
    const char* message;
  };
  const Case cases[] = {
      {index_with(good_tensor, R"("format": "other", "format_version": 1, "world_size": 1)"),
       "\"format\" is \"other\", expected \"fsdp_ema\""},
      {index_with(good_tensor, R"("format": "fsdp_ema", "format_version": 2, "world_size": 1)"),
       "unsupported format_version 2"},
      {index_with(good_tensor, R"("format": "fsdp_ema", "format_version": 1, "world_size": 0)"),
       "\"world_size\" must be an integer >= 1"},
      {index_with(good_tensor, R"("format": "fsdp_ema", "format_version": 1)"),
       "missing \"world_size\""},
      {index_with(good_tensor + "," + good_tensor), "duplicate key \"w\""},
      {index_with(R"("w": {"dtype": "Q8", "shape": [4], "pieces": [)" + piece_json + "]}"),
       "tensor \"w\": unknown dtype \"Q8\""},
      {index_with(R"("w": {"dtype": "F32", "shape": [4], "pieces": [{"file": "a.safetensors", )"
                  R"("offsets": [0], "shape": [4], "checksum": "md5:00"}]})"),
       "checksum \"md5:00\" is not"},
      {index_with(R"("w": {"dtype": "F32", "shape": [4], "pieces": [{"file": "../a.safetensors", )"
                  R"("offsets": [0], "shape": [4], "checksum": "xxh3-64:0000000000000001"}]})"),
       "\"../a.safetensors\" contains '/'"},
      {index_with(R"("w": {"dtype": "F32", "shape": [5], "pieces": [)" + piece_json + "]}"),
       "pieces cover 4 of 5 elements"},
      {index_with(R"("w": {"dtype": "F32", "shape": [-4], "pieces": []})"),
       "\"shape\" must be an array of non-negative integers"},
      {index_with(R"("w": {"dtype": "F64", "shape": [4611686018427387904], "pieces": [)" +
                  piece_json + "]}"),
       "global shape [4611686018427387904] of F64 overflows a 64-bit byte count"},
      {"[]", "index is a JSON array"},
      {"{", "invalid JSON"},
  };
  for (const Case& c : cases) {
    EXPECT_THAT(error_of([&] { parse_index_json(c.text, "some/fsdp_ema.index.json"); }),
                AllOf(HasSubstr("some/fsdp_ema.index.json"), HasSubstr(c.message)))
        << c.text;
  }
}

TEST(Index, MissingIndexIsAnIncompleteCheckpoint) {
  TempDir dir;
  write_shard_file(dir.file(shard_file_name(0, 1)), {});
  EXPECT_THAT(error_of([&] { read_index(dir.path()); }),
              AllOf(HasSubstr(dir.path()),
                    HasSubstr("incomplete checkpoint: fsdp_ema.index.json missing")));
  EXPECT_THAT(error_of([&] { read_index(dir.file("nope")); }), HasSubstr("not a directory"));
}

}  // namespace
}  // namespace fsdp_ema::format
