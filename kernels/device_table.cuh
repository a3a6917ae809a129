// A per-call table of work items in device memory, written by kernels whose parameters carry the
// entries: no pinned staging buffer to keep alive, no host synchronization, and capturable in CUDA
// graphs (the parameters are baked into the graph). Kernels find their entry by binary search.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>

namespace fsdp_ema::kernels {

// Kernel parameters may hold up to 32764 bytes (CUDA >= 12.1, sm_70+).
constexpr size_t kMaxKernelParamBytes = 32764;

template <typename Entry>
struct TableFill {
  static constexpr int kCapacity =
      static_cast<int>((kMaxKernelParamBytes - 2 * sizeof(void*)) / sizeof(Entry));
  Entry* dst;
  int count;
  Entry entries[kCapacity];
};

template <typename Entry>
__global__ void fill_table_kernel(const __grid_constant__ TableFill<Entry> args) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < args.count; i += gridDim.x * blockDim.x) {
    args.dst[i] = args.entries[i];
  }
}

// Copies `count` entries from host memory into `device_table`, on `stream`.
template <typename Entry>
cudaError_t upload_table(const Entry* entries, int64_t count, Entry* device_table,
                         cudaStream_t stream) {
  static_assert(sizeof(TableFill<Entry>) <= kMaxKernelParamBytes, "table fill too large");
  constexpr int kCapacity = TableFill<Entry>::kCapacity;
  for (int64_t first = 0; first < count; first += kCapacity) {
    TableFill<Entry> args;
    args.dst = device_table + first;
    args.count = static_cast<int>(std::min<int64_t>(kCapacity, count - first));
    std::copy(entries + first, entries + first + args.count, args.entries);
    fill_table_kernel<Entry><<<(args.count + 127) / 128, 128, 0, stream>>>(args);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

// Index of the last entry whose first_block is <= `block` (entries sorted by first_block).
// Called by one thread; the caller shares the result through shared memory.
template <typename Entry>
__device__ int find_entry(const Entry* table, int count, int64_t block) {
  int lo = 0, hi = count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (table[mid].first_block <= block) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

}  // namespace fsdp_ema::kernels
