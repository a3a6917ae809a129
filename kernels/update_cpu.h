// CPU EMA update kernel: one parallel region over every pair of a call.
#pragma once

#include <cstdint>
#include <functional>

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
// The range kernel update_cpu uses on this machine.
UpdateRangeFn update_cpu_kernel();

// The work list both CPU ops share: one at::parallel_for over the flat element range of
// `num_tensors` tensors of numel(t) elements, split evenly between the threads (balanced by
// elements, not by tensors); each thread calls range(t, begin, end) for its share of tensor t.
using TensorRangeFn = std::function<void(int64_t tensor, int64_t begin, int64_t end)>;
void parallel_over_elements(int64_t num_tensors, const std::function<int64_t(int64_t)>& numel,
                            const TensorRangeFn& range);

// Updates K = num_profiles EMA lists from one pass over the model tensors. pairs[k * n + i]
// (n = num_tensors) pairs EMA k of tensor i with model tensor i (the same model pointer and numel
// for every k) and uses decays[k]. Each thread walks its share in tiles small enough to stay in
// the L1 cache, updating all K EMAs of a tile before the next one, so the model is read from
// memory once; the per-element math is update_cpu's (bit-identical to K update_cpu calls).
void update_multi_cpu(const UpdatePair* pairs, int64_t num_tensors, int64_t num_profiles,
                      const double* decays);

}  // namespace fsdp_ema::kernels
