#include "kernels/update_cpu.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace fsdp_ema::kernels {
namespace {

// Elements per work item: large enough to amortize scheduling, small enough to balance threads.
constexpr int64_t kChunk = 1 << 16;

bool use_avx2() {
#if defined(FSDP_EMA_HAVE_AVX2_KERNEL)
  // ATEN_CPU_CAPABILITY=default forces the baseline kernels in ATen; honour it here too.
  const char* forced = std::getenv("ATEN_CPU_CAPABILITY");
  if (forced != nullptr && std::strcmp(forced, "default") == 0) return false;
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

UpdateRangeFn pick_kernel() {
#if defined(FSDP_EMA_HAVE_AVX2_KERNEL)
  if (use_avx2()) return &update_cpu_avx2;
#endif
  return &update_cpu_default;
}

}  // namespace

const char* update_cpu_capability() { return use_avx2() ? "avx2" : "default"; }

void update_cpu(const UpdatePair* pairs, int64_t num_pairs, double decay) {
  static const UpdateRangeFn kernel = pick_kernel();
  // chunk_end[i] = number of chunks in pairs [0, i]; one flat range covers every pair.
  std::vector<int64_t> chunk_end(num_pairs);
  int64_t total = 0;
  for (int64_t i = 0; i < num_pairs; ++i) {
    total += (pairs[i].numel + kChunk - 1) / kChunk;
    chunk_end[i] = total;
  }
  if (total == 0) return;
  at::parallel_for(0, total, 1, [&](int64_t begin, int64_t end) {
    int64_t p = std::upper_bound(chunk_end.begin(), chunk_end.end(), begin) - chunk_end.begin();
    for (int64_t c = begin; c < end; ++c) {
      while (chunk_end[p] <= c) ++p;
      const int64_t first = p == 0 ? 0 : chunk_end[p - 1];
      const int64_t lo = (c - first) * kChunk;
      const int64_t hi = std::min(lo + kChunk, pairs[p].numel);
      kernel(pairs[p], lo, hi, decay);
    }
  });
}

}  // namespace fsdp_ema::kernels
