// CPU kernel of update_multi_: K EMA lists from one read of the model tensors, built on the
// update_ kernel's work list and per-instruction-set range kernels (kernels/update_cpu.h).
#include <algorithm>

#include "kernels/update_cpu.h"

namespace fsdp_ema::kernels {
namespace {

// Elements per tile: 4096 fp32 model elements are 16 KB, so the K passes over one tile after the
// first find the model in L1 (and in L2 for fp64 or under another thread's pressure), and the
// model costs one read from memory. A multiple of every vector step, so tiles end on a full
// vector except at the end of a thread's share.
constexpr int64_t kTile = 4096;

}  // namespace

void update_multi_cpu(const UpdatePair* pairs, int64_t num_tensors, int64_t num_profiles,
                      const double* decays) {
  const UpdateRangeFn kernel = update_cpu_kernel();
  parallel_over_elements(
      num_tensors, [&](int64_t i) { return pairs[i].numel; },
      [&](int64_t t, int64_t begin, int64_t end) {
        for (int64_t lo = begin; lo < end; lo += kTile) {
          const int64_t hi = std::min(end, lo + kTile);
          for (int64_t k = 0; k < num_profiles; ++k) {
            kernel(pairs[k * num_tensors + t], lo, hi, decays[k]);
          }
        }
      });
}

}  // namespace fsdp_ema::kernels
