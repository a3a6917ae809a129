#include "ops/common/format_bridge.h"

#include <vector>

namespace fsdp_ema::ops {

std::optional<format::DType> format_dtype_of(at::ScalarType t) {
  switch (t) {
#define FSDP_EMA_X(id, name, size, floating, torch, ...) \
  case at::ScalarType::torch:                            \
    return format::DType::id;
    FSDP_EMA_DTYPES(FSDP_EMA_X)
#undef FSDP_EMA_X
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
#define FSDP_EMA_X(id, name, size, floating, torch, ...) \
  case format::DType::id:                                \
    return at::ScalarType::torch;
    FSDP_EMA_DTYPES(FSDP_EMA_X)
#undef FSDP_EMA_X
  }
  TORCH_CHECK(false, "fsdp_ema: unknown format dtype");
}

bool has_role(at::ScalarType t, format::DTypeRole role) {
  const auto d = format_dtype_of(t);
  return d && format::has_role(*d, role);
}

std::string torch_dtypes_with_role(format::DTypeRole role) {
  std::vector<std::string> names;
  for (const format::DType d : format::all_dtypes()) {
    if (format::has_role(d, role)) names.emplace_back(c10::toString(to_scalar_type(d)));
  }
  std::string out;
  for (size_t i = 0; i < names.size(); ++i) {
    out += (i == 0 ? "" : i + 1 == names.size() ? " or " : ", ") + names[i];
  }
  return out;
}

void check_rank(const char* op, int64_t rank, int64_t world_size) {
  TORCH_CHECK(world_size >= 1, op, "world_size must be >= 1, got ", world_size);
  TORCH_CHECK(rank >= 0 && rank < world_size, op, "rank must be in [0, world_size), got rank ",
              rank, " with world_size ", world_size);
}

}  // namespace fsdp_ema::ops
