#include "fsdp_ema/format/dtype_cast.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "tests/format/test_util.h"

namespace fsdp_ema::format {
namespace {

using testing::error_of;
using ::testing::HasSubstr;

// One element through cast_elements (the export's conversion), its bits in and out.
template <typename To, typename From>
To cast_one(DType from, From value, DType to) {
  To out{};
  cast_elements(from, &value, to, &out, 1);
  return out;
}
uint16_t f32_to_bf16_bits(float v) { return cast_one<uint16_t>(DType::kF32, v, DType::kBF16); }
uint16_t f32_to_f16_bits(float v) { return cast_one<uint16_t>(DType::kF32, v, DType::kF16); }
uint16_t f64_to_bf16_bits(double v) { return cast_one<uint16_t>(DType::kF64, v, DType::kBF16); }
uint16_t f64_to_f16_bits(double v) { return cast_one<uint16_t>(DType::kF64, v, DType::kF16); }
float bf16_bits_to_f32(uint16_t b) { return cast_one<float>(DType::kBF16, b, DType::kF32); }
float f16_bits_to_f32(uint16_t b) { return cast_one<float>(DType::kF16, b, DType::kF32); }

TEST(DTypeCast, F32ToBf16RoundsToNearestEven) {
  EXPECT_EQ(f32_to_bf16_bits(1.0f), 0x3F80);
  // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to the even mantissa (1.0).
  EXPECT_EQ(f32_to_bf16_bits(1.0f + 0x1p-8f), 0x3F80);
  // 1 + 3 * 2^-8 is halfway between 1 + 2^-7 (odd) and 1 + 2^-6: rounds up to even.
  EXPECT_EQ(f32_to_bf16_bits(1.0f + 3 * 0x1p-8f), 0x3F82);
  EXPECT_EQ(f32_to_bf16_bits(1.0f + 0x1p-8f + 0x1p-20f), 0x3F81);  // above the tie
  EXPECT_EQ(f32_to_bf16_bits(-0.0f), 0x8000);
  EXPECT_EQ(f32_to_bf16_bits(std::numeric_limits<float>::max()), 0x7F80);  // overflows to inf
  EXPECT_EQ(f32_to_bf16_bits(-std::numeric_limits<float>::infinity()), 0xFF80);
}

TEST(DTypeCast, NanStaysNanWithItsSign) {
  const float qnan = std::numeric_limits<float>::quiet_NaN();
  // A signalling NaN whose payload lives only in the low bits would become infinity if the
  // bits were simply truncated.
  const float snan = std::bit_cast<float>(0x7F800001u);
  const float neg_nan = std::bit_cast<float>(0xFFC00000u);
  for (float v : {qnan, snan, neg_nan}) {
    const uint16_t b = f32_to_bf16_bits(v);
    EXPECT_TRUE(std::isnan(bf16_bits_to_f32(b))) << std::hex << b;
    EXPECT_EQ(std::signbit(bf16_bits_to_f32(b)), std::signbit(v));
    const uint16_t h = f32_to_f16_bits(v);
    EXPECT_TRUE(std::isnan(f16_bits_to_f32(h))) << std::hex << h;
    EXPECT_EQ(std::signbit(f16_bits_to_f32(h)), std::signbit(v));
    EXPECT_TRUE(std::isnan(bf16_bits_to_f32(f64_to_bf16_bits(static_cast<double>(v)))));
  }
}

TEST(DTypeCast, F16EdgeCases) {
  EXPECT_EQ(f32_to_f16_bits(1.0f), 0x3C00);
  EXPECT_EQ(f32_to_f16_bits(65504.0f), 0x7BFF);      // largest finite
  EXPECT_EQ(f32_to_f16_bits(65519.0f), 0x7BFF);      // below the halfway point
  EXPECT_EQ(f32_to_f16_bits(65520.0f), 0x7C00);      // halfway: ties to even = infinity
  EXPECT_EQ(f32_to_f16_bits(0x1p-24f), 0x0001);      // smallest subnormal
  EXPECT_EQ(f32_to_f16_bits(0x1p-25f), 0x0000);      // halfway to 0: ties to even (0)
  EXPECT_EQ(f32_to_f16_bits(0x1.8p-24f), 0x0002);    // 1.5 ulp: ties to even (2)
  EXPECT_EQ(f32_to_f16_bits(0x1.004p-25f), 0x0001);  // just above halfway
  EXPECT_EQ(f32_to_f16_bits(0x1.ff8p-15f), 0x03FF);  // largest subnormal
  EXPECT_EQ(f32_to_f16_bits(0x1.ffcp-15f), 0x0400);  // halfway above it: into the smallest normal
  EXPECT_EQ(f32_to_f16_bits(-0.0f), 0x8000);
  EXPECT_EQ(f32_to_f16_bits(1e-30f), 0x0000);
}

TEST(DTypeCast, F64ToHalfPrecisionRoundsOnce) {
  // 1 + 2^-11 + 2^-30: rounding through F32 first would land exactly on the F16 tie
  // (1 + 2^-11) and then round down to 1.0; the correct single rounding goes up.
  const double x = 1.0 + 0x1p-11 + 0x1p-30;
  EXPECT_EQ(f64_to_f16_bits(x), 0x3C01);
  EXPECT_EQ(f32_to_f16_bits(static_cast<float>(x)), 0x3C00);  // the double-rounded value
  const double y = 1.0 + 0x1p-8 + 0x1p-40;                    // same trap for BF16
  EXPECT_EQ(f64_to_bf16_bits(y), 0x3F81);
}

TEST(DTypeCast, EveryHalfPrecisionValueSurvivesAWideningRoundTrip) {
  // NaNs keep sign and payload and come back quiet (a signalling NaN gains the quiet bit).
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const auto h = static_cast<uint16_t>(b);
    const bool f16_nan = (h & 0x7C00) == 0x7C00 && (h & 0x03FF) != 0;
    const bool bf16_nan = (h & 0x7F80) == 0x7F80 && (h & 0x007F) != 0;
    const uint16_t f16_want = f16_nan ? (h | 0x0200) : h;
    const uint16_t bf16_want = bf16_nan ? (h | 0x0040) : h;
    EXPECT_EQ(f32_to_f16_bits(f16_bits_to_f32(h)), f16_want) << std::hex << b;
    EXPECT_EQ(f32_to_bf16_bits(bf16_bits_to_f32(h)), bf16_want) << std::hex << b;
    EXPECT_EQ(f64_to_f16_bits(static_cast<double>(f16_bits_to_f32(h))), f16_want) << std::hex << b;
  }
}

#if defined(__FLT16_MANT_DIG__) && defined(__x86_64__)
TEST(DTypeCast, F32AndF64ToF16MatchTheCompiler) {
  std::mt19937_64 rng(42);
  for (int i = 0; i < 200'000; ++i) {
    const auto bits = static_cast<uint32_t>(rng());
    const float f = std::bit_cast<float>(bits);
    if (std::isnan(f)) continue;
    const _Float16 h = static_cast<_Float16>(f);
    EXPECT_EQ(f32_to_f16_bits(f), std::bit_cast<uint16_t>(h)) << std::hexfloat << f;
    const double d = std::bit_cast<double>(rng() & 0xBFFFFFFFFFFFFFFFull);  // |d| < 2
    if (std::isnan(d)) continue;
    EXPECT_EQ(f64_to_f16_bits(d), std::bit_cast<uint16_t>(static_cast<_Float16>(d)))
        << std::hexfloat << d;
  }
}
#endif

TEST(DTypeCast, F32ToBf16MatchesTheGenericRounding) {
  std::mt19937 rng(7);
  for (int i = 0; i < 200'000; ++i) {
    const float f = std::bit_cast<float>(static_cast<uint32_t>(rng()));
    if (std::isnan(f)) continue;
    EXPECT_EQ(f32_to_bf16_bits(f), f64_to_bf16_bits(static_cast<double>(f))) << std::hexfloat << f;
  }
}

TEST(DTypeCast, CastElementsF32ToBf16IsTheScalarRuleOnEveryElement) {
  std::mt19937 rng(11);
  std::vector<uint32_t> bits(100'003);
  for (auto& b : bits) b = static_cast<uint32_t>(rng());
  bits[0] = 0x7fc00001;  // a quiet NaN with a payload
  bits[1] = 0xff800001;  // a signalling negative NaN
  bits[2] = 0x7f7fffff;  // the largest float: rounds to infinity
  std::vector<uint16_t> out(bits.size());
  cast_elements(DType::kF32, bits.data(), DType::kBF16, out.data(), bits.size());
  for (size_t i = 0; i < bits.size(); ++i) {
    ASSERT_EQ(out[i], f32_to_bf16_bits(std::bit_cast<float>(bits[i]))) << std::hex << bits[i];
  }
  EXPECT_EQ(out[0], 0x7fc0);
  EXPECT_EQ(out[1], 0xffc0);
  EXPECT_EQ(out[2], 0x7f80);
}

TEST(DTypeCast, CastElementsConvertsArraysAndRejectsIntegers) {
  const float src[4] = {1.0f, -2.5f, 65504.0f, 1e9f};
  uint16_t h[4];
  cast_elements(DType::kF32, src, DType::kF16, h, 4);
  EXPECT_EQ(h[0], 0x3C00);
  EXPECT_EQ(h[1], 0xC100);
  EXPECT_EQ(h[2], 0x7BFF);
  EXPECT_EQ(h[3], 0x7C00);
  double back[4];
  cast_elements(DType::kF16, h, DType::kF64, back, 4);
  EXPECT_EQ(back[1], -2.5);
  EXPECT_TRUE(std::isinf(back[3]));
  float f[4];
  cast_elements(DType::kF64, back, DType::kF32, f, 4);
  EXPECT_EQ(f[2], 65504.0f);
  uint16_t bf[4];
  cast_elements(DType::kF16, h, DType::kBF16, bf, 4);
  EXPECT_EQ(bf[0], 0x3F80);
  EXPECT_FALSE(can_cast(DType::kI32, DType::kF32));
  EXPECT_THAT(error_of([&] { cast_elements(DType::kI32, src, DType::kF32, f, 1); }),
              HasSubstr("cast from I32 to F32 is not supported"));
}

}  // namespace
}  // namespace fsdp_ema::format
