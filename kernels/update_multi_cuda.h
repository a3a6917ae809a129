// CUDA kernel of update_multi_: each thread block reads a chunk of one model tensor once and
// updates up to kCudaMaxProfiles EMAs of it. Plain CUDA runtime types only: no ATen here.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/update_cuda.h"
#include "kernels/update_types.h"

namespace fsdp_ema::kernels {

// EMAs one table entry updates from one read of its model chunk (more profiles: more entries
// over the same model tensor, each reading it once).
constexpr int kCudaMaxProfiles = 4;

// One model tensor and up to kCudaMaxProfiles of its EMAs, all of one dtype and with one vector
// head (the host groups a tensor's EMAs by those two, so any mix of dtypes and alignments works).
struct CudaMultiEntry {
  void* ema[kCudaMaxProfiles];
  const void* model;
  int64_t numel;
  int64_t first_block;  // index of this entry's first block (chunk) in the flattened grid
  int32_t decay_index[kCudaMaxProfiles];  // which of the call's decays each EMA uses
  int8_t count;                           // EMAs in use, 1..kCudaMaxProfiles
  Dtype ema_dtype;
  Dtype model_dtype;
  int8_t vector_head;  // as CudaUpdateEntry::vector_head, for every EMA of the entry
};

// Device bytes for the table of `num_entries` entries followed by `num_decays` decays.
int64_t cuda_multi_table_bytes(int64_t num_entries, int64_t num_decays);

// Uploads entries and decays into `device_table` (cuda_multi_table_bytes large, 16-byte
// aligned), then launches over `total_chunks` blocks of kCudaChunk elements, all on `stream`.
cudaError_t launch_update_multi_cuda(const CudaMultiEntry* entries, int64_t num_entries,
                                     const CudaDecay* decays, int64_t num_decays,
                                     int64_t total_chunks, void* device_table, cudaStream_t stream);

}  // namespace fsdp_ema::kernels
