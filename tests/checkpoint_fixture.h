// Shared by the C++ checkpoint tests: a fresh scratch directory per test and a checkpoint written
// as `world` ranks would write it, through the public op wrappers of ops.h.
#pragma once

#include <ATen/ATen.h>
#include <fsdp_ema/ops.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

namespace fsdp_ema::testing {

// An empty directory named after the running test (suite and name), `name` and the process id,
// so tests of one binary run together or in parallel processes never share one.
inline std::filesystem::path scratch_dir(const std::string& name) {
  const ::testing::TestInfo* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::string test =
      info == nullptr ? "none" : std::string(info->test_suite_name()) + "_" + info->name();
  std::replace(test.begin(), test.end(), '/', '_');  // parameterized names
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() /
      ("fsdp_ema_" + test + "_" + name + "_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

// Writes `tensors` as `world` ranks would (dim-0 rows split by at::chunk, the torch.chunk rule,
// independent of the library's own row code; a 0-dim tensor by rank 0 alone) and commits.
inline void write_sharded(const std::filesystem::path& dir,
                          const std::map<std::string, at::Tensor>& tensors, int64_t world) {
  for (int64_t rank = 0; rank < world; ++rank) {
    std::vector<std::string> names;
    std::vector<at::Tensor> shards;
    std::vector<int64_t> offsets, global_shapes;
    for (const auto& [name, t] : tensors) {
      if (t.dim() == 0) {
        if (rank != 0) continue;
        names.push_back(name);
        shards.push_back(t);
        continue;
      }
      // at::chunk returns fewer chunks than `world` when rows run out: later ranks hold none.
      // Every chunk but the last has the first one's rows.
      const auto chunks = t.chunk(world, 0);
      const auto held = static_cast<int64_t>(chunks.size());
      names.push_back(name);
      shards.push_back(rank < held ? chunks[rank] : t.slice(0, t.size(0)));
      offsets.push_back(rank < held ? rank * chunks[0].size(0) : t.size(0));
      for (int64_t d = 1; d < t.dim(); ++d) offsets.push_back(0);
      for (const auto s : t.sizes()) global_shapes.push_back(s);
    }
    ASSERT_GT(
        fsdp_ema::save_shard(dir.string(), rank, world, names, shards, offsets, global_shapes), 0);
  }
  ASSERT_EQ(fsdp_ema::commit_checkpoint(dir.string(), world), static_cast<int64_t>(tensors.size()));
}

}  // namespace fsdp_ema::testing
