// CUDA kernel table for the fsdp_ema operators (schemas live in registration.cpp).
#include <torch/library.h>

#include "ops/checkpoint.h"
#include "ops/checkpoint_meta.h"
#include "ops/gather.h"
#include "ops/load_into.h"
#include "ops/update.h"
#include "ops/update_multi.h"

TORCH_LIBRARY_IMPL(fsdp_ema, CUDA, m) {
  for (const char* name : {"update_", "ema_shard_update_"}) {
    m.impl(name, &fsdp_ema::ops::update_cuda);
    m.impl((std::string(name) + ".Tensor").c_str(), &fsdp_ema::ops::update_tensor_cuda);
  }
  m.impl("gather_shards", &fsdp_ema::ops::gather_shards_cuda);
  // The checkpoint ops' host code handles device tensors itself (pinned staging on save, a copy
  // after the read on load); these kernels put the results on the tensors' device.
  m.impl("save_shard", &fsdp_ema::ops::save_shard_cuda);
  m.impl("commit_checkpoint.after", &fsdp_ema::ops::commit_after);
  m.impl("_load_tensors", &fsdp_ema::ops::load_tensors_to);
  m.impl("_load_shard", &fsdp_ema::ops::load_shard_to);
  m.impl("load_into_", &fsdp_ema::ops::load_into_);  // host reads, then copies to the device
}

TORCH_LIBRARY_IMPL(fsdp_ema, CUDA, m) {
  m.impl("update_multi_", &fsdp_ema::ops::update_multi_cuda);
  m.impl("update_multi_.Tensor", &fsdp_ema::ops::update_multi_tensor_cuda);
}
