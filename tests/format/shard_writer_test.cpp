// write_shard_file -> ShardFile::open round trips, layout, and input validation.
#include "fsdp_ema/format/shard_writer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <map>
#include <nlohmann/json.hpp>
#include <stdexcept>

#include "fsdp_ema/format/checksum.h"
#include "fsdp_ema/format/shard_file.h"
#include "tests/format/fixture_model.h"
#include "tests/format/test_util.h"

namespace fsdp_ema::format {
namespace {

using testing::error_of;
using ::testing::HasSubstr;
using testing::make_ref;
using testing::RefTensor;
using testing::TempDir;

std::vector<TensorToWrite> full_tensors(const std::vector<RefTensor>& refs) {
  std::vector<TensorToWrite> out;
  for (const RefTensor& r : refs) {
    out.push_back(
        TensorToWrite::full(r.name, r.dtype, r.shape, r.data.empty() ? nullptr : r.data.data()));
  }
  return out;
}

void expect_file_holds(const ShardFile& f, const std::vector<RefTensor>& refs) {
  ASSERT_EQ(f.tensors().size(), refs.size());
  for (const RefTensor& r : refs) {
    const TensorInfo* t = f.find(r.name);
    ASSERT_NE(t, nullptr) << r.name;
    EXPECT_EQ(t->dtype, r.dtype) << r.name;
    EXPECT_EQ(t->shape, r.shape) << r.name;
    EXPECT_EQ(t->global_shape, r.shape) << r.name;
    EXPECT_EQ(t->offsets, Shape(r.shape.size(), 0)) << r.name;
    EXPECT_EQ(t->nbytes, r.data.size()) << r.name;
    ASSERT_TRUE(t->checksum.has_value()) << r.name;
    EXPECT_EQ(*t->checksum, checksum_of(r.data.data(), r.data.size())) << r.name;
    const auto mapping = f.map();
    const auto bytes = mapping->data(*t);
    ASSERT_EQ(bytes.size(), r.data.size()) << r.name;
    EXPECT_TRUE(std::equal(bytes.begin(), bytes.end(), r.data.begin())) << r.name;
  }
}

TEST(ShardWriter, RoundTripsEveryDtypeBitExact) {
  TempDir dir;
  std::vector<RefTensor> refs;
  uint32_t seed = 1;
  for (DType d : all_dtypes()) {
    refs.push_back(make_ref("t." + std::string(dtype_name(d)), d, {3, 5, 7}, seed++));
    refs.push_back(make_ref("v." + std::string(dtype_name(d)), d, {11}, seed++));
  }
  const uint64_t bytes = write_shard_file(dir.file("a.safetensors"), full_tensors(refs));
  const ShardFile f = ShardFile::open(dir.file("a.safetensors"));
  EXPECT_EQ(bytes, f.file_bytes());
  EXPECT_TRUE(f.is_fsdp_ema());
  expect_file_holds(f, refs);
  EXPECT_EQ(f.verify_all(), refs.size());
}

TEST(ShardWriter, RoundTripsZeroDimAndEmptyTensors) {
  TempDir dir;
  const std::vector<RefTensor> refs = {
      make_ref("scalar", DType::kF64, {}, 1), make_ref("empty2d", DType::kF32, {0, 4}, 2),
      make_ref("empty1d", DType::kBF16, {0}, 3), make_ref("zero_last", DType::kI8, {5, 0}, 4),
      make_ref("one", DType::kBool, {1}, 5)};
  write_shard_file(dir.file("a.safetensors"), full_tensors(refs));
  const ShardFile f = ShardFile::open(dir.file("a.safetensors"));
  expect_file_holds(f, refs);
  EXPECT_EQ(f.tensor("scalar").nbytes, 8u);
  EXPECT_EQ(f.tensor("empty2d").nbytes, 0u);
  EXPECT_EQ(*f.tensor("empty2d").checksum, checksum_of(nullptr, 0));
}

TEST(ShardWriter, RoundTripsAnEmptyFile) {
  TempDir dir;
  write_shard_file(dir.file("a.safetensors"), {});
  const ShardFile f = ShardFile::open(dir.file("a.safetensors"));
  EXPECT_TRUE(f.tensors().empty());
  EXPECT_EQ(f.file_bytes() % kHeaderAlignment, 0u);
}

TEST(ShardWriter, RoundTrips300Tensors) {
  TempDir dir;
  std::vector<RefTensor> refs;
  const DType dtypes[] = {DType::kF32, DType::kBF16, DType::kF64, DType::kI8, DType::kF16};
  for (int i = 0; i < 300; ++i) {
    refs.push_back(make_ref("model.layers." + std::to_string(i) + ".weight", dtypes[i % 5],
                            {1 + i % 7, 1 + i % 13}, static_cast<uint32_t>(i)));
  }
  write_shard_file(dir.file("a.safetensors"), full_tensors(refs));
  const ShardFile f = ShardFile::open(dir.file("a.safetensors"), /*verify_checksums=*/true);
  expect_file_holds(f, refs);
}

TEST(ShardWriter, CallbackSourceGetsBoundedAlignedChunksInOrder) {
  TempDir dir;
  const std::vector<RefTensor> refs = {
      make_ref("a", DType::kF64, {37}, 1), make_ref("b", DType::kBF16, {3, 41}, 2),
      make_ref("c", DType::kU8, {201}, 3), make_ref("d", DType::kF32, {0}, 4)};
  std::map<std::string, uint64_t> next_offset;
  std::vector<TensorToWrite> tensors = full_tensors(refs);
  for (size_t i = 0; i < tensors.size(); ++i) {
    tensors[i].host_data = nullptr;
    const RefTensor* r = &refs[i];
    tensors[i].fill = [r, &next_offset](uint64_t offset, uint64_t length, void* dst) {
      const size_t esz = dtype_size(r->dtype);
      EXPECT_EQ(offset, next_offset[r->name]) << r->name;  // in order, no gap
      EXPECT_LE(length, 64u);
      EXPECT_GT(length, 0u);
      EXPECT_EQ(offset % esz, 0u);
      EXPECT_EQ(length % esz, 0u);
      EXPECT_EQ(reinterpret_cast<uintptr_t>(dst) % esz, 0u);
      std::memcpy(dst, r->data.data() + offset, length);
      next_offset[r->name] = offset + length;
    };
  }
  WriteOptions opts;
  opts.chunk_bytes = 64;
  write_shard_file(dir.file("a.safetensors"), std::move(tensors), opts);
  EXPECT_EQ(next_offset["a"], 37u * 8);
  EXPECT_EQ(next_offset["b"], 3u * 41 * 2);
  EXPECT_EQ(next_offset["c"], 201u);
  EXPECT_EQ(next_offset.count("d"), 0u);  // no call for an empty tensor
  expect_file_holds(ShardFile::open(dir.file("a.safetensors")), refs);
}

TEST(ShardWriter, CustomStagingAllocatorIsUsedAndFreed) {
  TempDir dir;
  const auto ref = make_ref("w", DType::kF32, {1000}, 9);
  int allocated = 0, freed = 0;
  WriteOptions opts;
  opts.chunk_bytes = 1024;
  opts.num_buffers = 3;
  opts.allocate_buffer = [&](size_t n) {
    ++allocated;
    EXPECT_EQ(n, 1024u);
    return ::operator new(n);
  };
  opts.free_buffer = [&](void* p) {
    ++freed;
    ::operator delete(p);
  };
  auto t = TensorToWrite::full("w", DType::kF32, {1000}, nullptr);
  t.fill = [&](uint64_t off, uint64_t len, void* dst) {
    std::memcpy(dst, ref.data.data() + off, len);
  };
  write_shard_file(dir.file("a.safetensors"), {t}, opts);
  EXPECT_EQ(allocated, 3);
  EXPECT_EQ(freed, 3);
  expect_file_holds(ShardFile::open(dir.file("a.safetensors")), {ref});
}

TEST(ShardWriter, LargeHostTensorsMixWithSmallOnesAndCallbacks) {
  TempDir dir;
  // 1 MiB tensors take the direct path (no staging copy), in 4 KiB chunks here.
  const std::vector<RefTensor> refs = {
      make_ref("big1", DType::kF32, {512, 512}, 1), make_ref("small", DType::kF32, {3}, 2),
      make_ref("big2", DType::kF32, {262'145}, 3), make_ref("cb", DType::kF32, {300'000}, 4)};
  std::vector<TensorToWrite> tensors = full_tensors(refs);
  tensors[3].host_data = nullptr;
  tensors[3].fill = [&](uint64_t off, uint64_t len, void* dst) {
    std::memcpy(dst, refs[3].data.data() + off, len);
  };
  WriteOptions opts;
  opts.chunk_bytes = 4096;
  write_shard_file(dir.file("a.safetensors"), std::move(tensors), opts);
  expect_file_holds(ShardFile::open(dir.file("a.safetensors")), refs);
}

TEST(ShardWriter, EveryTensorIsNaturallyAlignedWithoutPadding) {
  TempDir dir;
  std::vector<RefTensor> refs;
  uint32_t seed = 0;
  for (DType d : {DType::kU8, DType::kF64, DType::kBF16, DType::kI32, DType::kBool, DType::kI64}) {
    refs.push_back(make_ref("x" + std::to_string(seed), d, {3}, seed));  // odd sizes
    ++seed;
  }
  write_shard_file(dir.file("a.safetensors"), full_tensors(refs));
  const ShardFile f = ShardFile::open(dir.file("a.safetensors"));
  EXPECT_EQ(f.header().raw.data_start % 64, 0u);
  size_t prev_size = 8;
  uint64_t expected_offset = f.header().raw.data_start;
  for (const TensorInfo& t : f.tensors()) {
    EXPECT_EQ(t.data_offset % dtype_size(t.dtype), 0u) << t.name;
    EXPECT_LE(dtype_size(t.dtype), prev_size) << "tensors ordered by descending element size";
    EXPECT_EQ(t.data_offset, expected_offset) << "no padding before " << t.name;
    prev_size = dtype_size(t.dtype);
    expected_offset += t.nbytes;
  }
  EXPECT_EQ(expected_offset, f.file_bytes());
}

TEST(ShardWriter, HeaderFollowsTheSafetensorsLayout) {
  // Checked with an independent parse (nlohmann directly, no format/ code).
  TempDir dir;
  auto w = TensorToWrite::full("w", DType::kF32, {2, 3}, nullptr);
  const auto wdata = testing::pattern_bytes(24, 1, DType::kF32);
  w.host_data = wdata.data();
  w.shape = {1, 3};
  w.offsets = {1, 0};
  w.host_data = wdata.data() + 12;
  const auto sdata = testing::pattern_bytes(8, 2, DType::kI64);
  auto s = TensorToWrite::full("step", DType::kI64, {}, sdata.data());
  WriteOptions opts;
  opts.rank = 1;
  opts.world_size = 2;
  opts.metadata = {{"user", "data"}};
  write_shard_file(dir.file(shard_file_name(1, 2)), {w, s}, opts);
  EXPECT_EQ(shard_file_name(1, 2), "shard-00001-of-00002.safetensors");

  const auto bytes = testing::read_bytes(dir.file(shard_file_name(1, 2)));
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i)
    n = (n << 8) | std::to_integer<uint64_t>(bytes[static_cast<size_t>(i)]);
  EXPECT_EQ((8 + n) % 64, 0u);
  const std::string header(reinterpret_cast<const char*>(bytes.data()) + 8, n);
  EXPECT_EQ(header.front(), '{');
  EXPECT_EQ(header.find_last_not_of(' '), header.rfind('}'));  // padded with spaces only
  const auto j = nlohmann::json::parse(header);
  const auto& md = j.at("__metadata__");
  EXPECT_EQ(md.at("format"), "pt");
  EXPECT_EQ(md.at("DCP_VERSION"), "1.0");
  EXPECT_EQ(md.at("fsdp_ema_format_version"), "1");
  EXPECT_EQ(md.at("fsdp_ema_rank"), "1");
  EXPECT_EQ(md.at("fsdp_ema_world_size"), "2");
  EXPECT_EQ(md.at("user"), "data");
  for (const auto& [k, v] : md.items()) EXPECT_TRUE(v.is_string()) << k;
  const auto sharding = nlohmann::json::parse(md.at("DCP_SHARDING_INFO").get<std::string>());
  EXPECT_EQ(sharding.at("w").at("saved_offsets"), nlohmann::json({1, 0}));
  EXPECT_EQ(sharding.at("step").at("saved_offsets"), nlohmann::json::array());
  const auto shapes = nlohmann::json::parse(md.at("fsdp_ema_global_shapes").get<std::string>());
  EXPECT_EQ(shapes.at("w"), nlohmann::json({2, 3}));
  const auto sums = nlohmann::json::parse(md.at("fsdp_ema_checksums").get<std::string>());
  EXPECT_EQ(sums.at("w"), format_checksum(checksum_of(wdata.data() + 12, 12)));
  // I64 (8 bytes) comes before F32 (4 bytes); offsets contiguous and ending at the file end.
  EXPECT_EQ(j.at("step").at("data_offsets"), nlohmann::json({0, 8}));
  EXPECT_EQ(j.at("step").at("shape"), nlohmann::json::array());
  EXPECT_EQ(j.at("w").at("dtype"), "F32");
  EXPECT_EQ(j.at("w").at("shape"), nlohmann::json({1, 3}));
  EXPECT_EQ(j.at("w").at("data_offsets"), nlohmann::json({8, 20}));
  EXPECT_EQ(bytes.size(), 8 + n + 20);
  EXPECT_EQ(std::memcmp(bytes.data() + 8 + n, sdata.data(), 8), 0);
  EXPECT_EQ(std::memcmp(bytes.data() + 8 + n + 8, wdata.data() + 12, 12), 0);
}

TEST(ShardWriter, DescriptionMatchesTheFile) {
  TempDir dir;
  const auto refs = testing::reference_model();
  WriteOptions opts;
  opts.rank = 2;
  opts.world_size = 3;
  ShardDescription d;
  const uint64_t bytes = write_shard_file(dir.file(shard_file_name(2, 3)),
                                          testing::local_shards(refs, 2, 3), opts, &d);
  const ShardFile f = ShardFile::open(dir.file(shard_file_name(2, 3)));
  EXPECT_EQ(d.file, shard_file_name(2, 3));
  EXPECT_EQ(d.rank, 2);
  EXPECT_EQ(d.world_size, 3);
  EXPECT_EQ(d.file_bytes, bytes);
  ASSERT_EQ(d.tensors.size(), f.tensors().size());
  for (size_t i = 0; i < d.tensors.size(); ++i) {
    const TensorInfo& a = d.tensors[i];
    const TensorInfo& b = f.tensors()[i];
    EXPECT_EQ(a.name, b.name);
    EXPECT_EQ(a.dtype, b.dtype);
    EXPECT_EQ(a.shape, b.shape);
    EXPECT_EQ(a.offsets, b.offsets);
    EXPECT_EQ(a.global_shape, b.global_shape);
    EXPECT_EQ(a.checksum, b.checksum);
    EXPECT_EQ(a.data_offset, b.data_offset);
    EXPECT_EQ(a.nbytes, b.nbytes);
  }
  EXPECT_EQ(f.header().rank, 2);
  EXPECT_EQ(f.header().world_size, 3);
}

TEST(ShardWriter, FsyncOffWritesTheSameBytes) {
  TempDir dir;
  const auto refs = testing::reference_model();
  WriteOptions no_sync;
  no_sync.fsync = false;
  write_shard_file(dir.file("a.safetensors"), full_tensors(refs));
  write_shard_file(dir.file("b.safetensors"), full_tensors(refs), no_sync);
  EXPECT_EQ(testing::read_bytes(dir.file("a.safetensors")),
            testing::read_bytes(dir.file("b.safetensors")));
}

TEST(ShardWriter, ReplacesAnExistingFileAndLeavesNoTemporary) {
  TempDir dir;
  const auto a = make_ref("a", DType::kF32, {4}, 1);
  const auto b = make_ref("b", DType::kF32, {8}, 2);
  write_shard_file(dir.file("x.safetensors"), full_tensors({a}));
  write_shard_file(dir.file("x.safetensors"), full_tensors({b}));
  expect_file_holds(ShardFile::open(dir.file("x.safetensors")), {b});
  EXPECT_EQ(testing::list_names(dir.path()), std::vector<std::string>{"x.safetensors"});
}

TEST(ShardWriter, FailingCallbackRemovesTheTemporaryAndKeepsTheOldFile) {
  TempDir dir;
  const auto old = make_ref("old", DType::kF32, {4}, 1);
  write_shard_file(dir.file("x.safetensors"), full_tensors({old}));
  auto t = TensorToWrite::full("new", DType::kF32, {100'000}, nullptr);
  int calls = 0;
  t.fill = [&](uint64_t, uint64_t, void*) {
    if (++calls == 3) throw std::runtime_error("device copy failed");
  };
  WriteOptions opts;
  opts.chunk_bytes = 4096;
  try {
    write_shard_file(dir.file("x.safetensors"), {t}, opts);
    ADD_FAILURE() << "no exception";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "device copy failed");
  }
  EXPECT_EQ(calls, 3);
  EXPECT_EQ(testing::list_names(dir.path()), std::vector<std::string>{"x.safetensors"});
  expect_file_holds(ShardFile::open(dir.file("x.safetensors")), {old});
}

TEST(ShardWriter, WriteErrorNamesTheFile) {
  TempDir dir;
  EXPECT_THAT(error_of([&] { write_shard_file(dir.file("missing_dir/x.safetensors"), {}); }),
              HasSubstr("missing_dir/.x.safetensors.tmp-"));
}

TEST(ShardWriter, RejectsInvalidInputsBeforeWriting) {
  TempDir dir;
  const std::string path = dir.file("x.safetensors");
  const float data[16] = {};
  auto good = [&] { return TensorToWrite::full("w", DType::kF32, {4}, data); };
  struct Case {
    const char* what;
    std::function<void(std::vector<TensorToWrite>&, WriteOptions&)> edit;
    const char* message;
  };
  const Case cases[] = {
      {"empty name", [](auto& t, auto&) { t[0].name = ""; }, "has an empty name"},
      {"duplicate", [&](auto& t, auto&) { t.push_back(good()); }, "\"w\" appears twice"},
      {"metadata name", [](auto& t, auto&) { t[0].name = "__metadata__"; }, "reserved"},
      {"bad utf8", [](auto& t, auto&) { t[0].name = "\xff"; }, "not valid UTF-8"},
      {"dims",
       [](auto& t, auto&) {
         t[0].offsets = {0, 0};
       },
       "one entry per dimension"},
      {"negative", [](auto& t, auto&) { t[0].shape = {-4}; }, "negative size"},
      {"outside", [](auto& t, auto&) { t[0].offsets = {1}; },
       "offsets [1] + shape [4] exceed global shape [4] in dimension 0"},
      {"overflow",
       [](auto& t, auto&) {
         t[0].shape = t[0].global_shape = {1LL << 40, 1LL << 30};
         t[0].offsets = {0, 0};
       },
       "overflows"},
      {"two sources", [](auto& t, auto&) { t[0].fill = [](uint64_t, uint64_t, void*) {}; },
       "both host_data and a fill callback"},
      {"no source", [](auto& t, auto&) { t[0].host_data = nullptr; },
       "neither host_data nor a fill callback"},
      {"rank",
       [](auto&, auto& o) {
         o.rank = 2;
         o.world_size = 2;
       },
       "rank 2 is not in [0"},
      {"reserved key", [](auto&, auto& o) { o.metadata["fsdp_ema_rank"] = "3"; }, "reserved"},
      {"dcp key", [](auto&, auto& o) { o.metadata["DCP_SHARDING_INFO"] = "{}"; }, "reserved"},
      {"chunk", [](auto&, auto& o) { o.chunk_bytes = 100; }, "multiple of 64"},
      {"buffers", [](auto&, auto& o) { o.num_buffers = 1; }, "num_buffers"},
  };
  for (const Case& c : cases) {
    std::vector<TensorToWrite> tensors = {good()};
    WriteOptions opts;
    c.edit(tensors, opts);
    const std::string msg = error_of([&] { write_shard_file(path, tensors, opts); });
    EXPECT_THAT(msg, HasSubstr(c.message)) << c.what;
    EXPECT_THAT(msg, HasSubstr(path)) << c.what;
  }
  EXPECT_TRUE(testing::list_names(dir.path()).empty());
}

TEST(ShardFile, ReadsAFileWrittenByThePythonSafetensorsPackage) {
  // tests/format/data/python_safetensors.safetensors, from make_python_safetensors_fixture.py.
  const ShardFile f =
      ShardFile::open(std::string(FSDP_EMA_FORMAT_TEST_DATA) + "/python_safetensors.safetensors");
  EXPECT_FALSE(f.is_fsdp_ema());
  EXPECT_EQ(f.metadata().at("format"), "pt");
  EXPECT_EQ(f.metadata().at("source"), "safetensors.torch.save_file");
  ASSERT_EQ(f.tensors().size(), 5u);
  const TensorInfo& w = f.tensor("weight");
  EXPECT_EQ(w.dtype, DType::kF32);
  EXPECT_EQ(w.shape, (Shape{3, 4}));
  EXPECT_EQ(w.offsets, (Shape{0, 0}));  // no DCP_SHARDING_INFO: zeros
  EXPECT_EQ(w.global_shape, (Shape{3, 4}));
  EXPECT_FALSE(w.checksum.has_value());
  EXPECT_FALSE(f.verify("weight"));  // nothing to verify
  float values[12];
  const auto mapping = f.map();
  std::memcpy(values, mapping->data(w).data(), sizeof(values));
  for (int i = 0; i < 12; ++i) EXPECT_EQ(values[i], static_cast<float>(i) * 0.5f - 1.0f);
  const TensorInfo& h = f.tensor("half");
  EXPECT_EQ(h.dtype, DType::kBF16);
  uint16_t hb[2];
  std::memcpy(hb, mapping->data(h).data(), 4);
  EXPECT_EQ(hb[0], 0x3F80);  // 1.0
  EXPECT_EQ(hb[1], 0xC000);  // -2.0
  EXPECT_EQ(f.tensor("scalar").shape, Shape{});
  int64_t scalar;
  std::memcpy(&scalar, mapping->data(f.tensor("scalar")).data(), 8);
  EXPECT_EQ(scalar, -7);
  EXPECT_EQ(f.tensor("empty").nbytes, 0u);
  EXPECT_EQ(f.tensor("flags").dtype, DType::kBool);
}

}  // namespace
}  // namespace fsdp_ema::format
