// Reads of a committed checkpoint into torch tensors, shared by the load ops (load_tensors,
// load_into_, the Meta kernels) and the public C++ reader (fsdp_ema::CheckpointReader).
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <utility>
#include <vector>

#include "fsdp_ema/format/checkpoint_dir.h"
#include "fsdp_ema/format/rows.h"

namespace fsdp_ema::ops {

// The dim-0 rows [rows.begin, rows.end) of `tensor` (all of it for a 0-dim tensor) as a CPU
// tensor the caller owns (read and verified in one pass). With mmap (opt-in), when one stored
// piece holds exactly those rows, the result is instead a zero-copy view of a private mapping of
// the file that keeps `dir` open (see load_shard for the risk).
at::Tensor read_rows(const std::shared_ptr<const format::CheckpointDir>& dir,
                     const format::IndexTensor& tensor, format::RowRange rows, bool verify,
                     bool mmap);

// Checks, in parallel, every stored piece that intersects the requested rows of each tensor
// (each piece at most once per CheckpointDir), so that later reads need not hash sequentially.
void verify_pieces(
    const format::CheckpointDir& dir,
    const std::vector<std::pair<const format::IndexTensor*, format::RowRange>>& plan);

}  // namespace fsdp_ema::ops
