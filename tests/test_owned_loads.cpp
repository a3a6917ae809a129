// CheckpointReader loads are memory the caller owns: truncating or rewriting the checkpoint's
// files afterwards changes nothing and cannot crash the process. Zero-copy is an explicit opt-in.
#include <ATen/ATen.h>
#include <fsdp_ema/checkpoint.h>
#include <fsdp_ema/ops.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "checkpoint_fixture.h"

namespace {

namespace fs = std::filesystem;

fs::path save_one(const std::string& name, const at::Tensor& t) {
  const fs::path dir = fsdp_ema::testing::scratch_dir(name);
  std::vector<int64_t> offsets(static_cast<size_t>(t.dim()), 0);
  fsdp_ema::save_shard(dir.string(), 0, 1, {"w"}, {t}, offsets, t.sizes().vec());
  fsdp_ema::commit_checkpoint(dir.string(), 1);
  return dir;
}

// The file a mapping of this process that holds address p maps ("" where none does).
std::string mapped_file_at(const void* p) {
  std::ifstream maps("/proc/self/maps");
  const auto at = reinterpret_cast<uintptr_t>(p);
  for (std::string line; std::getline(maps, line);) {
    std::istringstream in(line);
    std::string range, perms, offset, device, inode, path;
    in >> range >> perms >> offset >> device >> inode >> path;
    const auto dash = range.find('-');
    const uintptr_t lo = std::stoull(range.substr(0, dash), nullptr, 16);
    const uintptr_t hi = std::stoull(range.substr(dash + 1), nullptr, 16);
    if (lo <= at && at < hi) return path;
  }
  return "";
}

TEST(OwnedLoads, ReaderTensorsSurviveTruncationAndRewrite) {
  const at::Tensor ref = at::arange(1 << 18, at::kFloat).reshape({512, 512});
  const fs::path dir = save_one("reader", ref);
  const fs::path file = dir / "shard-00000-of-00001.safetensors";
  const fsdp_ema::CheckpointReader reader(dir.string());
  const at::Tensor whole = reader.load("w");
  const at::Tensor rows = reader.load_chunk("w", 1, 3);
  ASSERT_EQ(::truncate(file.c_str(), 64), 0);  // as a rotation or rsync --inplace might
  // Every element touched: no SIGBUS, values as saved.
  EXPECT_TRUE(at::equal(whole, ref));
  EXPECT_TRUE(at::equal(rows, ref.chunk(3, 0)[1]));
  // A new read of the lost bytes is a clear error naming the file.
  try {
    (void)reader.load("w", at::kCPU, /*verify=*/false);
    ADD_FAILURE() << "load of a truncated file succeeded";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("shard-00000-of-00001.safetensors"), std::string::npos)
        << e.what();
  }
  fs::remove_all(dir);
}

TEST(OwnedLoads, ReaderMmapOptInSharesTheFilePages) {
  const at::Tensor ref = at::arange(4096, at::kFloat);
  const fs::path dir = save_one("mmap", ref);
  const fsdp_ema::CheckpointReader owned(dir.string());
  const fsdp_ema::CheckpointReader mapped(dir.string(), /*mmap=*/true);
  const at::Tensor a = owned.load("w");
  const at::Tensor b = mapped.load("w");
  const at::Tensor c = mapped.load("w");
  EXPECT_TRUE(at::equal(a, ref));
  EXPECT_TRUE(at::equal(b, ref));
  // Zero-copy: views of the file's pages, each load its own mapping (#41: one shared mapping let
  // a write through one load's tensor change the other's); owned loads are no file's pages.
  const std::string file = (dir / "shard-00000-of-00001.safetensors").string();
  EXPECT_EQ(mapped_file_at(b.data_ptr()), file);
  EXPECT_EQ(mapped_file_at(c.data_ptr()), file);
  EXPECT_NE(b.data_ptr(), c.data_ptr());
  EXPECT_NE(mapped_file_at(a.data_ptr()), file);
  EXPECT_NE(a.data_ptr(), owned.load("w").data_ptr());
  fs::remove_all(dir);
}

}  // namespace
