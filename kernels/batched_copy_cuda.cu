#include <algorithm>
#include <cstdint>

#include "kernels/batched_copy_cuda.h"
#include "kernels/device_table.cuh"

namespace fsdp_ema::kernels {
namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads)
    batched_copy_kernel(const CopySegment* __restrict__ table, int num_segments) {
  __shared__ int segment;
  const int64_t block = blockIdx.x;
  if (threadIdx.x == 0) segment = find_entry(table, num_segments, block);
  __syncthreads();
  const CopySegment s = table[segment];
  const int64_t begin = (block - s.first_block) * kCopyBlockBytes;
  const int64_t n = min(kCopyBlockBytes, s.nbytes - begin);
  const char* src = static_cast<const char*>(s.src) + begin;
  char* dst = static_cast<char*>(s.dst) + begin;
  int64_t done = 0;
  if ((reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst)) % 16 == 0) {
    const int64_t vecs = n / 16;
    for (int64_t i = threadIdx.x; i < vecs; i += kThreads) {
      reinterpret_cast<uint4*>(dst)[i] = reinterpret_cast<const uint4*>(src)[i];
    }
    done = vecs * 16;
  }
  for (int64_t i = done + threadIdx.x; i < n; i += kThreads) dst[i] = src[i];
}

}  // namespace

cudaError_t launch_batched_copy_cuda(const CopySegment* segments, int64_t num_segments,
                                     int64_t total_blocks, CopySegment* device_table,
                                     cudaStream_t stream) {
  if (num_segments == 0 || total_blocks == 0) return cudaSuccess;
  if (total_blocks > 0x7fffffffLL) return cudaErrorInvalidConfiguration;
  const cudaError_t err = upload_table(segments, num_segments, device_table, stream);
  if (err != cudaSuccess) return err;
  batched_copy_kernel<<<static_cast<unsigned>(total_blocks), kThreads, 0, stream>>>(
      device_table, static_cast<int>(num_segments));
  return cudaGetLastError();
}

}  // namespace fsdp_ema::kernels
