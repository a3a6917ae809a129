// The CUDA EMA update of update_ and update_multi_: one kernel, templated on K, the EMA profiles
// one table entry updates from one read of its model chunk (update_ is K = 1). Multi-tensor apply
// whose table lives in device memory, so one launch covers any number of tensors. Plain CUDA
// runtime types only: no ATen here.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/update_types.h"

namespace fsdp_ema::kernels {

// Elements one thread block updates (a multiple of every pack width, so each chunk of a tensor
// starts at the same alignment as the tensor itself).
constexpr int64_t kCudaChunk = 16384;

// The largest K a launch takes: update_multi_ puts more profiles in more entries over the same
// model tensor, each reading it once.
constexpr int kCudaMaxProfiles = 4;

// Elements per vector pack of a dtype pair: 16-byte accesses on the narrower side (8 elements for
// bf16/fp16, 4 for fp32, 2 for fp64), several 16-byte accesses on the wider one.
inline constexpr int cuda_pack_elements(format::DType ema, format::DType model) {
  const auto e = format::dtype_size(ema), m = format::dtype_size(model);
  return static_cast<int>(16 / (e < m ? e : m));
}

// One model tensor and up to K of its EMAs, all of one dtype and one vector head (the host
// groups a tensor's EMAs by those two, so any mix of dtypes and alignments works). Empty tensors
// are never put in the table.
template <int K>
struct CudaUpdateEntry {
  void* ema[K];
  const void* model;
  int64_t numel;
  int64_t first_block;     // index of this entry's first block (chunk) in the flattened grid
  int32_t decay_index[K];  // which of the call's decays each EMA uses
  int8_t count;            // EMAs in use, 1..K
  format::DType ema_dtype;
  format::DType model_dtype;
  // Elements before the model and every EMA pointer are 16-byte aligned (0 <= head < pack
  // width): the kernel updates them one by one, then whole packs. -1: no such head (the offsets
  // disagree modulo the pack), every element one by one.
  int8_t vector_head;
};

// Where the kernel reads a decay from: a host value written into the table, or a 0-dim fp32/fp64
// device tensor read by the kernel itself (no host synchronization).
struct CudaDecay {
  double value;
  const void* device_ptr;  // null: use value
  bool device_is_double;
};

// Bytes of device memory (16-byte aligned) the table of `num_entries` entries of
// CudaUpdateEntry<k> followed by `num_decays` decays needs.
int64_t cuda_update_table_bytes(int k, int64_t num_entries, int64_t num_decays);

// Writes the entries and the decays into `device_table` (kernels/device_table.cuh: one small fill
// launch per 32 KB of them, capturable, no pinned staging), then launches the update over
// `total_chunks` blocks of kCudaChunk elements, all on `stream`. Returns the first launch error.
// Instantiated for K = 1 (update_) and K = kCudaMaxProfiles (update_multi_).
template <int K>
cudaError_t launch_update_cuda(const CudaUpdateEntry<K>* entries, int64_t num_entries,
                               const CudaDecay* decays, int64_t num_decays, int64_t total_chunks,
                               void* device_table, cudaStream_t stream);

}  // namespace fsdp_ema::kernels
