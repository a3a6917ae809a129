// The file-name rules of the layout (fsdp_ema/format/names.h): every other file takes its names
// and its name tests from there, so these pin them, including on crafted names.
#include "fsdp_ema/format/names.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "fsdp_ema/format/file_util.h"

namespace fsdp_ema::format {
namespace {

TEST(Names, ShardFileNamesAndTheirAlternates) {
  EXPECT_EQ(shard_file_name(3, 8), "shard-00003-of-00008.safetensors");
  EXPECT_EQ(alternate_shard_file_name(3, 8), "shard-00003-of-00008.b.safetensors");
  EXPECT_EQ(shard_file_name(123456, 200000), "shard-123456-of-200000.safetensors");
  EXPECT_TRUE(is_shard_file_name(shard_file_name(0, 1)));
  EXPECT_TRUE(is_shard_file_name(alternate_shard_file_name(0, 1)));
  for (const char* n : {"shard-1-of-.safetensors", "shard--of-2.safetensors", "shard-1-of-2",
                        "shard-1-of-2.c.safetensors", "shard-a-of-2.safetensors",
                        "model-00001-of-00002.safetensors", ".shard-1-of-2.safetensors.tmp-1-a"}) {
    EXPECT_FALSE(is_shard_file_name(n)) << n;
  }
}

TEST(Names, DataFilesAreVisibleSafetensorsFiles) {
  EXPECT_TRUE(is_safetensors_file_name("model.safetensors"));
  EXPECT_TRUE(is_safetensors_file_name(shard_file_name(0, 2)));
  EXPECT_FALSE(is_safetensors_file_name(".model.safetensors"));
  EXPECT_FALSE(is_safetensors_file_name("model.safetensors.index.json"));
  EXPECT_FALSE(is_safetensors_file_name(kIndexFileName));
}

TEST(Names, DcpHuggingFaceFileNames) {
  auto plain = parse_dcp_file_name("model-00002-of-00005.safetensors");
  ASSERT_TRUE(plain);
  EXPECT_EQ(plain->shard, 0);
  EXPECT_EQ(plain->model, 2);
  EXPECT_EQ(plain->of, 5);
  auto sharded = parse_dcp_file_name("shard-00004-model-00001-of-00001.safetensors");
  ASSERT_TRUE(sharded);
  EXPECT_EQ(sharded->shard, 4);
  EXPECT_EQ(sharded->model, 1);
  // std::string, not const char*: a pointer into shard_file_name's temporary would dangle.
  const std::vector<std::string> refused = {"model-00000-of-00005.safetensors",
                                            "model-00006-of-00005.safetensors",
                                            "model-1-of-1234567890.safetensors",
                                            "shard-x-model-1-of-1.safetensors",
                                            "model-1-of-1.bin",
                                            "model.safetensors",
                                            shard_file_name(0, 2)};
  for (const std::string& n : refused) {
    EXPECT_FALSE(parse_dcp_file_name(n)) << n;
  }
}

TEST(Names, TemporariesCarryTheirWritersPid) {
  const std::string prefix = temporary_name_prefix("shard-00000-of-00001.safetensors");
  EXPECT_EQ(prefix, ".shard-00000-of-00001.safetensors.tmp-");
  EXPECT_EQ(temporary_owner_pid(prefix + "4242-0123456789abcdef", prefix), 4242);
  EXPECT_EQ(temporary_owner_pid("other.tmp-4242-0", prefix), 0);
  // A crafted name of endless digits is not a pid (and is read in one pass, never overflows).
  EXPECT_EQ(temporary_owner_pid(prefix + std::string(100000, '9'), prefix), 0);
  // temp_path_for names its temporaries with this prefix and this process's pid.
  const std::string tmp =
      detail::base_name(detail::temp_path_for("/d/shard-00000-of-00001.safetensors"));
  EXPECT_EQ(temporary_owner_pid(tmp, prefix), static_cast<long>(::getpid()));
  EXPECT_FALSE(detail::temporary_is_orphaned(tmp, prefix));  // this process is alive
  EXPECT_FALSE(is_safetensors_file_name(tmp));
}

}  // namespace
}  // namespace fsdp_ema::format
