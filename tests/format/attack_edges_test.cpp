// Edges found by an attack (issue #11): an overwrite that fails halfway, or that only some ranks
// finished, leaves the earlier export / checkpoint whole; a reader never sees a mix.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>

#include "fsdp_ema/format/checkpoint_dir.h"
#include "fsdp_ema/format/export.h"
#include "fsdp_ema/format/layout.h"
#include "fsdp_ema/format/shard_file.h"
#include "tests/format/fixture_model.h"
#include "tests/format/reference_checkpoint.h"
#include "tests/format/test_util.h"

namespace fsdp_ema::format {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using testing::error_of;
using testing::files_of;
using ::testing::HasSubstr;
using testing::TempDir;

// The model with every byte of its data changed, so that old and new values differ everywhere.
std::vector<testing::RefTensor> changed(std::vector<testing::RefTensor> model) {
  for (auto& t : model) {
    for (std::byte& b : t.data) b = t.dtype == DType::kBool ? (b ^ std::byte{1}) : ~b;
  }
  return model;
}

std::vector<std::byte> full(const CheckpointDir& ckpt, const std::string& name) {
  std::vector<std::byte> out(ckpt.tensor_nbytes(name));
  ckpt.read_full(name, out.data(), out.size());
  return out;
}

class ExportOverwrite : public testing::ReferenceCheckpointTest<3> {
 protected:
  std::string out_ = root_.file("out");
};

TEST_F(ExportOverwrite, AFailureHalfwayLeavesTheEarlierExportUntouched) {
  ExportOptions split;
  split.max_file_bytes = 150;
  const ExportResult first = export_consolidated(ckpt_, out_, split);
  ASSERT_GE(first.files.size(), 3u);
  const auto before = files_of(out_);

  // A newer checkpoint whose last tensor (in name order: the last file) is corrupted: the new
  // export fails after its first files are written.
  const std::string newer = root_.subdir("newer");
  testing::write_checkpoint(newer, changed(model_), 3);
  const CheckpointDir opened = CheckpointDir::open(newer);
  const IndexTensor& last = opened.tensors().back();
  const std::string file = newer + "/" + last.pieces.front().file;
  auto bytes = testing::read_bytes(file);
  bytes[ShardFile::open(file).tensor(last.name).data_offset] ^= std::byte{1};
  testing::write_bytes(file, bytes);
  const nlohmann::json weight_map = nlohmann::json::parse(
      testing::read_text(out_ + "/model.safetensors.index.json"))["weight_map"];
  ASSERT_NE(weight_map[last.name], first.files.front());

  split.overwrite = true;
  EXPECT_THAT(error_of([&] { export_consolidated(newer, out_, split); }),
              AllOf(HasSubstr("tensor \"" + last.name + "\""), HasSubstr("checksum mismatch")));
  // The earlier export, byte for byte, and nothing else (no staging directory left behind).
  EXPECT_EQ(files_of(out_), before);
}

TEST_F(ExportOverwrite, SplitAndSingleReplaceEachOtherWhole) {
  ExportOptions split;
  split.max_file_bytes = 150;
  export_consolidated(ckpt_, out_, split);
  ExportOptions single;
  single.overwrite = true;
  export_consolidated(ckpt_, out_, single);
  EXPECT_THAT(testing::list_names(out_), ElementsAre("model.safetensors"));
  split.overwrite = true;
  const ExportResult again = export_consolidated(ckpt_, out_, split);
  std::vector<std::string> want = again.files;
  want.push_back("model.safetensors.index.json");
  std::sort(want.begin(), want.end());
  EXPECT_EQ(testing::list_names(out_), want);  // the single file is gone: HF would read it first
  const CheckpointDir exported = CheckpointDir::open(out_);
  for (const auto& t : model_) {
    EXPECT_EQ(full(exported, t.name), t.data) << t.name;
  }
}

TEST_F(ExportOverwrite, StagingOfADeadExportIsRemoved) {
  std::filesystem::create_directories(out_);
  // pid 999999999 is above any pid_max: no such process.
  const std::string dead = out_ + "/.fsdp_ema-export.tmp-999999999-0123456789abcdef";
  std::filesystem::create_directories(dead);
  testing::write_text(dead + "/model.safetensors", "partial");
  export_consolidated(ckpt_, out_);
  EXPECT_THAT(testing::list_names(out_), ElementsAre("model.safetensors"));
}

class CommitOverwrite : public testing::ReferenceCheckpointTest<2> {
 protected:
  // Writes rank r's file of `model` where an overwrite writes it.
  void save_rank(const std::vector<testing::RefTensor>& model, int64_t r, int64_t world) {
    WriteOptions o;
    o.rank = r;
    o.world_size = world;
    write_shard_file(ckpt_ + "/" + shard_file_name_to_write(ckpt_, r, world),
                     testing::local_shards(model, r, world), o);
  }
  void expect_values(const std::vector<testing::RefTensor>& model) {
    const CheckpointDir ckpt = CheckpointDir::open(ckpt_);
    EXPECT_TRUE(ckpt.stray_files().empty());
    for (const auto& t : model) EXPECT_EQ(full(ckpt, t.name), t.data) << t.name;
  }
};

TEST_F(CommitOverwrite, OldCheckpointLoadsUntilTheNewIndexLands) {
  const auto newer = changed(model_);
  EXPECT_EQ(shard_file_name_to_write(ckpt_, 0, 2), alternate_shard_file_name(0, 2));
  EXPECT_EQ(shard_file_name_to_write(ckpt_, 0, 3), shard_file_name(0, 3));  // not referenced
  save_rank(newer, 0, 2);
  save_rank(newer, 1, 2);
  // Every new file is written, the commit has not happened: the old checkpoint, whole.
  {
    const CheckpointDir ckpt = CheckpointDir::open(ckpt_);
    for (const auto& t : model_) EXPECT_EQ(full(ckpt, t.name), t.data) << t.name;
  }
  EXPECT_THAT(error_of([&] { commit_directory(ckpt_, 2, /*overwrite=*/false, true); }),
              HasSubstr("already committed"));
  commit_directory(ckpt_, 2, /*overwrite=*/true, true);
  expect_values(newer);
  EXPECT_THAT(testing::list_names(ckpt_),
              ElementsAre("fsdp_ema.index.json", alternate_shard_file_name(0, 2),
                          alternate_shard_file_name(1, 2)));
  // The next overwrite goes back to the plain names, at another world size too.
  save_rank(model_, 0, 3);
  save_rank(model_, 1, 3);
  save_rank(model_, 2, 3);
  commit_directory(ckpt_, 3, /*overwrite=*/true, true);
  expect_values(model_);
  EXPECT_THAT(testing::list_names(ckpt_),
              ElementsAre("fsdp_ema.index.json", shard_file_name(0, 3), shard_file_name(1, 3),
                          shard_file_name(2, 3)));
}

TEST_F(CommitOverwrite, SomeRanksNewFilesAloneAreRefusedAndTheOldCheckpointStays) {
  save_rank(changed(model_), 0, 2);
  EXPECT_THAT(error_of([&] { commit_directory(ckpt_, 2, /*overwrite=*/true, true); }),
              AllOf(HasSubstr(alternate_shard_file_name(1, 2)), HasSubstr("rank 1 of 2"),
                    HasSubstr("left as it was")));
  const CheckpointDir ckpt = CheckpointDir::open(ckpt_);
  for (const auto& t : model_) EXPECT_EQ(full(ckpt, t.name), t.data) << t.name;
}

TEST_F(CommitOverwrite, RecommittingTheCommittedFilesKeepsThem) {
  commit_directory(ckpt_, 2, /*overwrite=*/true, true);
  expect_values(model_);
}

TEST_F(CommitOverwrite, ARanksFileWithNoTensorGoesAtTheCommitAndReCommitsAndOverwritesWork) {
  // Rank 0 holds everything (a replicated model: rank 0 writes it), rank 1 writes a file with no
  // tensor, as every rank must for the commit.
  TempDir fresh;
  const std::string dir = fresh.subdir("c");
  auto save = [&](const std::string& name, int64_t r, std::vector<TensorToWrite> tensors) {
    WriteOptions o;
    o.rank = r;
    o.world_size = 2;
    write_shard_file(dir + "/" + name, std::move(tensors), o);
  };
  save(shard_file_name(0, 2), 0, testing::local_shards(model_, 0, 1));
  save(shard_file_name(1, 2), 1, {});
  commit_directory(dir, 2, /*overwrite=*/false, true);
  EXPECT_THAT(testing::list_names(dir), ElementsAre("fsdp_ema.index.json", shard_file_name(0, 2)));
  auto expect_model = [&] {
    const CheckpointDir ckpt = CheckpointDir::open(dir);
    EXPECT_TRUE(ckpt.stray_files().empty());
    for (const auto& t : model_) EXPECT_EQ(full(ckpt, t.name), t.data) << t.name;
  };
  expect_model();
  commit_directory(dir, 2, /*overwrite=*/true, true);  // a re-commit: rank 1 is empty again
  expect_model();
  // An overwrite: both ranks write again (rank 0 under the alternate name), rank 1 empty again.
  save(shard_file_name_to_write(dir, 0, 2), 0, testing::local_shards(model_, 0, 1));
  save(shard_file_name_to_write(dir, 1, 2), 1, {});
  commit_directory(dir, 2, /*overwrite=*/true, true);
  EXPECT_THAT(testing::list_names(dir),
              ElementsAre("fsdp_ema.index.json", alternate_shard_file_name(0, 2)));
  expect_model();
}

TEST_F(CommitOverwrite, StrayShardFilesOfAnotherWorldSizeGoAtTheCommit) {
  TempDir fresh;
  const std::string other = fresh.subdir("c");
  // An earlier save at world size 3 that never committed, then a save at 2.
  WriteOptions o;
  o.rank = 2;
  o.world_size = 3;
  write_shard_file(other + "/" + shard_file_name(2, 3), testing::local_shards(model_, 2, 3), o);
  for (int64_t r = 0; r < 2; ++r) {
    o.rank = r;
    o.world_size = 2;
    write_shard_file(other + "/" + shard_file_name(r, 2), testing::local_shards(model_, r, 2), o);
  }
  commit_directory(other, 2, /*overwrite=*/false, true);
  EXPECT_THAT(testing::list_names(other),
              ElementsAre("fsdp_ema.index.json", shard_file_name(0, 2), shard_file_name(1, 2)));
}

}  // namespace
}  // namespace fsdp_ema::format
