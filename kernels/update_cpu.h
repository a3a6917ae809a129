// CPU EMA update kernel: one parallel region over every pair of a call.
#pragma once

#include <cstdint>

#include "kernels/update_types.h"

namespace fsdp_ema::kernels {

// Updates every pair in one at::parallel_for over a flattened (pair, chunk) work list. The pairs
// must be contiguous and must not overlap; `decay` is applied as torch.lerp(ema, model, 1 - decay).
void update_cpu(const UpdatePair* pairs, int64_t num_pairs, double decay);

// Elements [begin, end) of one pair; one definition per instruction set (update_cpu_impl.h).
using UpdateRangeFn = void (*)(const UpdatePair& pair, int64_t begin, int64_t end, double decay);
void update_cpu_default(const UpdatePair& pair, int64_t begin, int64_t end, double decay);
void update_cpu_avx2(const UpdatePair& pair, int64_t begin, int64_t end, double decay);
void update_cpu_avx512(const UpdatePair& pair, int64_t begin, int64_t end, double decay);

// Name of the instruction set update_cpu uses on this machine: "avx512", "avx2" or "default".
const char* update_cpu_capability();

}  // namespace fsdp_ema::kernels
