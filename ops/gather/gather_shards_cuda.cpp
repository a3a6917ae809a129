// gather_shards' CUDA kernel: the shared host code with the batched copy kernel on the current
// stream for pack and unpack.
#include "ops/gather/gather_shards_cuda.h"

#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <vector>

#include "kernels/batched_copy_cuda.h"
#include "ops/gather/gather_shards.h"

namespace fsdp_ema::ops {

void batched_copy_cuda(std::vector<kernels::CopySegment>& segments, const at::Device& device) {
  if (segments.empty()) return;
  const c10::cuda::CUDAGuard guard(device);
  int64_t blocks = 0;
  for (auto& s : segments) {
    s.first_block = blocks;
    blocks += (s.nbytes + kernels::kCopyBlockBytes - 1) / kernels::kCopyBlockBytes;
  }
  const at::Tensor table =
      at::empty({static_cast<int64_t>(segments.size() * sizeof(kernels::CopySegment))},
                at::TensorOptions().dtype(at::kByte).device(device));
  C10_CUDA_CHECK(kernels::launch_batched_copy_cuda(
      segments.data(), static_cast<int64_t>(segments.size()), blocks,
      static_cast<kernels::CopySegment*>(table.data_ptr()), at::cuda::getCurrentCUDAStream()));
}

std::vector<at::Tensor> gather_shards_cuda(at::TensorList shards, at::IntArrayRef rows,
                                           c10::string_view group_name) {
  return gather_shards_with(shards, rows, group_name, {&batched_copy_cuda, &fresh_workspace});
}

}  // namespace fsdp_ema::ops
