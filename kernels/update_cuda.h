// CUDA EMA update: multi-tensor apply whose tensor table lives in device memory, so one launch
// covers any number of tensors. Plain CUDA runtime types only: no ATen here.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/update_types.h"

namespace fsdp_ema::kernels {

// Elements one thread block updates (a multiple of every pack width, so each chunk of a pair
// starts at the same alignment as the pair itself).
constexpr int64_t kCudaChunk = 16384;

// Elements per vector pack of a dtype pair: 16-byte accesses on the narrower side (8 elements for
// bf16/fp16, 4 for fp32, 2 for fp64), several 16-byte accesses on the wider one.
inline constexpr int cuda_pack_elements(Dtype ema, Dtype model) {
  return static_cast<int>(
      16 / (dtype_size(ema) < dtype_size(model) ? dtype_size(ema) : dtype_size(model)));
}

// One (ema, model) pair as the device sees it. Empty pairs are never put in the table.
struct CudaUpdateEntry {
  void* ema;
  const void* model;
  int64_t numel;
  int64_t first_block;  // index of this pair's first block (chunk) in the flattened grid
  Dtype ema_dtype;
  Dtype model_dtype;
  // Elements before both pointers are 16-byte aligned (0 <= head < pack width): the kernel
  // updates them one by one, then whole packs. -1: no such head (the offsets of ema and model
  // disagree modulo the pack), every element one by one.
  int8_t vector_head;
};

// Where the kernel reads decay from: a host value baked into the launch, or a 0-dim fp32/fp64
// device tensor read by the kernel itself (no host synchronization).
struct CudaDecay {
  double value;
  const void* device_ptr;  // null: use value
  bool device_is_double;
};

// Bytes of device memory the table for `num_entries` pairs needs.
int64_t cuda_table_bytes(int64_t num_entries);

// Writes `entries` into `device_table` (kernels/device_table.cuh: one small fill launch per ~800
// entries, capturable, no pinned staging), then launches the update over `total_chunks` blocks,
// all on `stream`. Returns the first launch error.
cudaError_t launch_update_cuda(const CudaUpdateEntry* entries, int64_t num_entries,
                               int64_t total_chunks, CudaUpdateEntry* device_table, CudaDecay decay,
                               cudaStream_t stream);

}  // namespace fsdp_ema::kernels
