// CUDA part of gather_shards' pack/unpack: the batched copy kernel on the current stream.
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <vector>

#include "kernels/batched_copy_cuda.h"

namespace fsdp_ema::ops {

void batched_copy_cuda(std::vector<kernels::CopySegment>& segments, const at::Device& device) {
  if (segments.empty()) return;
  const c10::cuda::CUDAGuard guard(device);
  int64_t blocks = 0;
  for (auto& s : segments) {
    s.first_block = blocks;
    blocks += (s.nbytes + kernels::kCopyBlockBytes - 1) / kernels::kCopyBlockBytes;
  }
  const at::Tensor table = at::empty(
      {static_cast<int64_t>(segments.size() * sizeof(kernels::CopySegment))},
      at::TensorOptions().dtype(at::kByte).device(device));
  C10_CUDA_CHECK(kernels::launch_batched_copy_cuda(
      segments.data(), static_cast<int64_t>(segments.size()), blocks,
      static_cast<kernels::CopySegment*>(table.data_ptr()), at::cuda::getCurrentCUDAStream()));
}

}  // namespace fsdp_ema::ops
