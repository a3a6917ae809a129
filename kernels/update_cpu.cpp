#include "kernels/update_cpu.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace fsdp_ema::kernels {
namespace {

// Smallest share of elements worth a thread of its own.
constexpr int64_t kChunk = 1 << 16;

enum class Isa { kDefault, kAvx2, kAvx512 };

// The best kernel this CPU runs, capped like ATen's by ATEN_CPU_CAPABILITY (default/avx2/avx512).
Isa detect_isa() {
#if defined(FSDP_EMA_HAVE_X86_KERNELS)
  Isa cap = Isa::kAvx512;
  if (const char* forced = std::getenv("ATEN_CPU_CAPABILITY")) {
    if (std::strcmp(forced, "default") == 0) cap = Isa::kDefault;
    if (std::strcmp(forced, "avx2") == 0) cap = Isa::kAvx2;
  }
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c");
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") &&
                      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                      __builtin_cpu_supports("avx512dq");
  if (avx512 && cap == Isa::kAvx512) return Isa::kAvx512;
  if (avx2 && cap != Isa::kDefault) return Isa::kAvx2;
#endif
  return Isa::kDefault;
}

UpdateRangeFn pick_kernel() {
  switch (detect_isa()) {
#if defined(FSDP_EMA_HAVE_X86_KERNELS)
    case Isa::kAvx512:
      return &update_cpu_avx512;
    case Isa::kAvx2:
      return &update_cpu_avx2;
#endif
    default:
      return &update_cpu_default;
  }
}

}  // namespace

const char* update_cpu_capability() {
  switch (detect_isa()) {
    case Isa::kAvx512:
      return "avx512";
    case Isa::kAvx2:
      return "avx2";
    default:
      return "default";
  }
}

UpdateRangeFn update_cpu_kernel() {
  static const UpdateRangeFn kernel = pick_kernel();
  return kernel;
}

void parallel_over_elements(int64_t num_tensors, const std::function<int64_t(int64_t)>& numel,
                            const TensorRangeFn& range) {
  // elem_end[i] = elements in tensors [0, i]; each thread walks its share tensor by tensor.
  std::vector<int64_t> elem_end(num_tensors);
  int64_t total = 0;
  for (int64_t i = 0; i < num_tensors; ++i) {
    total += numel(i);
    elem_end[i] = total;
  }
  if (total == 0) return;
  at::parallel_for(0, total, kChunk, [&](int64_t begin, int64_t end) {
    int64_t p = std::upper_bound(elem_end.begin(), elem_end.end(), begin) - elem_end.begin();
    for (int64_t pos = begin; pos < end; ++p) {
      const int64_t first = p == 0 ? 0 : elem_end[p - 1];
      const int64_t stop = std::min(end, elem_end[p]);
      if (stop > pos) range(p, pos - first, stop - first);
      pos = std::max(pos, stop);
    }
  });
}

void update_cpu(const UpdatePair* pairs, int64_t num_pairs, double decay) {
  const UpdateRangeFn kernel = update_cpu_kernel();
  parallel_over_elements(
      num_pairs, [&](int64_t i) { return pairs[i].numel; },
      [&](int64_t p, int64_t begin, int64_t end) { kernel(pairs[p], begin, end, decay); });
}

}  // namespace fsdp_ema::kernels
