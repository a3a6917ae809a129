#include "fsdp_ema/format/checksum.h"

#include <gtest/gtest.h>

#include <vector>

#include "fsdp_ema/format/xxh3_ops.h"
#include "tests/format/fixture_model.h"

namespace fsdp_ema::format {
namespace {

TEST(Checksum, MatchesPublishedXxh3Values) {
  // XXH3_64bits("") and XXH3_64bits("a") (seed 0), from the xxHash reference implementation.
  EXPECT_EQ(checksum_of(nullptr, 0), 0x2D06800538D394C2ull);
  EXPECT_EQ(checksum_of("a", 1), 0xE6C632B61E964E1Full);
}

TEST(Checksum, StreamingEqualsOneShotForAnySplit) {
  const auto data = testing::pattern_bytes(100'000, 7, DType::kU8);
  const uint64_t whole = checksum_of(data.data(), data.size());
  for (size_t step : {1u, 7u, 64u, 240u, 4096u, 99'999u}) {
    Checksummer h;
    for (size_t pos = 0; pos < data.size(); pos += step) {
      h.update(data.data() + pos, std::min(step, data.size() - pos));
    }
    EXPECT_EQ(h.digest(), whole) << "step " << step;
  }
  Checksummer h;
  h.update(data.data(), 10);
  h.reset();
  EXPECT_EQ(h.digest(), checksum_of(nullptr, 0));
}

TEST(Checksum, EveryInstructionSetGivesTheSameValue) {
#if defined(FSDP_EMA_FORMAT_HAVE_AVX2)
  if (!__builtin_cpu_supports("avx2")) GTEST_SKIP() << "no AVX2 on this CPU";
  for (size_t n : {0u, 1u, 3u, 16u, 17u, 128u, 129u, 240u, 241u, 1000u, 1u << 20}) {
    const auto data = testing::pattern_bytes(n, static_cast<uint32_t>(n), DType::kU8);
    EXPECT_EQ(detail::kXxh3Default.oneshot(data.data(), n),
              detail::kXxh3Avx2.oneshot(data.data(), n))
        << n;
  }
#else
  GTEST_SKIP() << "single instruction set build";
#endif
}

TEST(Checksum, TextFormRoundTripsAndRejectsLookalikes) {
  EXPECT_EQ(format_checksum(0x0123456789abcdefull), "xxh3-64:0123456789abcdef");
  EXPECT_EQ(format_checksum(0), "xxh3-64:0000000000000000");
  EXPECT_EQ(parse_checksum("xxh3-64:0123456789abcdef"), 0x0123456789abcdefull);
  for (const char* bad :
       {"xxh3-64:0123456789ABCDEF", "xxh3-64:0123456789abcde", "xxh3-64:0123456789abcdef0",
        "xxh64:0123456789abcdef", "0123456789abcdef", "xxh3-64:0123456789abcdeg", ""}) {
    EXPECT_FALSE(parse_checksum(bad).has_value()) << bad;
  }
}

}  // namespace
}  // namespace fsdp_ema::format
