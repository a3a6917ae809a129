#include "fsdp_ema/format/dtype.h"

#include <gtest/gtest.h>

#include "fsdp_ema/format/shape.h"

namespace fsdp_ema::format {
namespace {

TEST(DType, NamesRoundTripAndSizesMatchSafetensors) {
  const std::pair<const char*, size_t> expected[] = {
      {"F64", 8}, {"F32", 4}, {"F16", 2}, {"BF16", 2}, {"I64", 8},     {"I32", 4},
      {"I16", 2}, {"I8", 1},  {"U8", 1},  {"BOOL", 1}, {"F8_E4M3", 1}, {"F8_E5M2", 1}};
  ASSERT_EQ(all_dtypes().size(), std::size(expected));
  for (size_t i = 0; i < std::size(expected); ++i) {
    const DType d = all_dtypes()[i];
    EXPECT_EQ(dtype_name(d), expected[i].first);
    EXPECT_EQ(dtype_size(d), expected[i].second);
    EXPECT_EQ(parse_dtype(expected[i].first), d);
  }
}

TEST(DType, UnknownOrMiscasedNamesAreRejected) {
  for (const char* name : {"f32", "FP32", "F4", "U16", "C64", "", "F8_E8M0", "BF16 "}) {
    EXPECT_FALSE(parse_dtype(name).has_value()) << name;
  }
}

TEST(DType, FloatingFlag) {
  EXPECT_TRUE(is_floating(DType::kBF16));
  EXPECT_TRUE(is_floating(DType::kF8E5M2));
  EXPECT_FALSE(is_floating(DType::kI64));
  EXPECT_FALSE(is_floating(DType::kBool));
}

TEST(Shape, NumelAndBytesAreOverflowChecked) {
  EXPECT_EQ(numel(Shape{}), 1u);
  EXPECT_EQ(numel(Shape{0, 1LL << 62}), 0u);
  EXPECT_EQ(numel(Shape{3, 4, 5}), 60u);
  EXPECT_FALSE(numel(Shape{1LL << 32, 1LL << 31}).has_value());
  EXPECT_FALSE(numel(Shape{-1, 2}).has_value());
  EXPECT_EQ(nbytes(Shape{2, 3}, DType::kF64), 48u);
  EXPECT_FALSE(nbytes(Shape{1LL << 61}, DType::kF64).has_value());  // 2^64 bytes
  EXPECT_FALSE(nbytes(Shape{1LL << 60}, DType::kF64).has_value());  // 2^63 > INT64_MAX
  EXPECT_EQ(shape_to_string(Shape{}), "[]");
  EXPECT_EQ(shape_to_string(Shape{4, 8}), "[4, 8]");
}

TEST(Shape, IntersectBoxes) {
  auto b = intersect(Box{{0, 2}, {4, 4}}, Box{{3, 0}, {5, 3}});
  ASSERT_TRUE(b.has_value());
  EXPECT_EQ(b->offsets, (Shape{3, 2}));
  EXPECT_EQ(b->shape, (Shape{1, 1}));
  EXPECT_FALSE(intersect(Box{{0}, {4}}, Box{{4}, {2}}).has_value());  // touching, not overlapping
  EXPECT_FALSE(intersect(Box{{0}, {0}}, Box{{0}, {2}}).has_value());  // empty box
  EXPECT_TRUE(intersect(Box{{}, {}}, Box{{}, {}}).has_value());       // 0-dim
}

}  // namespace
}  // namespace fsdp_ema::format
