// The CUDA kernel table of the fsdp_ema operators (their schemas are in registration.cpp).
#include <torch/library.h>

#include "ops/save/commit_checkpoint.h"
#include "ops/gather/gather_shards.h"
#include "ops/load/load_ops.h"
#include "ops/save/save_shard.h"
#include "ops/update/update.h"

namespace ops = fsdp_ema::ops;

TORCH_LIBRARY_IMPL(fsdp_ema, CUDA, m) {
  m.impl("update_.Tensor", &ops::update_tensor_cuda);
  m.impl("update_", &ops::update_cuda);
  m.impl("ema_shard_update_.Tensor", &ops::update_tensor_cuda);
  m.impl("ema_shard_update_", &ops::update_cuda);
  m.impl("update_multi_.Tensor", &ops::update_multi_tensor_cuda);
  m.impl("update_multi_", &ops::update_multi_cuda);
  m.impl("gather_shards", &ops::gather_shards_cuda);
  // The checkpoint ops' host code handles device tensors itself (pinned staging on save, a copy
  // after the read on load); these kernels put the results on the tensors' device.
  m.impl("save_shard", &ops::save_shard_cuda);
  m.impl("commit_checkpoint.after", &ops::commit_after);
  m.impl("_load_tensors", &ops::load_tensors_to);
  m.impl("_load_shard", &ops::load_shard_to);
  m.impl("load_into_", &ops::load_into_);  // host reads, then copies to the device
}
