#include "ops/format_bridge.h"

namespace fsdp_ema::ops {

std::optional<format::DType> format_dtype_of(at::ScalarType t) {
  switch (t) {
    case at::kDouble:
      return format::DType::kF64;
    case at::kFloat:
      return format::DType::kF32;
    case at::kHalf:
      return format::DType::kF16;
    case at::kBFloat16:
      return format::DType::kBF16;
    case at::kLong:
      return format::DType::kI64;
    case at::kInt:
      return format::DType::kI32;
    case at::kShort:
      return format::DType::kI16;
    case at::kChar:
      return format::DType::kI8;
    case at::kByte:
      return format::DType::kU8;
    case at::kBool:
      return format::DType::kBool;
    case at::kFloat8_e4m3fn:
      return format::DType::kF8E4M3;
    case at::kFloat8_e5m2:
      return format::DType::kF8E5M2;
    default:
      return std::nullopt;
  }
}

format::DType to_format_dtype(at::ScalarType t, const std::string& what) {
  const auto d = format_dtype_of(t);
  TORCH_CHECK(d, what, " has dtype ", t, ", which safetensors cannot store");
  return *d;
}

at::ScalarType to_scalar_type(format::DType d) {
  switch (d) {
    case format::DType::kF64:
      return at::kDouble;
    case format::DType::kF32:
      return at::kFloat;
    case format::DType::kF16:
      return at::kHalf;
    case format::DType::kBF16:
      return at::kBFloat16;
    case format::DType::kI64:
      return at::kLong;
    case format::DType::kI32:
      return at::kInt;
    case format::DType::kI16:
      return at::kShort;
    case format::DType::kI8:
      return at::kChar;
    case format::DType::kU8:
      return at::kByte;
    case format::DType::kBool:
      return at::kBool;
    case format::DType::kF8E4M3:
      return at::kFloat8_e4m3fn;
    case format::DType::kF8E5M2:
      return at::kFloat8_e5m2;
  }
  TORCH_CHECK(false, "fsdp_ema: unknown format dtype");
}

const char* torch_dtype_name(format::DType d) {
  switch (d) {
    case format::DType::kF64:
      return "float64";
    case format::DType::kF32:
      return "float32";
    case format::DType::kF16:
      return "float16";
    case format::DType::kBF16:
      return "bfloat16";
    case format::DType::kI64:
      return "int64";
    case format::DType::kI32:
      return "int32";
    case format::DType::kI16:
      return "int16";
    case format::DType::kI8:
      return "int8";
    case format::DType::kU8:
      return "uint8";
    case format::DType::kBool:
      return "bool";
    case format::DType::kF8E4M3:
      return "float8_e4m3fn";
    case format::DType::kF8E5M2:
      return "float8_e5m2";
  }
  TORCH_CHECK(false, "fsdp_ema: unknown format dtype");
}

void check_rank(const char* op, int64_t rank, int64_t world_size) {
  TORCH_CHECK(world_size >= 1, op, "world_size must be >= 1, got ", world_size);
  TORCH_CHECK(rank >= 0 && rank < world_size, op, "rank must be in [0, world_size), got rank ",
              rank, " with world_size ", world_size);
}

}  // namespace fsdp_ema::ops
