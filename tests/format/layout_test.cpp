// The directory layout rules (fsdp_ema/format/layout.h): the lock, preparing a directory, stale
// temporaries, sidecars, listing and removing whole checkpoints.
#include "fsdp_ema/format/layout.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <string>
#include <thread>

#include "tests/format/fixture_model.h"
#include "tests/format/test_util.h"

namespace fsdp_ema::format {
namespace {

using ::testing::ElementsAre;
using testing::error_of;
using ::testing::HasSubstr;
using testing::TempDir;

TEST(Layout, ExclusiveLockWaitsForSharedHoldersAndSharedOnesShare) {
  TempDir root;
  std::atomic<bool> got_exclusive{false};
  std::thread exclusive;
  {
    const DirectoryLock a(root.path(), DirectoryLock::Mode::kShared);
    const DirectoryLock b(root.path(), DirectoryLock::Mode::kShared);  // no wait: both shared
    exclusive = std::thread([&] {
      const DirectoryLock c(root.path(), DirectoryLock::Mode::kExclusive);
      got_exclusive = true;
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    EXPECT_FALSE(got_exclusive);  // still held shared
  }
  exclusive.join();
  EXPECT_TRUE(got_exclusive);
  EXPECT_THAT(error_of([&] { DirectoryLock(root.file("none"), DirectoryLock::Mode::kShared); }),
              HasSubstr("none' cannot be opened"));
}

TEST(Layout, CommitTakesTheLockExclusively) {
  TempDir root;
  const std::string dir = root.subdir("ckpt");
  testing::write_checkpoint(dir, testing::reference_model(), 2);
  std::filesystem::remove(dir + "/" + std::string(kIndexFileName));  // written, not committed
  std::atomic<bool> committed{false};
  std::thread commit;
  {
    const DirectoryLock reader(dir, DirectoryLock::Mode::kShared);
    commit = std::thread([&] {
      commit_directory(dir, 2, false, false);
      committed = true;
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    EXPECT_FALSE(committed);
    EXPECT_FALSE(is_committed(dir));
  }
  commit.join();
  EXPECT_TRUE(committed && is_committed(dir));
}

TEST(Layout, PrepareCreatesTheDirectoryAndReportsACommittedOne) {
  TempDir root;
  const std::string dir = root.file("a/b/c");
  EXPECT_FALSE(prepare_checkpoint_dir(dir));
  EXPECT_TRUE(std::filesystem::is_directory(dir));
  testing::write_checkpoint(dir, testing::reference_model(), 1);
  EXPECT_TRUE(prepare_checkpoint_dir(dir));
  testing::write_text(root.file("file"), "x");
  EXPECT_THAT(error_of([&] { prepare_checkpoint_dir(root.file("file")); }),
              HasSubstr("not a directory"));
}

TEST(Layout, StaleTemporariesOfDeadWritersGoOnlyTheirs) {
  TempDir root;
  const std::string file = shard_file_name(0, 2);
  // pid 2^22 + 1 is above the kernel's pid_max default range: no such process.
  const std::string dead = "." + file + ".tmp-4194305-0123456789abcdef";
  const std::string live = "." + file + ".tmp-" + std::to_string(::getpid()) + "-0";
  const std::string other = "." + shard_file_name(1, 2) + ".tmp-4194305-0";
  for (const auto& n : {dead, live, other}) testing::write_text(root.file(n), "x");
  remove_stale_temporaries(root.path(), file);
  EXPECT_FALSE(std::filesystem::exists(root.file(dead)));
  EXPECT_TRUE(std::filesystem::exists(root.file(live)));
  EXPECT_TRUE(std::filesystem::exists(root.file(other)));
}

TEST(Layout, SidecarsRefuseTheLayoutsOwnNames) {
  TempDir root;
  write_sidecar(root.path(), "training_state.json", "{}", false);
  EXPECT_EQ(testing::read_text(root.file("training_state.json")), "{}");
  for (const char* bad : {"fsdp_ema.index.json", "shard-00000-of-00001.safetensors",
                          "x.safetensors", ".hidden", "a/b", ""}) {
    EXPECT_THAT(error_of([&] { write_sidecar(root.path(), bad, "x", false); }),
                HasSubstr("sidecar name"))
        << bad;
  }
}

TEST(Layout, ListsAndRemovesCommittedCheckpointsNeverThroughLinks) {
  TempDir root, elsewhere;
  const auto model = testing::reference_model();
  for (const char* n : {"step-2", "step-1", ".hidden"}) {
    testing::write_checkpoint(root.subdir(n), model, 1);
  }
  testing::write_checkpoint(root.subdir("partial"), model, 1);
  std::filesystem::remove(root.file("partial/" + std::string(kIndexFileName)));
  testing::write_checkpoint(elsewhere.subdir("precious"), model, 1);
  std::filesystem::create_directory_symlink(elsewhere.file("precious"), root.file("step-3"));
  std::filesystem::create_directories(root.file("step-1/sub/dir"));
  testing::write_text(root.file("step-1/sub/dir/f"), "x");
  testing::write_text(root.file("step-1/training_state.json"), "{}");

  EXPECT_THAT(committed_checkpoints(root.path(), true), ElementsAre("step-1", "step-2", "step-3"));
  EXPECT_THAT(committed_checkpoints(root.path(), false), ElementsAre("step-1", "step-2"));
  EXPECT_THAT(committed_checkpoints(root.file("missing"), false), ElementsAre());

  remove_checkpoint(root.file("step-1"));
  EXPECT_FALSE(std::filesystem::exists(root.file("step-1")));
  EXPECT_THAT(error_of([&] { remove_checkpoint(root.file("step-3")); }),
              HasSubstr("cannot open the checkpoint directory"));
  EXPECT_TRUE(is_committed(elsewhere.file("precious")));
  EXPECT_THAT(committed_checkpoints(root.path(), false), ElementsAre("step-2"));
}

TEST(Layout, RemoveCheckpointTakesTheNamedMarkersWithTheIndexBeforeAnyData) {
  TempDir root;
  const auto model = testing::reference_model();
  testing::write_checkpoint(root.subdir("ckpt"), model, 1);
  testing::write_checkpoint(root.subdir("ckpt/ema"), model, 1);  // a checkpoint nested inside
  testing::write_text(root.file("ckpt/trainer_state.json"), "{}");
  testing::write_text(root.file("ckpt/optimizer.pt"), "x");
  std::filesystem::create_directory(root.file("ckpt/not_a_file"));
  for (const char* bad : {"", ".", "..", "a/b"}) {
    EXPECT_THAT(error_of([&] { remove_checkpoint(root.file("ckpt"), {bad}); }),
                HasSubstr("first must name plain files"))
        << bad;
  }
  EXPECT_TRUE(is_committed(root.file("ckpt")));  // refused before anything changed
  // A marker that cannot go (a directory) stops the removal after the index and the markers
  // before it, before any data: the folder is incomplete to every reader, its data whole.
  EXPECT_THAT(error_of([&] {
                remove_checkpoint(root.file("ckpt"), {"trainer_state.json", "not_a_file"});
              }),
              HasSubstr("cannot remove the commit marker"));
  EXPECT_FALSE(is_committed(root.file("ckpt")));
  EXPECT_FALSE(std::filesystem::exists(root.file("ckpt/trainer_state.json")));
  EXPECT_TRUE(std::filesystem::exists(root.file("ckpt/optimizer.pt")));
  EXPECT_TRUE(is_committed(root.file("ckpt/ema")));
  remove_checkpoint(root.file("ckpt"), {"trainer_state.json"});
  EXPECT_FALSE(std::filesystem::exists(root.file("ckpt")));
}

}  // namespace
}  // namespace fsdp_ema::format
