#include <algorithm>
#include <cstdint>

#include "kernels/batched_copy_cuda.h"
#include "kernels/device_table.cuh"

namespace fsdp_ema::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;  // words each thread loads before it stores any (ILP)

// Copies n bytes with W-wide words. (src ^ dst) % sizeof(W) == 0, so once the head of bytes that
// brings src to a W boundary is done, dst sits on one too: the words, then a tail of bytes.
template <typename W>
__device__ __forceinline__ void copy_words(char* __restrict__ dst, const char* __restrict__ src,
                                           int64_t n) {
  constexpr int64_t kW = sizeof(W);
  const int64_t head =
      min(n, static_cast<int64_t>((kW - reinterpret_cast<uintptr_t>(src) % kW) % kW));
  if (threadIdx.x < head) dst[threadIdx.x] = src[threadIdx.x];  // head < 16 < kThreads
  const int64_t words = (n - head) / kW;
  const W* s = reinterpret_cast<const W*>(src + head);
  W* d = reinterpret_cast<W*>(dst + head);
  for (int64_t base = 0; base < words; base += static_cast<int64_t>(kThreads) * kUnroll) {
    W r[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * kThreads + threadIdx.x;
      if (i < words) r[u] = s[i];
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * kThreads + threadIdx.x;
      if (i < words) d[i] = r[u];
    }
  }
  for (int64_t i = head + words * kW + threadIdx.x; i < n; i += kThreads) dst[i] = src[i];
}

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
  // Table pointers have no known address space: without this, generic LD/ST instead of LDG/STG.
  __builtin_assume(__isGlobal(src));
  __builtin_assume(__isGlobal(dst));
  // The widest word both pointers can reach together: the lowest bit in which they differ.
  const uintptr_t differ = reinterpret_cast<uintptr_t>(src) ^ reinterpret_cast<uintptr_t>(dst);
  if (differ % 16 == 0) {
    copy_words<uint4>(dst, src, n);
  } else if (differ % 8 == 0) {
    copy_words<uint2>(dst, src, n);
  } else if (differ % 4 == 0) {
    copy_words<uint32_t>(dst, src, n);
  } else if (differ % 2 == 0) {
    copy_words<uint16_t>(dst, src, n);
  } else {
    copy_words<unsigned char>(dst, src, n);
  }
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
