#include "fsdp_ema/format/dtype.h"

#include <array>

namespace fsdp_ema::format {
namespace {

struct DTypeInfo {
  DType dtype;
  std::string_view name;
  size_t size;
  bool floating;
};

constexpr std::array<DTypeInfo, 12> kInfos = {{
    {DType::kF64, "F64", 8, true},
    {DType::kF32, "F32", 4, true},
    {DType::kF16, "F16", 2, true},
    {DType::kBF16, "BF16", 2, true},
    {DType::kI64, "I64", 8, false},
    {DType::kI32, "I32", 4, false},
    {DType::kI16, "I16", 2, false},
    {DType::kI8, "I8", 1, false},
    {DType::kU8, "U8", 1, false},
    {DType::kBool, "BOOL", 1, false},
    {DType::kF8E4M3, "F8_E4M3", 1, true},
    {DType::kF8E5M2, "F8_E5M2", 1, true},
}};

constexpr std::array<DType, 12> kAll = [] {
  std::array<DType, 12> all{};
  for (size_t i = 0; i < kInfos.size(); ++i) all[i] = kInfos[i].dtype;
  return all;
}();

const DTypeInfo& info(DType dtype) {
  // The enum values are the table indices; a value outside the enum is a caller bug.
  const auto i = static_cast<size_t>(dtype);
  return kInfos[i < kInfos.size() ? i : 0];
}

}  // namespace

std::string_view dtype_name(DType dtype) { return info(dtype).name; }

std::optional<DType> parse_dtype(std::string_view name) {
  for (const DTypeInfo& i : kInfos) {
    if (i.name == name) return i.dtype;
  }
  return std::nullopt;
}

size_t dtype_size(DType dtype) { return info(dtype).size; }

bool is_floating(DType dtype) { return info(dtype).floating; }

std::span<const DType> all_dtypes() { return kAll; }

}  // namespace fsdp_ema::format
