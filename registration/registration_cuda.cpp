// CUDA kernel table for the fsdp_ema operators (schemas live in registration.cpp).
#include <torch/library.h>

#include "ops/update.h"
#include "ops/update_multi.h"

TORCH_LIBRARY_IMPL(fsdp_ema, CUDA, m) {
  for (const char* name : {"update_", "ema_shard_update_"}) {
    m.impl(name, &fsdp_ema::ops::update_cuda);
    m.impl((std::string(name) + ".Tensor").c_str(), &fsdp_ema::ops::update_tensor_cuda);
  }
}

TORCH_LIBRARY_IMPL(fsdp_ema, CUDA, m) {
  m.impl("update_multi_", &fsdp_ema::ops::update_multi_cuda);
  m.impl("update_multi_.Tensor", &fsdp_ema::ops::update_multi_tensor_cuda);
}
