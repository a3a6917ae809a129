// CUDA kernel table for the fsdp_ema operators (schemas live in registration.cpp).
#include <torch/library.h>

#include "ops/update.h"

TORCH_LIBRARY_IMPL(fsdp_ema, CUDA, m) {
  for (const char* name : {"update_", "ema_shard_update_"}) {
    m.impl(name, &fsdp_ema::ops::update_cuda);
    m.impl((std::string(name) + ".Tensor").c_str(), &fsdp_ema::ops::update_tensor_cuda);
  }
}
