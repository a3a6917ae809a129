#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "kernels/batched_copy.h"

namespace fsdp_ema::kernels {

void batched_copy_cpu(const CopySegment* segments, int64_t num_segments) {
  // Split the concatenated bytes of all segments evenly between threads.
  std::vector<int64_t> end(num_segments);
  int64_t total = 0;
  for (int64_t i = 0; i < num_segments; ++i) end[i] = total += segments[i].nbytes;
  if (total == 0) return;
  at::parallel_for(0, total, int64_t{1} << 20, [&](int64_t begin, int64_t stop) {
    int64_t s = std::upper_bound(end.begin(), end.end(), begin) - end.begin();
    for (int64_t pos = begin; pos < stop; ++s) {
      const int64_t first = s == 0 ? 0 : end[s - 1];
      const int64_t hi = std::min(stop, end[s]);
      if (hi > pos) {
        std::memcpy(static_cast<char*>(segments[s].dst) + (pos - first),
                    static_cast<const char*>(segments[s].src) + (pos - first), hi - pos);
      }
      pos = std::max(pos, hi);
    }
  });
}

}  // namespace fsdp_ema::kernels
