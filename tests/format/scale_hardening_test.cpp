// Scale and hardening of the format: parses and coverage checks that stay linear (or n log n) on
// crafted input, owned reads that a truncation or rewrite cannot turn into SIGBUS or wrong data,
// and the edges an attack found (BOM, NUL padding, BOOL bytes, zero-element shapes whose strides
// overflow, a symlinked index).
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "fsdp_ema/format/checkpoint_dir.h"
#include "fsdp_ema/format/checksum.h"
#include "fsdp_ema/format/index.h"
#include "fsdp_ema/format/json_strict.h"
#include "fsdp_ema/format/name_index.h"
#include "fsdp_ema/format/safetensors_header.h"
#include "fsdp_ema/format/shard_file.h"
#include "fsdp_ema/format/shard_writer.h"
#include "tests/format/read_helpers.h"
#include "tests/format/test_util.h"

namespace fsdp_ema::format {
namespace {

using ::testing::AllOf;
using testing::error_of;
using ::testing::HasSubstr;
using testing::raw_safetensors;
using testing::TempDir;

// A generous wall-clock bound for work that the quadratic code it replaced took minutes on: this
// asserts the complexity class, not a speed (a few MB of input, done in well under a second).
constexpr double kBoundSeconds = 5.0;

double seconds_of(const std::function<void()>& f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

std::string sum_text(uint64_t v) { return format_checksum(v); }

// {"format": ..., "tensors": {"w": {"dtype": "U8", "shape": shape, "pieces": pieces}}}
std::string one_tensor_index(const std::string& shape, const std::string& pieces) {
  return R"({"format": "fsdp_ema", "format_version": 1, "world_size": 1, "tensors": {"w": )"
         R"({"dtype": "U8", "shape": )" +
         shape + R"(, "pieces": [)" + pieces + "]}}}";
}

std::string piece(int64_t r, int64_t c, int64_t rows, int64_t cols) {
  return R"({"file": "a.safetensors", "offsets": [)" + std::to_string(r) + "," + std::to_string(c) +
         R"(], "shape": [)" + std::to_string(rows) + "," + std::to_string(cols) +
         R"(], "checksum": ")" + sum_text(1) + "\"}";
}

TEST(Scale, HeaderOfManyTensorsParsesInLinearTime) {
  // 60,000 tensor entries (~4 MB of JSON): the callback parser this replaced rescanned the parent
  // object after every entry (20,000 entries took 22 s).
  constexpr int kTensors = 60'000;
  std::string json = "{";
  for (int i = 0; i < kTensors; ++i) {
    if (i > 0) json += ',';
    json += "\"layers." + std::to_string(i) + ".weight\":{\"dtype\":\"F32\",\"shape\":[1],";
    json += "\"data_offsets\":[" + std::to_string(4 * i) + "," + std::to_string(4 * i + 4) + "]}";
  }
  json += '}';
  SafetensorsHeader h;
  const double s = seconds_of(
      [&] { h = parse_safetensors_header(json, 8 + json.size() + 4 * kTensors, "big"); });
  EXPECT_EQ(h.tensors.size(), static_cast<size_t>(kTensors));
  EXPECT_EQ(h.tensors.back().end, uint64_t{4} * kTensors);
  EXPECT_LT(s, kBoundSeconds);
}

// 300,000 names with one std::hash (test_util.h): a table keyed by the unseeded hash walks the
// whole chain on every insert (a 2.4 MB header took 12 s); the seeded hash spreads them.
std::vector<std::string> colliding_names() {
  static const std::vector<std::string> names = [] {
    auto out = testing::names_colliding_under_std_hash(300'000);
    const size_t h = std::hash<std::string_view>{}(out.front());
    for (const std::string& n : out) {
      if (std::hash<std::string_view>{}(n) != h) throw std::runtime_error("not colliding");
    }
    return out;
  }();
  return names;
}

TEST(Scale, NameIndexProbesStayLinearOnNamesCraftedToCollide) {
  const std::vector<std::string> names = colliding_names();
  detail::NameIndex index;
  for (size_t i = 0; i < names.size(); ++i) {
    ASSERT_FALSE(index.insert(names[i], i).has_value()) << "false duplicate at " << i;
    // Fail at once rather than after minutes of a quadratic walk: at a load factor <= 1/2, a
    // random hash makes about 1.5 probes an insert.
    if (i % 1024 == 0) {
      ASSERT_LE(index.probes(), 4 * (i + 1) + 64) << "after " << i << " names";
    }
  }
  for (size_t i = 0; i < names.size(); ++i) ASSERT_EQ(index.find(names[i]), i);
  EXPECT_LE(index.probes(), 8 * names.size());
  EXPECT_EQ(index.insert(names[123], 7), 123u);  // a true duplicate is still one
}

TEST(Scale, HeaderOfNamesCraftedToCollideParsesInLinearWork) {
  // ~22 MB of header: every name lands in the tensor index and the JSON reader's duplicate-key
  // check, the two tables the unseeded hash made quadratic. Counted in hash-table probes, not
  // seconds (a clock fails under a sanitizer on a busy machine; a count fails only on the bug):
  // the unseeded hash walked the whole chain, ~n^2/2 = 4.5e10 probes for these 300,000 names.
  const std::vector<std::string> names = colliding_names();
  std::string json = "{";
  for (size_t i = 0; i < names.size(); ++i) {
    if (i > 0) json += ',';
    json += detail::json_quote(names[i]) + ":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[" +
            std::to_string(i) + "," + std::to_string(i + 1) + "]}";
  }
  json += '}';
  size_t& probes = detail::NameIndex::thread_probes();
  const size_t before = probes;
  const SafetensorsHeader h = parse_safetensors_header(json, 8 + json.size() + names.size(), "c");
  ASSERT_EQ(h.tensors.size(), names.size());
  const size_t header_probes = probes - before;
  EXPECT_GE(header_probes, names.size()) << "every name goes through a table";
  EXPECT_LE(header_probes, 16 * names.size()) << "header parse";
  // The same names as an index's tensors: parsed (names, coverage) in linear work as well.
  std::string index =
      R"({"format": "fsdp_ema", "format_version": 1, "world_size": 1, "tensors": {)";
  constexpr size_t kIndexed = 100'000;
  for (size_t i = 0; i < kIndexed; ++i) {
    if (i > 0) index += ',';
    index += detail::json_quote(names[i]) + R"(:{"dtype":"U8","shape":[1],"pieces":[{"file":)" +
             R"("shard-00000-of-00001.safetensors","offsets":[0],"shape":[1],"checksum":")" +
             sum_text(i) + "\"}]}";
  }
  index += "}}";
  const size_t before_index = probes;
  const CheckpointIndex parsed = parse_index_json(index, "i");
  EXPECT_EQ(parsed.tensors.size(), kIndexed);
  // (The index's tensors are checked for repeats by sorting, n log n on any input: no table.)
  const size_t index_probes = probes - before_index;
  EXPECT_LE(index_probes, 16 * kIndexed) << "index parse";
  std::printf("probes per name: header %.2f, index %.2f\n",
              static_cast<double>(header_probes) / names.size(),
              static_cast<double>(index_probes) / kIndexed);
}

TEST(Scale, DuplicateKeyIsFoundAmongManyEntries) {
  std::string json = "{";
  for (int i = 0; i < 50'000; ++i)
    json += "\"k" + std::to_string(i) + "\":" + std::to_string(i) + ",";
  json += "\"k123\":1}";
  EXPECT_THAT(error_of([&] { parse_safetensors_header(json, 8 + json.size(), "dup"); }),
              HasSubstr("duplicate key \"k123\""));
}

TEST(Scale, CraftedStaircaseIndexIsRefusedInBoundedTime) {
  // Piece i covers rows [i, P) of column i: every pair overlaps along dim 0 and none overlaps,
  // so the old sweep compared all P^2 / 2 pairs (16,000 pieces took 10.7 s). Its grid has P^2
  // cells, far more than any writer's layout: refused as irregular without pairwise work.
  constexpr int64_t kPieces = 40'000;
  std::string pieces;
  for (int64_t i = 0; i < kPieces; ++i) {
    if (i > 0) pieces += ',';
    pieces += piece(i, i, kPieces - i, 1);
  }
  const std::string text =
      one_tensor_index("[" + std::to_string(kPieces) + "," + std::to_string(kPieces) + "]", pieces);
  EXPECT_GT(text.size(), size_t{4} << 20);
  std::string error;
  const double s = seconds_of([&] { error = error_of([&] { parse_index_json(text, "i"); }); });
  EXPECT_THAT(error, AllOf(HasSubstr("tensor \"w\""), HasSubstr("irregular layout")));
  EXPECT_LT(s, kBoundSeconds);
}

TEST(Scale, LargeGridIndexIsAcceptedAndOverlapsAreNamed) {
  // A 256 x 256 grid of pieces (TP x FSDP style): 65,536 pieces, one cell each.
  constexpr int64_t kSide = 256;
  std::string pieces;
  for (int64_t r = 0; r < kSide; ++r) {
    for (int64_t c = 0; c < kSide; ++c) {
      if (!pieces.empty()) pieces += ',';
      pieces += piece(2 * r, 3 * c, 2, 3);
    }
  }
  const std::string shape = "[" + std::to_string(2 * kSide) + "," + std::to_string(3 * kSide) + "]";
  CheckpointIndex index;
  const double s =
      seconds_of([&] { index = parse_index_json(one_tensor_index(shape, pieces), "i"); });
  EXPECT_EQ(index.tensors.at(0).pieces.size(), static_cast<size_t>(kSide * kSide));
  EXPECT_LT(s, kBoundSeconds);

  // Bricks (rows of uneven pieces offset from the row above) are grid-aligned enough to accept.
  const std::string bricks = piece(0, 0, 1, 2) + "," + piece(0, 2, 1, 2) + "," + piece(1, 0, 1, 1) +
                             "," + piece(1, 1, 1, 2) + "," + piece(1, 3, 1, 1);
  EXPECT_EQ(parse_index_json(one_tensor_index("[2,4]", bricks), "i").tensors.at(0).pieces.size(),
            5u);

  // One cell painted twice names both pieces; a hole is a coverage error.
  const std::string overlap = piece(0, 0, 2, 2) + "," + piece(1, 1, 1, 1) + "," + piece(0, 2, 2, 2);
  EXPECT_THAT(error_of([&] { parse_index_json(one_tensor_index("[2,4]", overlap), "i"); }),
              AllOf(HasSubstr("pieces overlap"), HasSubstr("offsets [0, 0] with shape [2, 2]"),
                    HasSubstr("offsets [1, 1] with shape [1, 1]")));
  const std::string hole = piece(0, 0, 2, 2) + "," + piece(0, 2, 1, 2);
  EXPECT_THAT(error_of([&] { parse_index_json(one_tensor_index("[2,4]", hole), "i"); }),
              HasSubstr("pieces cover 6 of 8 elements"));
}

class Hardening : public ::testing::Test {
 protected:
  std::string path() const { return dir_.file("x.safetensors"); }
  std::string open_error(const std::vector<std::byte>& bytes) const {
    testing::write_bytes(path(), bytes);
    return error_of([&] { ShardFile::open(path()); });
  }
  TempDir dir_;
};

TEST_F(Hardening, ByteOrderMarkAndNulPaddingAreRefused) {
  const std::string json = R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})";
  EXPECT_NO_THROW({
    testing::write_bytes(path(), raw_safetensors(json, 4));
    ShardFile::open(path());
  });
  EXPECT_THAT(open_error(raw_safetensors("\xEF\xBB\xBF" + json, 4)),
              AllOf(HasSubstr(path()), HasSubstr("byte order mark")));
  std::string nul = json;
  nul.append(4, '\0');
  EXPECT_THAT(open_error(raw_safetensors(nul, 4)),
              AllOf(HasSubstr(path()), HasSubstr("NUL byte at offset")));
}

TEST_F(Hardening, BoolBytesOtherThanZeroOrOneAreRefused) {
  const std::string json = R"({"m":{"dtype":"BOOL","shape":[4],"data_offsets":[0,4]}})";
  auto bytes = raw_safetensors(json, 4, 0);
  testing::write_bytes(path(), bytes);
  EXPECT_NO_THROW(ShardFile::open(path()).verify_all());
  bytes.back() = std::byte{2};
  testing::write_bytes(path(), bytes);
  // No checksum stored, but the verdict of a verified open is a read's: refused.
  EXPECT_THAT(error_of([&] { ShardFile::open(path()); }), HasSubstr("BOOL byte 2"));
  const ShardFile f = ShardFile::open(path(), /*verify_checksums=*/false);
  std::vector<std::byte> out(4);
  EXPECT_THAT(error_of([&] { f.read(f.tensor("m"), 0, 4, out.data()); }),
              AllOf(HasSubstr(path()), HasSubstr("tensor \"m\""), HasSubstr("BOOL byte 2")));
}

TEST_F(Hardening, ZeroElementShapeWhoseStridesOverflowIsRefused) {
  // No element, but torch's contiguous strides (products of max(size, 1)) would overflow.
  const std::string json =
      R"({"z":{"dtype":"F32","shape":[0,4611686018427387904,4],"data_offsets":[0,0]}})";
  EXPECT_THAT(open_error(raw_safetensors(json, 0)),
              AllOf(HasSubstr(path()), HasSubstr("tensor \"z\""), HasSubstr("overflows")));
  const std::string fine = R"({"z":{"dtype":"F32","shape":[0,1024,4],"data_offsets":[0,0]}})";
  testing::write_bytes(path(), raw_safetensors(fine, 0));
  EXPECT_EQ(ShardFile::open(path()).tensor("z").nbytes, 0u);
}

// A committed one-rank checkpoint of one U8 tensor of `n` bytes with values i % 251.
void write_checkpoint(const std::string& dir, size_t n, uint8_t salt = 0) {
  std::vector<std::byte> data(n);
  for (size_t i = 0; i < n; ++i) data[i] = std::byte((i + salt) % 251);
  write_shard_file(dir + "/" + shard_file_name(0, 1),
                   {TensorToWrite::full("w", DType::kU8, {static_cast<int64_t>(n)}, data.data())});
  write_index(dir, testing::index_of_rank_files(dir, 1));
}

TEST_F(Hardening, SymlinkedIndexIsRefused) {
  const std::string real = dir_.subdir("real");
  write_checkpoint(real, 16);
  const std::string linked = dir_.subdir("linked");
  std::filesystem::copy_file(real + "/" + shard_file_name(0, 1),
                             linked + "/" + shard_file_name(0, 1));
  ASSERT_EQ(::symlink((real + "/" + std::string(kIndexFileName)).c_str(),
                      (linked + "/" + std::string(kIndexFileName)).c_str()),
            0);
  EXPECT_THAT(error_of([&] { CheckpointDir::open(linked); }),
              AllOf(HasSubstr(std::string(kIndexFileName)), HasSubstr("a symbolic link")));
  EXPECT_NO_THROW(CheckpointDir::open(real));
}

TEST_F(Hardening, ReadsAfterTruncationAreErrorsNotSignals) {
  const std::string ckpt = dir_.subdir("c");
  write_checkpoint(ckpt, 1 << 20);
  const CheckpointDir dir = CheckpointDir::open(ckpt);
  std::vector<std::byte> before(1 << 20);
  dir.read_full("w", before.data(), before.size(), /*verify=*/true);
  ASSERT_EQ(::truncate((ckpt + "/" + shard_file_name(0, 1)).c_str(), 4096), 0);
  // What was read is the caller's: unchanged. A new read of the lost bytes is a clear error.
  for (size_t i = 0; i < before.size(); i += 4099) EXPECT_EQ(before[i], std::byte(i % 251));
  std::vector<std::byte> again(1 << 20);
  EXPECT_THAT(error_of([&] { dir.read_full("w", again.data(), again.size(), /*verify=*/false); }),
              AllOf(HasSubstr(shard_file_name(0, 1)), HasSubstr("unexpected end of file")));
}

TEST_F(Hardening, FileRewrittenAfterItsDescriptorWasEvictedIsRefused) {
  const std::string ckpt = dir_.subdir("c");
  write_checkpoint(ckpt, 4096);
  const ShardFile f = ShardFile::open(ckpt + "/" + shard_file_name(0, 1));
  // Open more files than the descriptor cache holds, so f's descriptor is closed.
  std::vector<ShardFile> others;
  for (int i = 0; i < 140; ++i) {
    const std::string d = dir_.subdir("o" + std::to_string(i));
    write_checkpoint(d, 8);
    others.push_back(ShardFile::open(d + "/" + shard_file_name(0, 1)));
  }
  // Rewritten in place with other bytes (same inode): reopening sees another size and mtime.
  write_checkpoint(dir_.subdir("n"), 8192, 7);
  testing::write_bytes(ckpt + "/" + shard_file_name(0, 1),
                       testing::read_bytes(dir_.file("n/" + shard_file_name(0, 1))));
  std::vector<std::byte> out(4096);
  EXPECT_THAT(error_of([&] { f.read(f.tensor("w"), 0, out.size(), out.data()); }),
              AllOf(HasSubstr(shard_file_name(0, 1)), HasSubstr("changed since it was opened")));
}

}  // namespace
}  // namespace fsdp_ema::format
