// The dim-0 row rule every layout shares: which rows torch.chunk gives each rank. The readers,
// gather_shards and the Python front (fsdp_ema/_layouts.py mirrors it) all split rows this way.
#pragma once

#include <cstdint>

namespace fsdp_ema::format {

// Rows [begin, end) of dim 0.
struct RowRange {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t size() const { return end - begin; }
  bool operator==(const RowRange&) const = default;
};

// The rows torch.chunk(tensor, world)[rank] holds (as FSDP2 shards dim 0): chunk size
// ceil(rows / world); rank r gets [r * cs, min((r + 1) * cs, rows)), empty for ranks past the
// end (world > rows, or non-divisors such as 5 rows over 4 ranks: 2, 2, 1, 0).
RowRange chunk_rows(int64_t rows, int64_t rank, int64_t world);

}  // namespace fsdp_ema::format
