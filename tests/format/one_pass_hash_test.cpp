// The one-pass checksums (xxh3_blocks_impl.h, TensorHasher): a tensor's checksum and its block
// checksums from one pass over its bytes equal XXH3-64 of the tensor and of each block computed
// by xxHash itself (the reference, compiled into this test), for sizes at every edge of XXH3's
// 1024-byte unit, its 240-byte short-input limit and the blocks, fed in any split, on every
// instruction set, and as the writer stores them in a file.
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "fsdp_ema/format/checksum.h"
#include "fsdp_ema/format/names.h"
#include "fsdp_ema/format/shard_file.h"
#include "fsdp_ema/format/xxh3_ops.h"
#include "tests/format/fixture_model.h"
#include "tests/format/test_util.h"

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace fsdp_ema::format {
namespace {

constexpr uint64_t kUnit = detail::kXxh3UnitBytes;

uint64_t reference(const std::byte* p, size_t n) { return XXH3_64bits(p, n); }

// XXH3-64 of every block of `block` bytes of data (the last one shorter), by the reference.
std::vector<uint64_t> reference_blocks(const std::vector<std::byte>& data, uint64_t block) {
  std::vector<uint64_t> out;
  if (data.size() <= block) return out;
  for (size_t pos = 0; pos < data.size(); pos += block) {
    out.push_back(reference(data.data() + pos, std::min<size_t>(block, data.size() - pos)));
  }
  return out;
}

// Sizes at every edge for blocks of `block` bytes: a block's end, the last block at 1, 63-65,
// 240-241 (XXH3's short-input limit), a unit's end and beyond, more than two blocks.
std::vector<size_t> edge_sizes(uint64_t block) {
  std::vector<size_t> out;
  for (uint64_t blocks : {1u, 2u}) {
    for (uint64_t extra : {1u, 17u, 63u, 64u, 65u, 239u, 240u, 241u, 1023u, 1024u, 1025u, 1089u}) {
      if (extra < block) out.push_back(static_cast<size_t>(blocks * block + extra));
    }
    out.push_back(static_cast<size_t>((blocks + 1) * block - 1));
    out.push_back(static_cast<size_t>((blocks + 1) * block));
  }
  return out;
}

// Splits of n bytes: at once, in fixed steps (below, at and around a unit), at random points.
std::vector<std::vector<size_t>> splits(size_t n, uint32_t seed) {
  std::vector<std::vector<size_t>> out;
  out.push_back({n});
  for (size_t step : {7u, 1000u, 1024u, 1025u, 65539u}) {
    std::vector<size_t> s;
    for (size_t pos = 0; pos < n; pos += step) s.push_back(std::min(step, n - pos));
    out.push_back(std::move(s));
  }
  std::mt19937 rng(seed);
  std::vector<size_t> s;
  for (size_t pos = 0; pos < n;) {
    const size_t take = std::min<size_t>(n - pos, 1 + rng() % 3000);
    s.push_back(take);
    pos += take;
  }
  out.push_back(std::move(s));
  return out;
}

TEST(OnePassHash, EqualsXxh3OfTheTensorAndOfEveryBlockForAnySizeAndSplit) {
  for (uint64_t block : {kUnit, 4 * kUnit, kChecksumBlockBytes}) {
    for (size_t n : edge_sizes(block)) {
      const auto data = testing::pattern_bytes(n, static_cast<uint32_t>(n), DType::kU8);
      const uint64_t whole = reference(data.data(), n);
      const std::vector<uint64_t> blocks = reference_blocks(data, block);
      for (const auto& split : splits(n, static_cast<uint32_t>(n + block))) {
        TensorHasher h(n, block);
        size_t pos = 0;
        for (size_t take : split) {
          h.update(data.data() + pos, take);
          pos += take;
        }
        EXPECT_EQ(h.digest(), whole) << "block " << block << ", " << n << " bytes";
        EXPECT_EQ(h.blocks(), blocks)
            << "block " << block << ", " << n << " bytes, " << split.size() << " pieces";
      }
    }
  }
}

TEST(OnePassHash, BlocksBelowAUnitAndOneBlockTensorsGiveTheSameValues) {
  // Blocks smaller than XXH3's unit hash each byte twice (no one-pass rule for them); a tensor of
  // at most one block has its checksum only.
  for (uint64_t block : {64u, 512u}) {
    for (size_t n : {block + 1, 5 * block + 63, 20 * block}) {
      const auto data = testing::pattern_bytes(n, 9, DType::kU8);
      TensorHasher h(n, block);
      for (size_t pos = 0; pos < n; pos += 100)
        h.update(data.data() + pos, std::min<size_t>(100, n - pos));
      EXPECT_EQ(h.digest(), reference(data.data(), n));
      EXPECT_EQ(h.blocks(), reference_blocks(data, block));
    }
  }
  for (size_t n : {0u, 1u, 240u, 241u, 4096u}) {
    const auto data = testing::pattern_bytes(n, 3, DType::kU8);
    TensorHasher h(n, 4096);
    h.update(data.data(), n);
    EXPECT_EQ(h.digest(), reference(data.data(), n)) << n;
    EXPECT_TRUE(h.blocks().empty()) << n;
  }
}

std::vector<const detail::Xxh3Ops*> instruction_sets() {
  std::vector<const detail::Xxh3Ops*> out{&detail::kXxh3Default};
#if defined(FSDP_EMA_FORMAT_HAVE_AVX2)
  if (__builtin_cpu_supports("avx2")) out.push_back(&detail::kXxh3Avx2);
#endif
  return out;
}

TEST(OnePassHash, EveryInstructionSetsLanesEqualXxh3) {
  for (const detail::Xxh3Ops* ops : instruction_sets()) {
    // One input, no blocks: every unit but the last, then the last (its last stripe reaching
    // into the unit before when it has fewer than 64 bytes).
    for (size_t n : {241u, 1000u, 1024u, 1025u, 1087u, 1088u, 2048u, 2049u, 5000u, 65537u}) {
      const auto data = testing::pattern_bytes(n, static_cast<uint32_t>(n) + 1, DType::kU8);
      alignas(64) uint64_t whole[8];
      alignas(64) uint64_t spare[8];
      ops->lanes_init(whole);
      ops->lanes_init(spare);
      const size_t last = (n - 1) / kUnit;
      if (last > 0) ops->lanes_units(whole, spare, data.data(), last, false);
      const size_t rem = n - last * kUnit;
      ops->lanes_tail(whole, data.data() + last * kUnit, rem, data.data() + n - 64);
      EXPECT_EQ(ops->lanes_merge(whole, n), reference(data.data(), n)) << n;
    }
    // Blocks of 2 units, 5 units and 300 bytes: two blocks end inside the pass, the third ends
    // with the input.
    const size_t n = 5 * kUnit + 300;
    const auto data = testing::pattern_bytes(n, 77, DType::kU8);
    alignas(64) uint64_t whole[8];
    alignas(64) uint64_t block[8];
    ops->lanes_init(whole);
    std::vector<uint64_t> blocks;
    for (size_t b = 0; b < 2; ++b) {
      ops->lanes_init(block);
      ops->lanes_units(whole, block, data.data() + 2 * b * kUnit, 2, true);
      blocks.push_back(ops->lanes_merge(block, 2 * kUnit));
    }
    ops->lanes_init(block);
    ops->lanes_units(whole, block, data.data() + 4 * kUnit, 1, false);
    const std::byte* tail = data.data() + 5 * kUnit;
    ops->lanes_tail(whole, tail, 300, tail + 300 - 64);
    ops->lanes_tail(block, tail, 300, tail + 300 - 64);
    blocks.push_back(ops->lanes_merge(block, kUnit + 300));
    EXPECT_EQ(ops->lanes_merge(whole, n), reference(data.data(), n));
    EXPECT_EQ(blocks, reference_blocks(data, 2 * kUnit));
  }
}

TEST(OnePassHash, TheWriterStoresTheReferenceChecksums) {
  // Staging chunks of 33 stripes split units everywhere; "big" (over 256 KiB) is written
  // straight from its memory in those chunks, the others through the staging buffers.
  const std::vector<testing::RefTensor> model = {
      testing::make_ref("big", DType::kF32, {70001}, 41),
      testing::make_ref("mid", DType::kBF16, {3, 1111}, 42),
      testing::make_ref("odd", DType::kU8, {2 * kUnit + 17}, 43),
      testing::make_ref("small", DType::kF32, {50}, 44)};
  testing::TempDir dir;
  WriteOptions options;
  options.fsync = false;
  options.chunk_bytes = 33 * 64;
  options.checksum_block_bytes = 2 * kUnit;
  testing::write_checkpoint(dir.path(), model, 1, options);
  const ShardFile file = ShardFile::open(dir.file(shard_file_name(0, 1)));
  for (const testing::RefTensor& t : model) {
    const TensorInfo& info = file.tensor(t.name);
    EXPECT_EQ(*info.checksum, reference(t.data.data(), t.data.size())) << t.name;
    EXPECT_EQ(info.block_checksums, reference_blocks(t.data, 2 * kUnit)) << t.name;
  }
  EXPECT_EQ(file.verify_all(), model.size());
}

}  // namespace
}  // namespace fsdp_ema::format
