#include "fsdp_ema/format/rows.h"

#include <string>

#include "fsdp_ema/format/error.h"

namespace fsdp_ema::format {

RowRange chunk_rows(int64_t rows, int64_t rank, int64_t world) {
  if (rows < 0 || world < 1 || rank < 0 || rank >= world) {
    throw FormatError("chunk_rows: need rows >= 0 and 0 <= rank < world, got rows " +
                      std::to_string(rows) + ", rank " + std::to_string(rank) + ", world " +
                      std::to_string(world));
  }
  const int64_t cs = rows / world + (rows % world != 0 ? 1 : 0);
  // rank * cs can exceed int64_t only when it is past the end anyway.
  const __int128 begin128 = static_cast<__int128>(rank) * cs;
  const int64_t begin = begin128 >= rows ? rows : static_cast<int64_t>(begin128);
  const int64_t end = cs > rows - begin ? rows : begin + cs;
  return {begin, end};
}

RowRange tensor_rows(std::span<const int64_t> shape, int64_t rank, int64_t world) {
  if (shape.empty()) {
    chunk_rows(1, rank, world);  // the same argument checks
    return {0, 1};
  }
  return chunk_rows(shape[0], rank, world);
}

}  // namespace fsdp_ema::format
