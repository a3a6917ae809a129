// The dim-0 row rule every layout shares: which rows torch.chunk gives each rank. The readers,
// gather_shards, the C++ API (fsdp_ema::chunk_rows) and the Python front (the chunk_rows op;
// python_tests pin its fast Python copy to this rule) all split rows this way.
#pragma once

#include <cstdint>
#include <span>

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

// The rows rank `rank` of `world` holds of a tensor of `shape`: chunk_rows(shape[0], ...), and for
// a 0-dim tensor {0, 1}: it has no rows to split, so every rank holds its one element whole (as
// FSDP replicates it).
RowRange tensor_rows(std::span<const int64_t> shape, int64_t rank, int64_t world);

}  // namespace fsdp_ema::format
