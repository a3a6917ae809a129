// The corruption matrix for one shard file: every damage is a FormatError naming the file (and
// the tensor when there is one) and the problem.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <map>
#include <optional>

#include "fsdp_ema/format/checksum.h"
#include "fsdp_ema/format/safetensors_header.h"
#include "fsdp_ema/format/shard_file.h"
#include "fsdp_ema/format/shard_writer.h"
#include "tests/format/fixture_model.h"
#include "tests/format/header_bytes.h"
#include "tests/format/test_util.h"

namespace fsdp_ema::format {
namespace {

using ::testing::AllOf;
using testing::error_of;
using ::testing::HasSubstr;
using testing::raw_safetensors;
using testing::TempDir;

class ShardCorruption : public ::testing::Test {
 protected:
  void SetUp() override {
    model_ = testing::reference_model();
    std::vector<TensorToWrite> tensors;
    for (const auto& t : model_) {
      tensors.push_back(
          TensorToWrite::full(t.name, t.dtype, t.shape, t.data.empty() ? nullptr : t.data.data()));
    }
    write_shard_file(good_path(), std::move(tensors));
    good_ = testing::read_bytes(good_path());
    header_bytes_ = ShardFile::open(good_path()).header().raw.header_bytes;
  }
  std::string good_path() const { return dir_.file("good.safetensors"); }
  // Writes `bytes` as bad.safetensors and returns the error of opening it with checksums on.
  std::string open_error(const std::vector<std::byte>& bytes) {
    testing::write_bytes(bad_path(), bytes);
    return error_of([&] { ShardFile::open(bad_path(), /*verify_checksums=*/true); });
  }
  std::string bad_path() const { return dir_.file("bad.safetensors"); }

  TempDir dir_;
  std::vector<testing::RefTensor> model_;
  std::vector<std::byte> good_;
  uint64_t header_bytes_ = 0;
};

TEST_F(ShardCorruption, TruncatedFilesAreRefusedWhereverTheCutIs) {
  struct Cut {
    size_t size;
    const char* message;
  };
  const Cut cuts[] = {
      {0, "shorter than the 8-byte header length"},
      {5, "shorter than the 8-byte header length"},
      {8, "runs past the end of the file"},
      {8 + header_bytes_ / 2, "runs past the end of the file"},
      {8 + header_bytes_, "past the end of the data section"},
      {good_.size() - 100, "past the end of the data section ("},
      {good_.size() - 1, "file truncated?"},
  };
  for (const Cut& c : cuts) {
    std::vector<std::byte> bytes(good_.begin(), good_.begin() + static_cast<ptrdiff_t>(c.size));
    EXPECT_THAT(open_error(bytes), AllOf(HasSubstr(bad_path()), HasSubstr(c.message)))
        << "cut at " << c.size;
  }
}

TEST_F(ShardCorruption, FlippedDataByteIsAChecksumErrorNamingTheTensor) {
  const ShardFile f = ShardFile::open(good_path());
  const TensorInfo& t = f.tensor("layer.weight");
  std::vector<std::byte> bytes = good_;
  bytes[t.data_offset + 5] ^= std::byte{0x10};
  EXPECT_THAT(open_error(bytes),
              AllOf(HasSubstr(bad_path()), HasSubstr("tensor \"layer.weight\""),
                    HasSubstr("checksum mismatch"), HasSubstr(format_checksum(*t.checksum))));
  // Without verification the file opens; verifying the tensor then fails, the others pass.
  const ShardFile bad = ShardFile::open(bad_path(), /*verify_checksums=*/false);
  EXPECT_THAT(error_of([&] { bad.verify("layer.weight"); }), HasSubstr("checksum mismatch"));
  EXPECT_TRUE(bad.verify("layer.bias"));
}

TEST_F(ShardCorruption, HeaderGarbageIsInvalidJson) {
  std::vector<std::byte> bytes = good_;
  for (size_t i = 8 + 10; i < 8 + 30; ++i) bytes[i] = std::byte{'#'};
  EXPECT_THAT(open_error(bytes), AllOf(HasSubstr(bad_path()), HasSubstr("invalid JSON")));
  bytes = good_;
  bytes[9] = std::byte{0xff};  // not UTF-8, not JSON
  EXPECT_THAT(open_error(bytes), HasSubstr("invalid JSON"));
  bytes = good_;
  bytes[8] = std::byte{0xff};  // the JSON must start at the first header byte
  EXPECT_THAT(open_error(bytes), HasSubstr("header does not start with '{'"));
}

TEST_F(ShardCorruption, HugeHeaderLengthIsRefusedBeforeReading) {
  std::vector<std::byte> bytes = good_;
  const uint64_t huge = uint64_t{1} << 40;
  std::memcpy(bytes.data(), &huge, 8);  // little-endian host, as the test machines are
  EXPECT_THAT(open_error(bytes), AllOf(HasSubstr("header length 1099511627776 exceeds the "
                                                 "100000000-byte limit"),
                                       HasSubstr(bad_path())));
  const uint64_t past = good_.size();
  std::memcpy(bytes.data(), &past, 8);
  EXPECT_THAT(open_error(bytes), HasSubstr("runs past the end of the file"));
}

TEST_F(ShardCorruption, OffsetErrorsAreNamed) {
  struct Case {
    const char* json;
    size_t data;
    const char* message;
  };
  const Case cases[] = {
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
       R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
       12, "tensor \"b\": data_offsets [4, 12] overlap tensor \"a\" ending at 8"},
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
       R"("b":{"dtype":"F32","shape":[2],"data_offsets":[12,20]}})",
       20, "tensor \"b\": data_offsets [12, 20] leave a gap of 4 bytes after offset 8"},
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 6,
       "tensor \"a\": data_offsets [0, 8] past the end of the data section (6 bytes)"},
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 10,
       "2 trailing bytes after the last tensor"},
      {R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8,
       "tensor \"a\": data_offsets [0, 8] hold 8 bytes but shape [3] of F32 needs 12"},
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", 8, "end before begin"},
      {R"({"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}})", 8,
       "overflows a 64-bit byte count"},
      {R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8,
       "\"shape\" must be an array of non-negative integers"},
      {R"({"a":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}})", 8,
       "\"shape\" must be an array of non-negative integers"},
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0]}})", 8, "must be [begin, end]"},
      {R"({"a":{"dtype":"F4","shape":[2],"data_offsets":[0,8]}})", 8,
       "tensor \"a\": unknown dtype \"F4\""},
      {R"({"a":{"shape":[2],"data_offsets":[0,8]}})", 8, "missing or non-string \"dtype\""},
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
       R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
       8, "duplicate key \"a\""},
      {R"({"__metadata__":{"x":"1","x":"2"}})", 0, "duplicate key \"x\""},
      {R"({"__metadata__":{"x":1}})", 0, "metadata values must be strings"},
      {R"({"__metadata__":[]})", 0, "\"__metadata__\" is a JSON array"},
      {R"({"a":[1,2]})", 0, "tensor \"a\": entry is a JSON array"},
      {R"([1,2,3])", 0, "header does not start with '{'"},
      {R"({"":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}})", 0, "empty name"},
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}} x)", 8, "invalid JSON"},
      {"{\"a\":[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]"
       "]]]]]]]]]]]]]]]]]]]]]]]]}",
       0, "nested deeper than"},
  };
  for (const Case& c : cases) {
    EXPECT_THAT(open_error(raw_safetensors(c.json, c.data)),
                AllOf(HasSubstr(bad_path()), HasSubstr(c.message)))
        << c.json;
  }
}

TEST_F(ShardCorruption, InconsistentFsdpEmaMetadataIsRefused) {
  const std::string tensor = R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  const std::string ours =
      R"("fsdp_ema_format_version":"1","fsdp_ema_rank":"0","fsdp_ema_world_size":"1",)";
  const std::string sum = format_checksum(checksum_of(std::vector<std::byte>(8, std::byte{0xab})));
  struct Case {
    std::string metadata;
    const char* message;
  };
  const Case cases[] = {
      {R"("fsdp_ema_format_version":"2")", "unsupported fsdp_ema_format_version \"2\""},
      {R"("fsdp_ema_format_version":"1")", "lacks metadata key DCP_SHARDING_INFO"},
      {R"("DCP_SHARDING_INFO":"{\"a\":{\"saved_offsets\":[0,0]}}")",
       "saved_offsets must be 1 non-negative integers"},
      {R"("DCP_SHARDING_INFO":"{}")", "DCP_SHARDING_INFO: has no entry for tensor \"a\""},
      {R"("DCP_SHARDING_INFO":"{\"a\":{\"saved_offsets\":[0]},\"b\":{\"saved_offsets\":[0]}}")",
       "names tensor \"b\" that is not in the file"},
      {R"("DCP_SHARDING_INFO":"not json")", "metadata DCP_SHARDING_INFO: invalid JSON"},
      // Our keys are reserved: one without the version is refused, whatever its value.
      {R"("fsdp_ema_checksums":"{\"a\":\"xxh3-64:0000000000000000\"}")",
       "metadata key \"fsdp_ema_checksums\" without fsdp_ema_format_version"},
      {R"("fsdp_ema_world_size":"1")", "metadata key \"fsdp_ema_world_size\" without"},
  };
  for (const Case& c : cases) {
    const std::string json = "{\"__metadata__\":{" + c.metadata + "}," + tensor + "}";
    EXPECT_THAT(open_error(raw_safetensors(json, 8)),
                AllOf(HasSubstr(bad_path()), HasSubstr(c.message)))
        << json;
  }
  // Each of our keys is checked on its own: a complete, consistent set with one entry replaced.
  const std::map<std::string, std::string> complete = {
      {"fsdp_ema_format_version", R"("1")"},
      {"fsdp_ema_rank", R"("0")"},
      {"fsdp_ema_world_size", R"("1")"},
      {"DCP_SHARDING_INFO", R"("{\"a\":{\"saved_offsets\":[0]}}")"},
      {"fsdp_ema_global_shapes", R"("{\"a\":[2]}")"},
      {"fsdp_ema_checksums", R"("{\"a\":\")" + sum + R"(\"}")"},
  };
  struct Replaced {
    std::map<std::string, std::string> entries;
    const char* message;
  };
  const Replaced replaced[] = {
      {{{"DCP_SHARDING_INFO", R"("{\"a\":{\"saved_offsets\":[3]}}")"},
        {"fsdp_ema_global_shapes", R"("{\"a\":[4]}")"}},
       "offsets [3] + shape [2] exceed global shape [4] in dimension 0"},
      {{{"fsdp_ema_checksums", R"("{\"a\":\"xxh3-64:XYZ\"}")"}},
       "is not \"xxh3-64:<16 lowercase hex"},
      {{{"fsdp_ema_checksums", R"("{\"a\":\"xxh3-64:0000000000000000\"}")"}}, "checksum mismatch"},
      {{{"fsdp_ema_rank", R"("3")"}, {"fsdp_ema_world_size", R"("2")"}},
       "not an integer in [0, world size)"},
      {{{"fsdp_ema_world_size", R"("0")"}}, "is not a positive integer"},
  };
  for (const Replaced& c : replaced) {
    std::map<std::string, std::string> md = complete;
    for (const auto& [k, v] : c.entries) md[k] = v;
    std::string json = "{\"__metadata__\":{";
    for (const auto& [k, v] : md) json += "\"" + k + "\":" + v + ",";
    json.back() = '}';
    json += "," + tensor + "}";
    EXPECT_THAT(open_error(raw_safetensors(json, 8)),
                AllOf(HasSubstr(bad_path()), HasSubstr(c.message)))
        << json;
  }
  // The complete, consistent form opens.
  const std::string json = "{\"__metadata__\":{" + ours +
                           R"("DCP_SHARDING_INFO":"{\"a\":{\"saved_offsets\":[2]}}",)"
                           R"("fsdp_ema_global_shapes":"{\"a\":[4]}",)"
                           R"("fsdp_ema_checksums":"{\"a\":\")" +
                           sum + R"(\"}"},)" + tensor + "}";
  testing::write_bytes(bad_path(), raw_safetensors(json, 8));
  const ShardFile f = ShardFile::open(bad_path());
  EXPECT_EQ(f.tensor("a").offsets, Shape{2});
  EXPECT_EQ(f.tensor("a").global_shape, Shape{4});
}

// The block-checksum extension (#33): both keys or neither, a power-of-two block size in range,
// exactly the tensors of more than one block listed, 16 lowercase hex digits per block, and (#41)
// their seal, which binds them to the checksums: a consistent set opens, a wrong block is a
// mismatch naming the block, a seal of other checksums is refused before any data is read, and
// block checksums without a seal (written before it) are not used.
TEST_F(ShardCorruption, InconsistentBlockChecksumsAreRefused) {
  const std::string tensors = R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                              R"("b":{"dtype":"F32","shape":[32],"data_offsets":[8,136]})";
  const std::vector<std::byte> ab(128, std::byte{0xab});
  auto hex = [](uint64_t v) { return format_checksum(v).substr(8); };
  const std::string sum_a = format_checksum(checksum_of(ab.data(), 8));
  const std::string sum_b = format_checksum(checksum_of(ab.data(), 128));
  const std::string block = hex(checksum_of(ab.data(), 64));  // both blocks of b are alike
  auto blocks = [&](const std::string& second, std::optional<uint64_t> sealed_second = {}) {
    const uint64_t first = checksum_of(ab.data(), 64);
    ChecksumSeal seal;
    const uint64_t b[2] = {first, sealed_second.value_or(*parse_checksum_digits(second))};
    seal.add(checksum_of(ab.data(), 128), b);
    return R"(,"fsdp_ema_checksum_block_bytes":"64","fsdp_ema_block_checksums":"{\"b\":\")" +
           block + second + R"(\"}","fsdp_ema_checksum_seal":")" + format_checksum(seal.digest()) +
           "\"";
  };
  auto file = [&](const std::string& extra) {
    return "{\"__metadata__\":{"
           R"("fsdp_ema_format_version":"1","fsdp_ema_rank":"0","fsdp_ema_world_size":"1",)"
           R"("DCP_SHARDING_INFO":"{\"a\":{\"saved_offsets\":[0]},\"b\":{\"saved_offsets\":[0]}}",)"
           R"("fsdp_ema_global_shapes":"{\"a\":[2],\"b\":[32]}",)"
           R"("fsdp_ema_checksums":"{\"a\":\")" +
           sum_a + R"(\",\"b\":\")" + sum_b + "\\\"}\"" + extra + "}," + tensors + "}";
  };
  struct Case {
    std::string extra;
    const char* message;
  };
  const Case cases[] = {
      {R"(,"fsdp_ema_checksum_block_bytes":"64")",
       "fsdp_ema_checksum_block_bytes without fsdp_ema_block_checksums"},
      {R"(,"fsdp_ema_block_checksums":"{}")",
       "fsdp_ema_block_checksums without fsdp_ema_checksum_block_bytes"},
      {R"(,"fsdp_ema_checksum_block_bytes":"100","fsdp_ema_block_checksums":"{}")",
       "is not a power of two in [64, 16777216]"},
      {R"(,"fsdp_ema_checksum_block_bytes":"32","fsdp_ema_block_checksums":"{}")",
       "is not a power of two"},
      {R"(,"fsdp_ema_checksum_block_bytes":"64","fsdp_ema_block_checksums":"{}")",
       "has no entry for tensor \"b\""},
      {R"(,"fsdp_ema_checksum_block_bytes":"64","fsdp_ema_block_checksums":"{\"b\":\")" + block +
           R"(\"}")",
       "must be a string of 2 x 16 lowercase hex digits"},
      {R"(,"fsdp_ema_checksum_block_bytes":"64","fsdp_ema_block_checksums":"{\"b\":\")" + block +
           block + R"(\",\"a\":\"0000000000000000\"}")",
       "has an entry for tensor \"a\", which must have none"},
      {R"(,"fsdp_ema_checksum_block_bytes":"64","fsdp_ema_block_checksums":"{\"b\":\")" + block +
           "ABCDEF0123456789" + R"(\"}")",
       "lowercase hex digits"},
      {blocks("0000000000000000"), "checksum mismatch in block 1"},
      {R"(,"fsdp_ema_checksum_seal":"xxh3-64:0000000000000000")",
       "fsdp_ema_checksum_seal without fsdp_ema_block_checksums"},
      {R"(,"fsdp_ema_checksum_block_bytes":"64","fsdp_ema_block_checksums":"{\"b\":\")" + block +
           block + R"(\"}","fsdp_ema_checksum_seal":"xxh3-64:00")",
       "metadata fsdp_ema_checksum_seal \"xxh3-64:00\" is not"},
      // The blocks agree with the data but not with the seal: one kind changed without the other.
      {blocks(block, uint64_t{1}), "disagree with each other"},
  };
  for (const Case& c : cases) {
    const std::string json = file(c.extra);
    EXPECT_THAT(open_error(raw_safetensors(json, 136)),
                AllOf(HasSubstr(bad_path()), HasSubstr(c.message)))
        << json;
  }
  testing::write_bytes(bad_path(), raw_safetensors(file(blocks(block)), 136));
  const ShardFile f = ShardFile::open(bad_path());
  EXPECT_EQ(f.header().block_bytes, 64u);
  EXPECT_EQ(f.tensor("b").block_checksums.size(), 2u);
  // Unsealed: not used (a wrong block included); the checksums verify the tensors.
  testing::write_bytes(
      bad_path(),
      raw_safetensors(
          file(R"(,"fsdp_ema_checksum_block_bytes":"64","fsdp_ema_block_checksums":"{\"b\":\")" +
               block + "0000000000000000" + R"(\"}")"),
          136));
  const ShardFile unsealed = ShardFile::open(bad_path());
  EXPECT_EQ(unsealed.header().block_bytes, 0u);
  EXPECT_TRUE(unsealed.tensor("b").block_checksums.empty());
  EXPECT_TRUE(unsealed.verify("b"));
}

TEST_F(ShardCorruption, SpecialFilesAreRefusedWithoutBlocking) {
  ASSERT_EQ(::mkfifo(dir_.file("fifo.safetensors").c_str(), 0644), 0);
  EXPECT_THAT(error_of([&] { ShardFile::open(dir_.file("fifo.safetensors")); }),
              AllOf(HasSubstr("fifo.safetensors"), HasSubstr("not a regular file")));
  EXPECT_THAT(error_of([&] { ShardFile::open(dir_.path()); }), HasSubstr("not a regular file"));
  EXPECT_THAT(
      error_of([&] { ShardFile::open(dir_.file("missing.safetensors")); }),
      AllOf(HasSubstr("missing.safetensors: cannot open"), HasSubstr("No such file or directory")));
}

TEST(SafetensorsHeader, AcceptsWhatTheReferenceAcceptsAndSerializesAligned) {
  // Unknown entry fields are ignored; tensors may appear in any order in the JSON.
  const auto bytes = raw_safetensors(
      R"({"b":{"dtype":"U8","shape":[2],"data_offsets":[4,6],"extra":true},)"
      R"("a":{"dtype":"I16","shape":[2],"data_offsets":[0,4]},"z":{"dtype":"F32","shape":[0],)"
      R"("data_offsets":[6,6]}})",
      6);
  const SafetensorsHeader h = testing::parse_safetensors_bytes(bytes, "mem");
  ASSERT_EQ(h.tensors.size(), 3u);
  EXPECT_EQ(h.tensors[0].name, "a");
  EXPECT_EQ(h.tensors[1].name, "b");
  EXPECT_EQ(h.tensors[2].name, "z");
  EXPECT_FALSE(h.has_metadata);

  const Shape shape = {2};
  const std::vector<HeaderEntry> tensors = {{"x", DType::kF32, shape, 0, 8}};
  for (uint64_t align : {1u, 8u, 64u, 4096u}) {
    const std::string s = serialize_safetensors_header(tensors, {{"k", "v\"q"}}, true, align);
    EXPECT_EQ(s.size() % align, 0u);
    const std::string json = s.substr(8);
    const SafetensorsHeader p = parse_safetensors_header(json, s.size() + 8, "mem");
    EXPECT_EQ(p.metadata.at("k"), "v\"q");
    EXPECT_EQ(p.tensors.at(0).end, 8u);
  }
}

}  // namespace
}  // namespace fsdp_ema::format
