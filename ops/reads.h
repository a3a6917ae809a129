// Reads of a committed checkpoint into torch tensors, shared by the load ops (load_tensors,
// load_into_, the Meta kernels) and the public C++ reader (fsdp_ema::CheckpointReader): every
// owned or in-place read goes through one CheckpointDir::read_rows_batch (chunked, on torch's
// intra-op thread count, hashed in order).
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <utility>
#include <vector>

#include "fsdp_ema/format/checkpoint_dir.h"
#include "fsdp_ema/format/rows.h"

namespace fsdp_ema::ops {

// A fresh CPU tensor a load reads into. Large ones are 2 MiB-aligned and ask for transparent
// huge pages (madvise): a fresh 4 KiB page costs a fault (2-3 us on this project's VMs, 262,144
// of them per GiB), a huge page one fault per 2 MiB (bench/RESULTS.md, issue 29). Small ones
// come from torch's CPU allocator.
at::Tensor empty_for_read(c10::IntArrayRef shape, at::ScalarType dtype);

// Per tensor: its index entry and the dim-0 rows to read (all of it for a 0-dim tensor).
using RowsPlan = std::vector<std::pair<const format::IndexTensor*, format::RowRange>>;

// Threads a load reads on: torch's intra-op thread count (at least one).
size_t read_threads();

// The shape of `rows` of `tensor`: its stored shape with dim 0 cut to the rows (a 0-dim tensor's
// own shape).
std::vector<int64_t> rows_shape(const format::IndexTensor& tensor, format::RowRange rows);

// The rows of every plan entry as CPU tensors the caller owns (read and verified in one pass).
// With mmap (opt-in), an entry one stored piece holds exactly is instead a zero-copy view of a
// private mapping of the file that keeps `dir` open (see load_shard for the risk); its piece is
// verified before the view is made.
std::vector<at::Tensor> read_rows(const std::shared_ptr<const format::CheckpointDir>& dir,
                                  const RowsPlan& plan, bool verify, bool mmap);

// Reads plan[i]'s rows into dst[i]: contiguous CPU tensors of the stored dtype and of exactly
// those rows' size.
void read_rows_into(const format::CheckpointDir& dir, const RowsPlan& plan,
                    const std::vector<at::Tensor>& dst, bool verify);

// Checks, in parallel, every stored piece that intersects the requested rows of each tensor
// (each piece at most once per CheckpointDir), so that later reads need not hash sequentially.
// `mapped` (zero-copy loads only): hashed through the file's mapping, which the views read
// anyway, instead of copied out first.
void verify_pieces(const format::CheckpointDir& dir, const RowsPlan& plan, bool mapped = false);

}  // namespace fsdp_ema::ops
