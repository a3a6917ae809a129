#include <algorithm>
#include <cstdint>

#include "kernels/batched_copy_cuda.h"

namespace fsdp_ema::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kFillSegments = 1000;  // 32 bytes each: fits the 32764-byte parameter limit

struct FillArgs {
  CopySegment* dst;
  int count;
  CopySegment segments[kFillSegments];
};
static_assert(sizeof(FillArgs) <= 32764, "fill kernel parameters exceed the CUDA limit");

__global__ void fill_segments_kernel(const __grid_constant__ FillArgs args) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < args.count; i += gridDim.x * blockDim.x) {
    args.dst[i] = args.segments[i];
  }
}

__global__ void __launch_bounds__(kThreads)
    batched_copy_kernel(const CopySegment* __restrict__ table, int num_segments) {
  __shared__ int segment;
  const int64_t block = blockIdx.x;
  if (threadIdx.x == 0) {
    int lo = 0, hi = num_segments - 1;
    while (lo < hi) {  // last segment whose first block is <= this block
      const int mid = (lo + hi + 1) / 2;
      if (table[mid].first_block <= block) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    segment = lo;
  }
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
  for (int64_t first = 0; first < num_segments; first += kFillSegments) {
    FillArgs args;
    args.dst = device_table + first;
    args.count = static_cast<int>(std::min<int64_t>(kFillSegments, num_segments - first));
    std::copy(segments + first, segments + first + args.count, args.segments);
    fill_segments_kernel<<<(args.count + 127) / 128, 128, 0, stream>>>(args);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  batched_copy_kernel<<<static_cast<unsigned>(total_blocks), kThreads, 0, stream>>>(
      device_table, static_cast<int>(num_segments));
  return cudaGetLastError();
}

}  // namespace fsdp_ema::kernels
