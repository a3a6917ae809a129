// The C++ checkpoint path with no Python: save_shard / commit_checkpoint through the dispatcher,
// then fsdp_ema::CheckpointReader: full tensors, resharded slices, and loading a TorchScript
// module's parameters and buffers.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <fcntl.h>
#include <fsdp_ema/checkpoint.h>
#include <fsdp_ema/ops.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <torch/script.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <thread>

#include "checkpoint_fixture.h"
#include "test_helpers.h"
#include "tests/format/test_util.h"

namespace {

namespace fs = std::filesystem;
using ::fsdp_ema::testing::scratch_dir;
using ::fsdp_ema::testing::write_sharded;
using ::testing::HasSubstr;

// The torch.chunk rows of `rank` of `world`, the reference for load_chunk.
std::pair<int64_t, int64_t> chunk_rows(int64_t rows, int64_t rank, int64_t world) {
  const int64_t cs = (rows + world - 1) / world;
  const int64_t begin = std::min(rank * cs, rows);
  return {begin, std::min(begin + cs, rows)};
}

// load_into(targets) raises an error that says `message`.
void expect_load_into_refused(const fsdp_ema::CheckpointReader& reader,
                              const std::map<std::string, at::Tensor>& targets,
                              const std::string& message) {
  try {
    reader.load_into(targets);
    FAIL() << "no error for " << message;
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what_without_backtrace(), HasSubstr(message));
  }
}

std::map<std::string, at::Tensor> reference() {
  at::manual_seed(7);
  return {{"emb", at::randn({13, 6})},
          {"bias", at::randn({7}).to(at::kBFloat16)},
          {"tiny", at::randn({2, 3}).to(at::kHalf)},
          {"step", at::scalar_tensor(5, at::kLong)}};
}

TEST(CheckpointReader, ReshardsToAnyWorldSize) {
  const auto tensors = reference();
  for (int64_t writers : {1, 2, 3, 4}) {
    const fs::path dir = scratch_dir("reshard" + std::to_string(writers));
    write_sharded(dir, tensors, writers);
    const fsdp_ema::CheckpointReader reader(dir.string());
    EXPECT_EQ(reader.layout(), "fsdp_ema");
    EXPECT_EQ(reader.world_size(), writers);
    ASSERT_EQ(reader.tensors().size(), tensors.size());
    EXPECT_EQ(reader.verify_all(), tensors.size() + (writers - 1) * 3);
    for (const auto& [name, t] : tensors) {
      EXPECT_TRUE(at::equal(reader.load(name), t)) << name;
      for (int64_t readers = 1; readers <= 5; ++readers) {
        for (int64_t rank = 0; rank < readers; ++rank) {
          const at::Tensor got = reader.load_chunk(name, rank, readers);
          at::Tensor expected = t;
          if (t.dim() > 0) {
            const auto [b, e] = chunk_rows(t.size(0), rank, readers);
            expected = t.slice(0, b, e);
          }
          EXPECT_TRUE(at::equal(got, expected))
              << name << " W=" << writers << " M=" << readers << " r=" << rank;
        }
      }
    }
    fs::remove_all(dir);
  }
}

TEST(CheckpointReader, LoadAllGivesEveryTensorWholeInNameOrder) {
  const auto tensors = reference();
  const fs::path dir = scratch_dir("load_all");
  write_sharded(dir, tensors, 3);
  for (const bool mmap : {false, true}) {
    const fsdp_ema::CheckpointReader reader(dir.string(), mmap);
    const std::map<std::string, at::Tensor> all = reader.load_all();
    ASSERT_EQ(all.size(), tensors.size());
    auto it = all.begin();
    for (const auto& [name, t] : tensors) {  // both maps are ordered by name
      EXPECT_EQ(it->first, name);
      EXPECT_TRUE(at::equal(it->second, t)) << name << " mmap=" << mmap;
      ++it;
    }
  }
  fs::remove_all(dir);
}

// Loads to CUDA go through two 64 MiB pinned staging buffers (fsdp_ema/format/read_exec.h,
// execute_staged); a 150 MiB tensor among small ones cycles them. Bit for bit what the CPU loads
// give. Skips without CUDA.
TEST(CheckpointReaderCuda, LoadAllAndChunksEqualTheCpuLoads) {
  if (!fsdp_ema::testing::cuda_available()) GTEST_SKIP() << "no CUDA device";
  auto tensors = reference();
  tensors["big"] = at::randn({150 * 256 + 3, 1024});
  const fs::path dir = scratch_dir("cuda");
  write_sharded(dir, tensors, 2);
  const fsdp_ema::CheckpointReader reader(dir.string());
  const auto on_cpu = reader.load_all(at::kCPU);
  const auto on_cuda = reader.load_all(at::kCUDA);
  ASSERT_EQ(on_cuda.size(), on_cpu.size());
  for (const auto& [name, t] : on_cpu) {
    ASSERT_TRUE(on_cuda.at(name).is_cuda()) << name;
    EXPECT_TRUE(at::equal(on_cuda.at(name).cpu(), t)) << name;
  }
  for (int64_t rank = 0; rank < 3; ++rank) {
    for (const std::string name : {"big", "emb", "step"}) {
      const at::Tensor got = reader.load_chunk(name, rank, 3, at::kCUDA);
      EXPECT_TRUE(got.is_cuda());
      EXPECT_TRUE(at::equal(got.cpu(), reader.load_chunk(name, rank, 3))) << name << " " << rank;
    }
  }
  fs::remove_all(dir);
}

// Every load reads and verifies again: a byte changed in place after the first load (pwrite, with
// no reopen) fails the second load, never returns the changed bytes.
TEST(CheckpointReader, SecondLoadOfAChangedFileIsRefused) {
  const fs::path dir = scratch_dir("second_load");
  const auto tensors = reference();
  write_sharded(dir, tensors, 1);
  const fsdp_ema::CheckpointReader reader(dir.string());
  EXPECT_TRUE(at::equal(reader.load("emb"), tensors.at("emb")));
  const std::string file = (dir / "shard-00000-of-00001.safetensors").string();
  // File order is descending element size, then name: "step" (i64, 8 bytes), then "emb" (f32).
  const auto data_start = [&] {
    FILE* f = std::fopen(file.c_str(), "rb");
    uint64_t n = 0;
    EXPECT_EQ(std::fread(&n, 8, 1, f), 1u);
    std::fclose(f);
    return 8 + n;
  }();
  const int fd = ::open(file.c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  unsigned char c = 0;
  ASSERT_EQ(::pread(fd, &c, 1, static_cast<off_t>(data_start + 8 + 5)), 1);
  c ^= 0x40;
  ASSERT_EQ(::pwrite(fd, &c, 1, static_cast<off_t>(data_start + 8 + 5)), 1);
  ::close(fd);
  for (bool again : {false, true}) {
    try {
      const at::Tensor t = reader.load("emb");
      FAIL() << "loaded " << (at::equal(t, tensors.at("emb")) ? "the old" : "changed") << " bytes";
    } catch (const c10::Error& e) {
      EXPECT_THAT(e.what_without_backtrace(), HasSubstr("checksum mismatch")) << again;
    }
  }
  EXPECT_TRUE(at::equal(reader.load("bias"), tensors.at("bias")));  // other tensors still load
  fs::remove_all(dir);
}

TEST(CheckpointReader, AMovedFromReaderThrowsAClearError) {
  const fs::path dir = scratch_dir("moved");
  write_sharded(dir, reference(), 1);
  fsdp_ema::CheckpointReader a(dir.string());
  fsdp_ema::CheckpointReader b = std::move(a);
  EXPECT_EQ(b.load("step").item<int64_t>(), 5);
  for (const auto& call : std::vector<std::function<void()>>{
           [&] { a.load("step"); }, [&] { a.tensors(); }, [&] { a.directory(); },
           [&] { a.load_all(); }, [&] { a.verify_all(); }}) {
    try {
      call();
      FAIL() << "no error";
    } catch (const c10::Error& e) {
      EXPECT_THAT(e.what_without_backtrace(),
                  HasSubstr("fsdp_ema::CheckpointReader: this reader was moved from"));
    }
  }
  fs::remove_all(dir);
}

TEST(CheckpointReader, LoadIntoChecksEveryDestinationBeforeTheFirstWrite) {
  const fs::path dir = scratch_dir("destinations");
  const auto tensors = reference();
  write_sharded(dir, tensors, 2);
  const fsdp_ema::CheckpointReader reader(dir.string());
  const std::map<std::string, at::Tensor> fine = {
      {"bias", at::zeros({7})}, {"emb", at::zeros({13, 6})}, {"step", at::zeros({}, at::kLong)}};
  auto with = [&](const std::string& name, at::Tensor t) {
    auto m = fine;
    m[name] = t;
    return m;
  };
  const std::vector<std::pair<std::map<std::string, at::Tensor>, std::string>> bad = {
      {with("tiny", at::zeros({1, 3}).expand({2, 3})),
       "destination 'tiny' has internally overlapping memory"},
      {with("tiny", at::Tensor()), "destination 'tiny' is an undefined tensor"},
      {with("tiny",
            [] {
              const c10::InferenceMode guard;
              return at::zeros({2, 3}, at::kHalf);
            }()),
       "destination 'tiny' is an inference tensor"},
  };
  for (const auto& [targets, message] : bad) {
    expect_load_into_refused(reader, targets, message);
    for (const auto& [name, t] : fine) {
      EXPECT_EQ(t.count_nonzero().item<int64_t>(), 0) << name << " was written";
    }
  }
}

// One reader shared by 8 threads (the serving pattern): every load returns the stored values.
TEST(CheckpointReader, OneReaderSharedByEightThreadsLoadsTheRightValues) {
  const fs::path dir = scratch_dir("threads");
  const auto tensors = reference();
  write_sharded(dir, tensors, 3);
  const fsdp_ema::CheckpointReader reader(dir.string());
  std::atomic<int> wrong{0}, loads{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 60; ++i) {
        for (const auto& [name, want] : tensors) {
          const int64_t world = 1 + (t + i) % 4;
          const int64_t rank = i % world;
          const at::Tensor got = reader.load_chunk(name, rank, world);
          at::Tensor expected = want;
          if (want.dim() > 0) {
            const auto [b, e] = chunk_rows(want.size(0), rank, world);
            expected = want.slice(0, b, e);
          }
          if (!at::equal(got, expected)) ++wrong;
          ++loads;
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(loads.load(), 8 * 60 * 4);
  EXPECT_EQ(wrong.load(), 0);
  fs::remove_all(dir);
}

// A zero-copy reader (mmap=true) loading into a module while another thread rewrites bytes of the
// file in place through a shared mapping (no time stamp moves): every destination gets the
// stored values or the load raises; none gets a byte its load did not verify.
TEST(CheckpointReader, ZeroCopyReaderLoadsIntoAModuleOnlyVerifiedBytes) {
  const fs::path dir = scratch_dir("mmap_load_into");
  at::manual_seed(11);
  const at::Tensor big = at::randn({4096, 64});
  write_sharded(dir, {{"big", big}}, 1);
  const std::string file = (dir / "shard-00000-of-00001.safetensors").string();
  const fsdp_ema::CheckpointReader reader(dir.string(), /*mmap=*/true);
  // Each change held 100 us: long enough to fall between a verification and a later read of
  // the same bytes (a view verified, then copied, would return it).
  const fsdp_ema::format::testing::InPlaceWriter writer(
      file, static_cast<uint64_t>(fs::file_size(file) - big.nbytes()),  // one tensor: the tail
      static_cast<uint64_t>(big.nbytes()), /*mapped=*/true, std::chrono::microseconds(100));
  int wrong = 0, refused = 0, right = 0;
  for (int trial = 0; trial < 300; ++trial) {
    const std::map<std::string, at::Tensor> targets = {{"big", at::zeros({4096, 64})}};
    try {
      reader.load_into(targets);
      (at::equal(targets.at("big"), big) ? right : wrong)++;
    } catch (const c10::Error& e) {
      EXPECT_THAT(e.what_without_backtrace(), HasSubstr("checksum mismatch"));
      ++refused;
    }
  }
  EXPECT_EQ(wrong, 0) << right << " right, " << refused << " refused";
  fs::remove_all(dir);
}

// Zero-copy loads (mmap=true) never hand out one memory twice: each load maps the file anew
// (private, copy-on-write), so a write through one loaded tensor changes no other load's tensor,
// never reaches the file, and a later load of the intact file verifies and returns the stored
// values (#41: two loads shared one mapping; a.add_(1) changed b, and the next load was refused
// as a checksum mismatch).
TEST(CheckpointReader, ZeroCopyLoadsNeverShareMemory) {
  const fs::path dir = scratch_dir("mmap_aliasing");
  const auto tensors = reference();
  write_sharded(dir, tensors, 1);  // one piece per tensor: every load below is a mapped view
  const fsdp_ema::CheckpointReader reader(dir.string(), /*mmap=*/true);
  const at::Tensor want = tensors.at("emb");
  at::Tensor a = reader.load("emb");
  const at::Tensor b = reader.load("emb");
  EXPECT_NE(a.data_ptr(), b.data_ptr());
  a.add_(1);
  EXPECT_TRUE(at::equal(b, want)) << "a write through one load changed another load's tensor";
  EXPECT_TRUE(at::equal(a, want + 1));
  EXPECT_TRUE(at::equal(reader.load("emb"), want));  // the file is intact: verified, loaded
  std::map<std::string, at::Tensor> first = reader.load_all();
  const std::map<std::string, at::Tensor> second = reader.load_all();
  for (auto& [name, t] : first) t.add_(1);
  for (const auto& [name, t] : second) EXPECT_TRUE(at::equal(t, tensors.at(name))) << name;
  EXPECT_TRUE(at::equal(reader.load_chunk("emb", 0, 1), want));
  EXPECT_TRUE(fsdp_ema::CheckpointReader(dir.string()).load("emb").equal(want));  // owned reads
  fs::remove_all(dir);
}

// load_into(map) refuses destinations that share memory with each other or with themselves, and
// meta destinations (no memory: the load would do nothing), naming them; nothing is written.
TEST(CheckpointReader, LoadIntoRefusesOverlappingAndMetaDestinations) {
  const fs::path dir = scratch_dir("overlap");
  at::manual_seed(3);
  const std::map<std::string, at::Tensor> stored = {
      {"a", at::randn({4, 4})}, {"b", at::randn({4, 4})}, {"s", at::randn({100, 8})}};
  write_sharded(dir, stored, 2);
  const fsdp_ema::CheckpointReader reader(dir.string());
  const at::Tensor buffer = at::zeros({1000});
  const at::Tensor own = at::zeros({4, 4});
  const std::vector<std::pair<std::map<std::string, at::Tensor>, std::string>> bad = {
      // two half-overlapping views of one buffer
      {{{"a", buffer.narrow(0, 0, 16).view({4, 4})},
        {"b", buffer.narrow(0, 8, 16).view({4, 4})},
        {"s", at::zeros({100, 8})}},
       "destination 'b' overlaps destination 'a' in memory"},
      // one tensor under two names
      {{{"a", own}, {"b", own}, {"s", at::zeros({100, 8})}},
       "destination 'b' overlaps destination 'a' in memory"},
      // 800 elements over 107 floats: elements share memory
      {{{"a", at::zeros({4, 4})},
        {"b", at::zeros({4, 4})},
        {"s", buffer.narrow(0, 500, 107).as_strided({100, 8}, {1, 1})}},
       "destination 's' has internally overlapping memory"},
      {{{"a", at::zeros({4, 4})}, {"b", at::empty({4, 4}, at::kMeta)}, {"s", at::zeros({100, 8})}},
       "destination 'b' is a meta tensor"},
  };
  for (const auto& [targets, message] : bad) {
    expect_load_into_refused(reader, targets, message);
    EXPECT_EQ(buffer.count_nonzero().item<int64_t>(), 0) << message << ": written";
    EXPECT_EQ(own.count_nonzero().item<int64_t>(), 0) << message << ": written";
  }
  // Disjoint views of one buffer, interleaved or side by side, are fine.
  const at::Tensor rows = at::zeros({8, 4});
  reader.load_into({{"a", rows.slice(0, 0, 8, 2)},
                    {"b", rows.slice(0, 1, 8, 2)},
                    {"s", buffer.narrow(0, 0, 800).view({100, 8})}});
  EXPECT_TRUE(at::equal(rows.slice(0, 0, 8, 2), stored.at("a")));
  EXPECT_TRUE(at::equal(rows.slice(0, 1, 8, 2), stored.at("b")));
  EXPECT_TRUE(at::equal(buffer.narrow(0, 0, 800).view({100, 8}), stored.at("s")));
  fs::remove_all(dir);
}

TEST(CheckpointReader, RefusesAnIncompleteCheckpoint) {
  const fs::path dir = scratch_dir("incomplete");
  write_sharded(dir, reference(), 2);
  fs::remove(dir / "fsdp_ema.index.json");
  EXPECT_THAT([&] { fsdp_ema::CheckpointReader reader(dir.string()); },
              ::testing::ThrowsMessage<c10::Error>(
                  HasSubstr("incomplete checkpoint: fsdp_ema.index.json missing")));
  fs::remove_all(dir);
}

TEST(CheckpointReader, LoadChunkNamesABadRankWithTheOpsWords) {
  const fs::path dir = scratch_dir("bad_rank");
  write_sharded(dir, reference(), 2);
  const fsdp_ema::CheckpointReader reader(dir.string());
  const std::string name = reference().begin()->first;
  EXPECT_THAT(
      [&] { (void)reader.load_chunk(name, 2, 2); },
      ::testing::ThrowsMessage<c10::Error>(HasSubstr(
          "CheckpointReader: rank must be in [0, world_size), got rank 2 with world_size 2")));
  EXPECT_THAT([&] { (void)reader.load_chunk(name, 0, 0); },
              ::testing::ThrowsMessage<c10::Error>(
                  HasSubstr("CheckpointReader: world_size must be >= 1, got 0")));
  fs::remove_all(dir);
}

class ModuleLoad : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* path = std::getenv("FSDP_EMA_SCRIPTED_MODULE");
    ASSERT_NE(path, nullptr) << "run through ctest: the make_scripted_module fixture writes it";
    module_ = torch::jit::load(path);
  }
  at::Tensor attr(const std::string& name) { return module_.attr(name).toTensor(); }
  torch::jit::Module module_;
};

TEST_F(ModuleLoad, LoadsParametersAndBuffersByName) {
  const fs::path dir = scratch_dir("module");
  const at::Tensor weight = at::full({2, 3}, 1.5);
  const at::Tensor ema = at::full({2, 3}, 0.25, at::kDouble);  // cast to the buffer's fp32
  write_sharded(dir, {{"weight", weight}, {"ema", ema}}, 2);
  fsdp_ema::CheckpointReader(dir.string()).load_into(module_);
  EXPECT_TRUE(at::equal(attr("weight"), weight));
  EXPECT_TRUE(at::equal(attr("ema"), at::full({2, 3}, 0.25)));
  fs::remove_all(dir);
}

TEST_F(ModuleLoad, NamesEveryProblemAndLeavesTheModuleUnchanged) {
  const fs::path dir = scratch_dir("module_bad");
  write_sharded(dir, {{"weight", at::ones({3, 2})}, {"extra", at::ones({1})}}, 1);
  const at::Tensor before = attr("weight").clone();
  try {
    fsdp_ema::CheckpointReader(dir.string()).load_into(module_);
    FAIL() << "no error";
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    EXPECT_THAT(msg, HasSubstr("shape mismatch: weight (checkpoint [3, 2], module [2, 3])"));
    EXPECT_THAT(msg, HasSubstr("missing in checkpoint: ema"));
    EXPECT_THAT(msg, HasSubstr("unexpected in checkpoint: extra"));
  }
  EXPECT_TRUE(at::equal(attr("weight"), before));
  fs::remove_all(dir);
}

TEST_F(ModuleLoad, NonStrictIgnoresMissingAndUnexpectedNames) {
  const fs::path dir = scratch_dir("module_nonstrict");
  write_sharded(dir, {{"weight", at::full({2, 3}, 9.0)}, {"extra", at::ones({1})}}, 1);
  fsdp_ema::CheckpointReader(dir.string()).load_into(module_, {/*strict=*/false});
  EXPECT_TRUE(at::equal(attr("weight"), at::full({2, 3}, 9.0)));
  fs::remove_all(dir);
}

}  // namespace
