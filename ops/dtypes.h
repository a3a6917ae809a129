// torch dtypes <-> the kernels' element types.
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>

#include "kernels/update_types.h"

namespace fsdp_ema::ops {

inline bool is_supported_dtype(c10::ScalarType t) {
  return t == c10::kFloat || t == c10::kDouble || t == c10::kBFloat16 || t == c10::kHalf;
}

inline kernels::Dtype to_kernel_dtype(c10::ScalarType t) {
  switch (t) {
    case c10::kFloat:
      return kernels::Dtype::kFloat32;
    case c10::kDouble:
      return kernels::Dtype::kFloat64;
    case c10::kBFloat16:
      return kernels::Dtype::kBFloat16;
    case c10::kHalf:
      return kernels::Dtype::kFloat16;
    default:
      TORCH_CHECK(false, "fsdp_ema: unsupported dtype ", t);
  }
}

}  // namespace fsdp_ema::ops
