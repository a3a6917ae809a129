// Conversions among the floating dtypes F64, F32, F16 and BF16: round to nearest even (one
// rounding, also F64 -> F16/BF16), overflow to infinity, NaN kept NaN (sign kept, quiet).
#pragma once

#include <cstddef>
#include <cstdint>

#include "fsdp_ema/format/dtype.h"

namespace fsdp_ema::format {

// True for any pair of F64, F32, F16, BF16 (including the identity).
bool can_cast(DType from, DType to);

// Converts `count` elements; src and dst need no alignment and must not overlap. Throws
// FormatError when !can_cast(from, to).
void cast_elements(DType from, const void* src, DType to, void* dst, size_t count);

}  // namespace fsdp_ema::format
