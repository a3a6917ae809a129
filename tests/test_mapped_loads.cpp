// A zero-copy CheckpointReader (mmap = true) whose file shrinks under a load: the verification of
// the load's views through its mapping raises a c10::Error naming the file instead of the process
// dying of SIGBUS (issue 41), when the file was truncated after the reader opened it and when
// another thread truncates and restores it while loads run. Zero-copy tensors hold their mapping:
// they outlive the reader that loaded them.
#include <ATen/ATen.h>
#include <fcntl.h>
#include <fsdp_ema/checkpoint.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "checkpoint_fixture.h"

namespace {

namespace fs = std::filesystem;

const char* const kShard = "shard-00000-of-00001.safetensors";

std::string bytes_of(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_in_place(const fs::path& file, const std::string& bytes, uint64_t from = 0) {
  const int fd = ::open(file.c_str(), O_WRONLY);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::pwrite(fd, bytes.data() + from, bytes.size() - from, static_cast<off_t>(from)),
            static_cast<ssize_t>(bytes.size() - from));
  ::close(fd);
}

// The error of f(), or nullopt when it returned.
template <typename F>
std::optional<std::string> error_of(F&& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return std::nullopt;
}

std::map<std::string, at::Tensor> model() {
  // "big" over several read chunks (verified on several threads), a BOOL tensor after it.
  return {{"big", at::arange(1 << 23, at::kFloat).reshape({1 << 13, 1 << 10})},
          {"mask", at::arange(999).remainder(3).eq(0)}};
}

// model() saved in a scratch directory: its shard file and that file's bytes.
struct Saved {
  explicit Saved(const std::string& name)
      : dir(fsdp_ema::testing::scratch_dir(name)), file(dir / kShard) {
    fsdp_ema::testing::write_sharded(dir, ref, 1);
    whole = bytes_of(file);
  }
  ~Saved() { fs::remove_all(dir); }
  const std::map<std::string, at::Tensor> ref = model();
  const fs::path dir, file;
  std::string whole;
};

TEST(MappedLoads, AFileTruncatedAfterTheOpenIsAnErrorNamingIt) {
  const Saved saved("truncated");
  const auto& [ref, dir, file, whole] = saved;
  const fsdp_ema::CheckpointReader reader(dir.string(), /*mmap=*/true);
  const std::vector<std::function<void()>> loads = {
      [&] { (void)reader.load("big"); }, [&] { (void)reader.load_all(); },
      [&] { (void)reader.load("mask", at::kCPU, /*verify=*/false); }};
  for (size_t i = 0; i < loads.size(); ++i) {
    // On a page edge: the pages after it are gone (SIGBUS), none is half zeros (a mismatch).
    for (const uint64_t cut : {whole.size() / 2 / 4096 * 4096, uint64_t{0}}) {
      ASSERT_EQ(::truncate(file.c_str(), static_cast<off_t>(cut)), 0);
      const auto e = error_of(loads[i]);
      ASSERT_TRUE(e.has_value()) << i << " " << cut;
      EXPECT_NE(e->find("fsdp_ema::CheckpointReader: " + file.string() + ": tensor \""),
                std::string::npos)
          << *e;
      EXPECT_NE(e->find("could not be read through the file's mapping (SIGBUS): the file shrank"),
                std::string::npos)
          << *e;
      write_in_place(file, whole);
    }
  }
  // The process and the reader go on: the file whole again loads right.
  const auto all = reader.load_all();
  for (const auto& [name, t] : ref) EXPECT_TRUE(at::equal(all.at(name), t)) << name;
}

// Another thread truncates the file and writes it back, over and over, while two threads load
// through one zero-copy reader: every load is the stored values (compared with the file whole
// again) or an error naming the file. Runs until the race was hit a few times, within a bound.
TEST(MappedLoads, LoadsRacingATruncatingThreadAreRightOrClearErrors) {
  const Saved saved("racing");
  const auto& [ref, dir, file, whole] = saved;
  const uint64_t cut = whole.size() / 3 / 4096 * 4096;
  const fsdp_ema::CheckpointReader reader(dir.string(), /*mmap=*/true);

  // The file is whole whenever the truncator does not hold `whole`.
  std::mutex whole_mu;
  std::atomic<bool> stop{false};
  std::thread truncator([&] {
    while (!stop) {
      {
        const std::lock_guard lock(whole_mu);
        ::truncate(file.c_str(), static_cast<off_t>(cut));
        std::this_thread::sleep_for(std::chrono::microseconds(500));
        write_in_place(file, whole, cut);
      }
      std::this_thread::sleep_for(std::chrono::microseconds(1500));
    }
  });
  std::atomic<int> loaded{0}, wrong{0}, guarded{0}, calls{0};
  std::vector<std::string> others;
  auto loader = [&] {
    while (calls++ < 300 && (calls < 30 || guarded < 4)) {
      std::map<std::string, at::Tensor> got;
      const auto e = error_of([&] { got = reader.load_all(); });
      // Compared with the file whole: the views show its pages as they are now.
      const std::lock_guard lock(whole_mu);
      if (!e) {
        ++loaded;
        for (const auto& [name, t] : ref) wrong += at::equal(got.at(name), t) ? 0 : 1;
      } else if (e->find(file.string()) != std::string::npos &&
                 e->find(
                     "could not be read through the file's mapping (SIGBUS): the file shrank") !=
                     std::string::npos) {
        ++guarded;
      } else {
        others.push_back(*e);
      }
      got.clear();
    }
  };
  std::thread a(loader), b(loader);
  a.join();
  b.join();
  stop = true;
  truncator.join();
  EXPECT_EQ(wrong, 0);
  EXPECT_TRUE(others.empty()) << others.front();
  EXPECT_GE(guarded, 1) << loaded << " loads, none hit the truncation";
}

// Zero-copy tensors hold their mapping: they stay valid after the reader is gone.
TEST(MappedLoads, ZeroCopyTensorsOutliveTheirReader) {
  const Saved saved("outlive");
  std::map<std::string, at::Tensor> got;
  {
    const fsdp_ema::CheckpointReader reader(saved.dir.string(), /*mmap=*/true);
    got = reader.load_all();
  }
  for (const auto& [name, t] : saved.ref) EXPECT_TRUE(at::equal(got.at(name), t)) << name;
}

}  // namespace
