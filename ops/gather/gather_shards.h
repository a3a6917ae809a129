// Host side of fsdp_ema::gather_shards: dim-0 shards of N tensors -> the N full tensors, with one
// all-gather on a c10d process group resolved by name. One kernel per dispatch key (CPU, CUDA in
// gather_shards_cuda.cpp, Meta); they share the host code and differ only in the pack/unpack copy.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <string>
#include <utility>
#include <vector>

#include "kernels/batched_copy.h"

namespace fsdp_ema::ops {

// The byte alignment at which gather_shards starts every piece it packs (its copies move whole
// 16-byte words): op gather_alignment, so that Python's bucket sizes follow the op's layout.
int64_t gather_alignment();

// Copies every segment (host code of one device's batched copy kernel).
using BatchedCopyFn = void (*)(std::vector<kernels::CopySegment>& segments,
                               const at::Device& device);

// The packed send buffer and the gathered receive buffer of one call (bytes, on `device`).
using WorkspaceFn = std::pair<at::Tensor, at::Tensor> (*)(const at::Device& device,
                                                          int64_t send_bytes, int64_t recv_bytes);
// Fresh buffers from the allocator on every call (CUDA's caching allocator already reuses them).
std::pair<at::Tensor, at::Tensor> fresh_workspace(const at::Device& device, int64_t send_bytes,
                                                  int64_t recv_bytes);

// What differs between the devices' kernels.
struct GatherDeviceFns {
  BatchedCopyFn copy;
  WorkspaceFn workspace;
};

// The shared host code: validation, layout, one all-gather, pack/unpack through `fns`.
//   shards: [N] this rank's torch.chunk dim-0 rows of each tensor (possibly empty)
//   rows:   [N] each tensor's global dim-0 size
// Returns the N full tensors [rows[i], *shards[i].shape[1:]] on every rank.
std::vector<at::Tensor> gather_shards_with(at::TensorList shards, at::IntArrayRef rows,
                                           c10::string_view group_name, const GatherDeviceFns& fns);

// Kernels registered for the dispatch keys (same arguments and result as gather_shards_with).
std::vector<at::Tensor> gather_shards_cpu(at::TensorList shards, at::IntArrayRef rows,
                                          c10::string_view group_name);
std::vector<at::Tensor> gather_shards_cuda(at::TensorList shards, at::IntArrayRef rows,
                                           c10::string_view group_name);
// Shapes only: no collective, no group lookup (tracing needs neither).
std::vector<at::Tensor> gather_shards_meta(at::TensorList shards, at::IntArrayRef rows,
                                           c10::string_view group_name);

}  // namespace fsdp_ema::ops
