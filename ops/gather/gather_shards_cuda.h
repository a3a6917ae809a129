// CUDA half of gather_shards: its kernel (registered in registration/registration.cpp) and the
// pack/unpack copy it runs, which the CUDA gtests also drive directly. Only built with CUDA.
#pragma once

#include <c10/core/Device.h>

#include <vector>

#include "kernels/batched_copy.h"

namespace fsdp_ema::ops {

// Copies every segment with the batched copy kernel on the current stream of `device` (sets each
// segment's first_block; the device table comes from the caching allocator).
void batched_copy_cuda(std::vector<kernels::CopySegment>& segments, const at::Device& device);

}  // namespace fsdp_ema::ops
