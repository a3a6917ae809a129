// The save fast paths of issue #11: checksum digits patched into the header written once, and
// the commit's use of the descriptions this process wrote (fsdp_ema/format/recent_shards.h). Each
// must give exactly what the slow path (a second serialization, a parse of the file) gives.
#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <fstream>
#include <string>
#include <vector>

#include "fsdp_ema/format/checksum.h"
#include "fsdp_ema/format/file_util.h"
#include "fsdp_ema/format/index.h"
#include "fsdp_ema/format/names.h"
#include "fsdp_ema/format/recent_shards.h"
#include "fsdp_ema/format/shard_file.h"
#include "fsdp_ema/format/shard_writer.h"
#include "tests/format/fixture_model.h"
#include "tests/format/read_helpers.h"
#include "tests/format/test_util.h"

namespace fsdp_ema::format {
namespace {

using testing::make_ref;
using testing::RefTensor;
using testing::TempDir;

// Names whose quoting into the checksums document and again into the header adds escapes before
// the digits: quotes, backslashes, control characters, multi-byte UTF-8, and a name that looks
// like a checksum itself.
std::vector<RefTensor> awkward_tensors() {
  const std::vector<std::string> names = {"plain.weight",
                                          "quo\"te",
                                          "back\\slash",
                                          "new\nline\ttab\x01",
                                          "caf\xC3\xA9",
                                          "\xE5\x90\x8D\xE5\x89\x8D",
                                          "xxh3-64:0000000000000000",
                                          "\\\"\\\"\\\\",
                                          "z.last"};
  std::vector<RefTensor> refs;
  uint32_t seed = 7;
  for (const std::string& n : names) refs.push_back(make_ref(n, DType::kF32, {3, 2}, seed++));
  refs.push_back(make_ref("half", DType::kF16, {5}, seed++));
  refs.push_back(make_ref("bytes", DType::kU8, {9}, seed++));
  return refs;
}

std::vector<TensorToWrite> to_write(const std::vector<RefTensor>& refs) {
  std::vector<TensorToWrite> out;
  for (const RefTensor& r : refs) {
    out.push_back(TensorToWrite::full(r.name, r.dtype, r.shape, r.data.data()));
  }
  return out;
}

TEST(SaveFastPaths, PatchedChecksumsMatchTheDataForAwkwardNames) {
  TempDir dir;
  const auto refs = awkward_tensors();
  write_shard_file(dir.file("s.safetensors"), to_write(refs));
  // Opening with checksums verified parses the patched header and hashes every tensor.
  const ShardFile f = ShardFile::open(dir.file("s.safetensors"), /*verify_checksums=*/true);
  ASSERT_EQ(f.tensors().size(), refs.size());
  for (const RefTensor& r : refs) {
    const TensorInfo* t = f.find(r.name);
    ASSERT_NE(t, nullptr) << r.name;
    ASSERT_TRUE(t->checksum.has_value()) << r.name;
    EXPECT_EQ(*t->checksum, checksum_of(r.data.data(), r.data.size())) << r.name;
    EXPECT_NE(*t->checksum, 0u) << r.name;  // not left as the zero placeholder
  }
}

TEST(SaveFastPaths, CommitFromMemoryEqualsCommitFromTheFile) {
  TempDir dir;
  const auto refs = awkward_tensors();
  const std::string path = detail::join_path(dir.path(), shard_file_name(0, 1));
  write_shard_file(path, to_write(refs));
  // What the commit would take from memory, against a parse of the same file.
  auto remembered = detail::take_written_shard(path);
  ASSERT_TRUE(remembered.has_value());
  EXPECT_FALSE(detail::take_written_shard(path).has_value()) << "a description is used once";
  const ShardFile f = ShardFile::open(path, /*verify_checksums=*/false);
  ASSERT_EQ(remembered->tensors.size(), f.tensors().size());
  for (size_t i = 0; i < f.tensors().size(); ++i) {
    const TensorInfo& a = remembered->tensors[i];
    const TensorInfo& b = f.tensors()[i];
    EXPECT_EQ(a.name, b.name);
    EXPECT_EQ(a.dtype, b.dtype) << a.name;
    EXPECT_EQ(a.shape, b.shape) << a.name;
    EXPECT_EQ(a.offsets, b.offsets) << a.name;
    EXPECT_EQ(a.global_shape, b.global_shape) << a.name;
    EXPECT_EQ(a.checksum, b.checksum) << a.name;
    EXPECT_EQ(a.data_offset, b.data_offset) << a.name;
    EXPECT_EQ(a.nbytes, b.nbytes) << a.name;
  }
  EXPECT_EQ(remembered->file_bytes, f.file_bytes());

  // The index JSON is the same whether the commit parses the file or not.
  TempDir other;
  const std::string path2 = detail::join_path(other.path(), shard_file_name(0, 1));
  write_shard_file(path2, to_write(refs));
  const std::string from_memory = index_to_json(testing::index_of_rank_files(other.path(), 1));
  ASSERT_FALSE(detail::take_written_shard(path2).has_value()) << "the commit consumed it";
  const std::string from_file = index_to_json(testing::index_of_rank_files(other.path(), 1));
  EXPECT_EQ(from_memory, from_file);
}

TEST(SaveFastPaths, RewrittenFileIsParsedAgain) {
  TempDir dir;
  const auto refs = awkward_tensors();
  const std::string path = detail::join_path(dir.path(), shard_file_name(0, 1));
  write_shard_file(path, to_write(refs));
  // One header byte changed in place (a tensor renamed), then the modification time put back,
  // as a rewrite within one tick of a coarse file-system clock leaves it: only the header's
  // bytes tell. The remembered description must not be used.
  struct stat before {};
  ASSERT_EQ(::stat(path.c_str(), &before), 0);
  {
    std::fstream io(path, std::ios::in | std::ios::out | std::ios::binary);
    std::string head(4096, '\0');
    io.read(head.data(), static_cast<std::streamsize>(head.size()));
    const auto at = head.find("z.last\\\":");  // inside the checksums document
    const auto at2 = at == std::string::npos ? head.find("z.last") : at;
    ASSERT_NE(at2, std::string::npos);
    io.clear();
    io.seekp(static_cast<std::streamoff>(at2));
    io.put('y');
  }
  const struct timespec times[2] = {before.st_atim, before.st_mtim};
  ASSERT_EQ(::utimensat(AT_FDCWD, path.c_str(), times, 0), 0);
  EXPECT_FALSE(detail::take_written_shard(path).has_value());
}

}  // namespace
}  // namespace fsdp_ema::format
