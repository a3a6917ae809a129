// CUDA side of kernels/batched_copy.h (plain CUDA runtime types only).
#pragma once

#include <cuda_runtime_api.h>

#include "kernels/batched_copy.h"

namespace fsdp_ema::kernels {

// Copies every segment (first_block already set, nbytes > 0) with one kernel over
// `total_blocks` blocks, after writing the table into `device_table` with parameter-carried fill
// launches (capturable, no pinned staging). All on `stream`.
cudaError_t launch_batched_copy_cuda(const CopySegment* segments, int64_t num_segments,
                                     int64_t total_blocks, CopySegment* device_table,
                                     cudaStream_t stream);

}  // namespace fsdp_ema::kernels
