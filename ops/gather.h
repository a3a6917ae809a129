// Host side of fsdp_ema::gather_shards: dim-0 shards of N tensors -> the N full tensors, with one
// all-gather on a c10d process group resolved by name.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <string>
#include <vector>

namespace fsdp_ema::ops {

//   shards: [N] this rank's torch.chunk dim-0 rows of each tensor (possibly empty)
//   rows:   [N] each tensor's global dim-0 size
// Returns the N full tensors [rows[i], *shards[i].shape[1:]] on every rank.
std::vector<at::Tensor> gather_shards(at::TensorList shards, at::IntArrayRef rows,
                                      c10::string_view group_name);
std::vector<at::Tensor> gather_shards_meta(at::TensorList shards, at::IntArrayRef rows,
                                           c10::string_view group_name);

}  // namespace fsdp_ema::ops
