// export_consolidated: Hugging Face layout, splitting, casting, atomic replacement.
#include "fsdp_ema/format/export.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <utility>
#include <vector>

#include "fsdp_ema/format/checkpoint_dir.h"
#include "fsdp_ema/format/dtype_cast.h"
#include "fsdp_ema/format/shard_file.h"
#include "tests/format/fixture_model.h"
#include "tests/format/reference_checkpoint.h"
#include "tests/format/test_util.h"

namespace fsdp_ema::format {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using testing::error_of;
using ::testing::HasSubstr;

// bf16 bits of one element, round to nearest even, computed independently of
// fsdp_ema/format/dtype_cast.h: the usual bit trick on the float value (a NaN keeps its top payload
// bits, made quiet). A double is first rounded to float, and the one case where that double
// rounding errs (the float lands exactly on a bf16 tie the double was not on) is decided by the
// double itself.
uint16_t reference_bf16(DType from, const std::byte* src) {
  float f = 0;
  double d = 0;
  switch (from) {
    case DType::kF32:
      std::memcpy(&f, src, 4);
      d = f;
      break;
    case DType::kF64:
      std::memcpy(&d, src, 8);
      f = static_cast<float>(d);
      break;
    case DType::kF16: {  // widening is exact: decode the fields
      uint16_t h;
      std::memcpy(&h, src, 2);
      const int exp = (h >> 10) & 0x1F;
      const int mant = h & 0x3FF;
      const float mag = exp == 0    ? std::ldexp(static_cast<float>(mant), -24)
                        : exp == 31 ? (mant ? std::numeric_limits<float>::quiet_NaN()
                                            : std::numeric_limits<float>::infinity())
                                    : std::ldexp(static_cast<float>(1024 + mant), exp - 25);
      f = (h & 0x8000) ? -mag : mag;
      if (exp == 31 && mant) {  // keep the NaN payload: f16 bits 9..0 are f32 bits 22..13
        f = std::bit_cast<float>(((h & 0x8000u) << 16) | 0x7F800000u |
                                 (static_cast<uint32_t>(mant) << 13));
      }
      d = f;
      break;
    }
    case DType::kBF16: {
      uint16_t b;
      std::memcpy(&b, src, 2);
      return b;
    }
    default:
      ADD_FAILURE() << "not a floating dtype";
      return 0;
  }
  const uint32_t bits = std::bit_cast<uint32_t>(f);
  if (std::isnan(f)) return static_cast<uint16_t>((bits >> 16) | 0x0040);
  if ((bits & 0xFFFF) == 0x8000 && !std::isnan(d) && static_cast<double>(f) != d) {
    // Not a tie in the double: round toward it (away from zero if its magnitude is larger).
    const bool up = std::fabs(d) > std::fabs(static_cast<double>(f));
    return static_cast<uint16_t>((bits >> 16) + (up ? 1 : 0));
  }
  return static_cast<uint16_t>((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

class Export : public testing::ReferenceCheckpointTest<3> {};

TEST_F(Export, OneFileHoldsEveryFullTensor) {
  const std::string out = root_.file("out");
  std::vector<ExportProgress> seen;
  ExportOptions o;
  o.progress = [&](const ExportProgress& p) { seen.push_back(p); };
  const ExportResult r = export_consolidated(ckpt_, out, o);
  EXPECT_THAT(r.files, ElementsAre("model.safetensors"));
  EXPECT_FALSE(r.wrote_index);
  EXPECT_THAT(testing::list_names(out), ElementsAre("model.safetensors"));
  const ShardFile f = ShardFile::open(out + "/model.safetensors");
  EXPECT_EQ(f.metadata(), (std::map<std::string, std::string>{{"format", "pt"}}));
  uint64_t total = 0;
  for (const auto& t : model_) {
    const TensorInfo& info = f.tensor(t.name);
    EXPECT_EQ(info.dtype, t.dtype);
    EXPECT_EQ(info.shape, t.shape);
    EXPECT_EQ(info.data_offset % dtype_size(t.dtype), 0u);
    const auto mapping = f.map();
    const auto bytes = mapping->data(info);
    EXPECT_TRUE(std::equal(bytes.begin(), bytes.end(), t.data.begin(), t.data.end())) << t.name;
    total += t.data.size();
  }
  EXPECT_EQ(r.total_size, total);
  ASSERT_FALSE(seen.empty());
  for (size_t i = 1; i < seen.size(); ++i) EXPECT_GE(seen[i].bytes_done, seen[i - 1].bytes_done);
  EXPECT_EQ(seen.back().bytes_done, total);
  EXPECT_EQ(seen.back().bytes_total, total);
  // The export is itself a readable checkpoint directory (one piece per tensor).
  const CheckpointDir back = CheckpointDir::open(out);
  EXPECT_EQ(back.tensors().size(), model_.size());
}

TEST_F(Export, SplitsAboveTheSizeLimitWithAHuggingFaceIndex) {
  const std::string out = root_.file("out");
  ExportOptions o;
  o.max_file_bytes = 150;
  const ExportResult r = export_consolidated(ckpt_, out, o);
  ASSERT_GT(r.files.size(), 2u);
  const size_t n = r.files.size();
  for (size_t k = 0; k < n; ++k) {
    char want[64];
    std::snprintf(want, sizeof(want), "model-%05zu-of-%05zu.safetensors", k + 1, n);
    EXPECT_EQ(r.files[k], want);
  }
  EXPECT_TRUE(r.wrote_index);
  const auto index =
      nlohmann::json::parse(testing::read_text(out + "/model.safetensors.index.json"));
  EXPECT_EQ(index.at("metadata").at("total_size"), r.total_size);
  const auto& map = index.at("weight_map");
  EXPECT_EQ(map.size(), model_.size());
  for (const auto& t : model_) {
    const std::string file = map.at(t.name);
    const ShardFile f = ShardFile::open(out + "/" + file);
    const auto mapping = f.map();
    const auto bytes = mapping->data(f.tensor(t.name));
    EXPECT_TRUE(std::equal(bytes.begin(), bytes.end(), t.data.begin(), t.data.end())) << t.name;
  }
  for (const std::string& file : r.files) {
    const ShardFile f = ShardFile::open(out + "/" + file);
    uint64_t data = 0;
    for (const auto& t : f.tensors()) data += t.nbytes;
    // Over the limit only when a single tensor is larger than it ("big.f64" is 432 bytes).
    if (f.tensors().size() > 1) {
      EXPECT_LE(data, 150u) << file;
    }
  }
}

TEST_F(Export, CastsFloatingTensorsAndKeepsIntegers) {
  const std::string out = root_.file("out");
  ExportOptions o;
  o.dtype = DType::kBF16;
  export_consolidated(ckpt_, out, o);
  const ShardFile f = ShardFile::open(out + "/model.safetensors");
  for (const auto& t : model_) {
    const TensorInfo& info = f.tensor(t.name);
    const bool castable = can_cast(t.dtype, DType::kBF16);
    EXPECT_EQ(info.dtype, castable ? DType::kBF16 : t.dtype) << t.name;
    const auto mapping = f.map();
    const auto bytes = mapping->data(info);
    if (!castable) {
      EXPECT_TRUE(std::equal(bytes.begin(), bytes.end(), t.data.begin(), t.data.end()));
      continue;
    }
    // The expected bytes from a reference of our own (not cast_elements, the code under test).
    const size_t n = t.data.size() / dtype_size(t.dtype);
    ASSERT_EQ(bytes.size(), n * 2) << t.name;
    for (size_t i = 0; i < n; ++i) {
      uint16_t got;
      std::memcpy(&got, bytes.data() + 2 * i, 2);
      EXPECT_EQ(got, reference_bf16(t.dtype, t.data.data() + i * dtype_size(t.dtype)))
          << t.name << "[" << i << "]";
    }
  }
}

TEST_F(Export, RefusesToClobberAnEarlierExportUnlessAsked) {
  const std::string out = root_.file("out");
  ExportOptions split;
  split.max_file_bytes = 150;
  export_consolidated(ckpt_, out, split);
  EXPECT_THAT(error_of([&] { export_consolidated(ckpt_, out); }),
              AllOf(HasSubstr(out), HasSubstr("already holds model"), HasSubstr("overwrite")));
  ExportOptions o;
  o.overwrite = true;
  export_consolidated(ckpt_, out, o);
  // The numbered files and index of the earlier export are gone: only the new file remains.
  EXPECT_THAT(testing::list_names(out), ElementsAre("model.safetensors"));
}

TEST_F(Export, RefusesTheCheckpointDirectoryItselfOrInsideItByInode) {
  // The same directory by another path, a new directory inside it, and a link to it: all refused
  // before anything is created.
  std::filesystem::create_directory_symlink(ckpt_, root_.file("link"));
  for (const std::string& out :
       {ckpt_ + "/.", ckpt_ + "/", ckpt_ + "/../ckpt", ckpt_ + "/sub", ckpt_ + "/sub/deeper",
        root_.file("link"), root_.file("link") + "/sub"}) {
    EXPECT_THAT(error_of([&] { export_consolidated(ckpt_, out); }),
                HasSubstr("must go outside the checkpoint directory"))
        << out;
  }
  EXPECT_FALSE(std::filesystem::exists(ckpt_ + "/sub"));
  // A sibling whose name starts like the checkpoint's is outside it.
  EXPECT_NO_THROW(export_consolidated(ckpt_, ckpt_ + "-export"));
}

TEST_F(Export, RefusesAPathWithANulByteAndCreatesNothing) {
  const std::string out = root_.file("new") + std::string(1, '\0') + "dir";
  EXPECT_THAT(error_of([&] { export_consolidated(ckpt_, out); }),
              AllOf(HasSubstr("new\\x00dir"), HasSubstr("holds a NUL byte at offset")));
  EXPECT_FALSE(std::filesystem::exists(root_.file("new")));
}

TEST_F(Export, StopsOnCorruptedData) {
  const std::string file = ckpt_ + "/" + shard_file_name(0, 3);
  auto bytes = testing::read_bytes(file);
  bytes[ShardFile::open(file).tensor("ids").data_offset] ^= std::byte{1};
  testing::write_bytes(file, bytes);
  EXPECT_THAT(error_of([&] { export_consolidated(ckpt_, root_.file("out")); }),
              AllOf(HasSubstr("tensor \"ids\""), HasSubstr("checksum mismatch")));
  // Nothing half-written is left, not even the output directory the export created.
  EXPECT_FALSE(std::filesystem::exists(root_.file("out")));
}

}  // namespace
}  // namespace fsdp_ema::format

namespace fsdp_ema::format {
namespace {

using testing::error_of;
using testing::files_of;
using ::testing::HasSubstr;

std::vector<ExportEntry> entries_of(const std::vector<testing::RefTensor>& model) {
  std::vector<ExportEntry> out;
  for (const auto& t : model) out.push_back({t.name, t.dtype, t.shape});
  return out;
}

class ExportWriterTest : public testing::ReferenceCheckpointTest<3> {
 protected:
  // Writes the reference model through an ExportWriter, tensors in reverse order, each in two
  // writes (so that order and chunking cannot matter).
  ExportResult stream(const std::string& out, const ExportOptions& o) {
    ExportWriter w(out, entries_of(model_), o);
    for (auto it = model_.rbegin(); it != model_.rend(); ++it) {
      const uint64_t n = *numel(it->shape), half = n / 2, esz = dtype_size(it->dtype);
      w.write(it->name, 0, half, it->data.data());
      w.write(it->name, half, n - half, it->data.data() + half * esz);
    }
    return w.finish();
  }
};

TEST_F(ExportWriterTest, WritesTheSameBytesAsTheCheckpointExport) {
  for (const auto& [limit, dtype] : std::vector<std::pair<uint64_t, std::optional<DType>>>{
           {0, std::nullopt}, {150, std::nullopt}, {0, DType::kBF16}, {100, DType::kF16}}) {
    ExportOptions o;
    o.max_file_bytes = limit;
    o.dtype = dtype;
    const std::string a = root_.file("a" + std::to_string(limit)),
                      b = root_.file("b" + std::to_string(limit));
    o.overwrite = true;
    const ExportResult from_dir = export_consolidated(ckpt_, a, o);
    const ExportResult streamed = stream(b, o);
    EXPECT_EQ(streamed.files, from_dir.files);
    EXPECT_EQ(streamed.total_size, from_dir.total_size);
    EXPECT_EQ(files_of(a), files_of(b)) << "max_file_bytes " << limit;
  }
}

TEST_F(ExportWriterTest, RefusesIncompleteOrRepeatedWritesAndLeavesTheEarlierExport) {
  const std::string out = root_.file("out");
  stream(out, {});
  const auto before = files_of(out);
  {
    ExportOptions o;
    o.overwrite = true;
    ExportWriter w(out, entries_of(model_), o);
    const auto& t = model_.front();
    w.write(t.name, 0, 1, t.data.data());
    EXPECT_THAT(error_of([&] { w.write(t.name, 0, 1, t.data.data()); }),
                HasSubstr("writes go in order, each element once"));
    EXPECT_THAT(error_of([&] { w.write("nope", 0, 1, t.data.data()); }),
                HasSubstr("not one the export was planned with"));
    EXPECT_THAT(error_of([&] { w.finish(); }), HasSubstr("elements written"));
  }  // destroyed unfinished: the staged files go
  EXPECT_EQ(files_of(out), before);
  EXPECT_THAT(error_of([&] { ExportWriter(out, entries_of(model_), {}); }),
              HasSubstr("already holds model.safetensors"));
  std::vector<ExportEntry> twice = entries_of(model_);
  twice.push_back(twice.front());
  ExportOptions o;
  o.overwrite = true;
  EXPECT_THAT(error_of([&] { ExportWriter(out, twice, o); }), HasSubstr("appears twice"));
  EXPECT_EQ(files_of(out), before);
}

}  // namespace
}  // namespace fsdp_ema::format
