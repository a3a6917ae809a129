// Host helpers shared by the CUDA update ops (update_cuda.cpp, update_multi_cuda.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "kernels/update_types.h"

namespace fsdp_ema::ops {

// Elements to update one by one before ema and model are both 16-byte aligned, or -1 when no such
// count below the pack width exists (their offsets disagree modulo the pack).
int8_t cuda_vector_head(const at::Tensor& e, const at::Tensor& m, kernels::Dtype ed,
                        kernels::Dtype md);

}  // namespace fsdp_ema::ops
