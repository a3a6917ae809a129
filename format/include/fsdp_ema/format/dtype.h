// Element types of the safetensors format: names, sizes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string_view>

namespace fsdp_ema::format {

// The safetensors dtypes this format reads and writes. Their on-disk names are the safetensors
// ones: "F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL", "F8_E4M3",
// "F8_E5M2". Any other name in a file is an error (never guessed, unlike DCP's reader).
enum class DType : uint8_t {
  kF64,
  kF32,
  kF16,
  kBF16,
  kI64,
  kI32,
  kI16,
  kI8,
  kU8,
  kBool,
  kF8E4M3,
  kF8E5M2,
};

// The safetensors name, e.g. "BF16".
std::string_view dtype_name(DType dtype);

// The dtype for an exact (case-sensitive) safetensors name, or nullopt.
std::optional<DType> parse_dtype(std::string_view name);

// Bytes per element: 8, 4, 2, 2, 8, 4, 2, 1, 1, 1, 1, 1 in enum order.
size_t dtype_size(DType dtype);

// F64, F32, F16, BF16, F8_E4M3, F8_E5M2.
bool is_floating(DType dtype);

// Every dtype, in enum order.
std::span<const DType> all_dtypes();

}  // namespace fsdp_ema::format
