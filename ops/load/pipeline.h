// The torch side of the read pipeline (docs/ARCHITECTURE.md, "Reads"): every load of the library
// (load_tensors, load_shard, load_into_ / check_into, OpenCheckpoint, the C++ CheckpointReader
// and its AOTInductor loader) opens its directory here, plans here (which tensor, which rows or
// box, where it goes) and runs through format/'s planner and executors (read_plan.h,
// read_exec.h): each byte verified in the pass that reads it, then placed into a fresh CPU tensor,
// an existing destination, or through two pinned buffers onto a device.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/util/string_view.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "fsdp_ema/format/checkpoint_dir.h"
#include "fsdp_ema/format/shard_file.h"

namespace fsdp_ema::ops {

// The one way a load opens a checkpoint directory; errors carry `op` in front.
std::shared_ptr<const format::CheckpointDir> open_dir(const char* op, c10::string_view directory);

// One tensor a load reads: its position in dir.tensors() and the dim-0 rows of it (the whole
// tensor for a 0-dim one), or (box_shape not empty) a box of it.
struct LoadItem {
  size_t tensor = 0;
  format::RowRange rows;
  std::vector<int64_t> box_offsets;
  std::vector<int64_t> box_shape;
};
using LoadPlan = std::vector<LoadItem>;

// The one planner of the loads, which the Meta kernels run too: every name looked up, and the
// rows rank `rank` of `world_size` holds (format::tensor_rows). Throws FormatError.
LoadPlan plan_rows(const format::CheckpointDir& dir, const std::vector<std::string>& names,
                   int64_t rank, int64_t world_size);
// The same for boxes: offsets and shapes concatenated, one entry per dimension of each tensor.
LoadPlan plan_boxes(const format::CheckpointDir& dir, const std::vector<std::string>& names,
                    const std::vector<int64_t>& offsets, const std::vector<int64_t>& shapes);
// The shape an item reads.
std::vector<int64_t> item_shape(const format::CheckpointDir& dir, const LoadItem& item);
at::ScalarType item_dtype(const format::CheckpointDir& dir, const LoadItem& item);

// The checks of a load into existing tensors, before anything is read: one destination per item,
// defined, dense, of the stored dtype and the item's shape, CPU or CUDA (meta: a tracer's fake
// tensors), inside its storage, no two sharing memory. Errors name `op`, out[i] and names[i].
void check_destinations(const char* op, const format::CheckpointDir& dir, const LoadPlan& plan,
                        const std::vector<std::string>& names, at::TensorList out, int64_t rank,
                        int64_t world_size, bool meta);

// Threads a load reads on: torch's intra-op thread count (at least one).
size_t read_threads();

// A fresh CPU tensor a load reads into. Large ones are 2 MiB-aligned and ask for transparent huge
// pages (madvise): a fresh 4 KiB page costs a fault (2-3 us on this project's VMs, 262,144 of them
// per GiB), a huge page one fault per 2 MiB (bench/RESULTS.md, issue 29).
at::Tensor empty_for_read(c10::IntArrayRef shape, at::ScalarType dtype);

// The plan's tensors, fresh: CPU tensors the caller owns, read and verified in one pass; on a
// CUDA device through the two staging buffers (each block verified before it is copied); on other
// devices one tensor at a time through the CPU. With mmap (CPU, opt-in), an item one stored piece
// holds exactly is instead a zero-copy view of a private mapping of its file that this call made
// (ShardFile::map; verified through it at load time; a live view of the file: changes to the file
// afterwards show through, and truncating it then touching the view raises SIGBUS), which the
// view keeps alive. No two calls share a mapping: a write through one's tensors reaches no other.
std::vector<at::Tensor> read_fresh(const std::shared_ptr<const format::CheckpointDir>& dir,
                                   const LoadPlan& plan, bool verify,
                                   std::optional<at::Device> device, bool mmap);

// The plan's tensors into out[i] (checked by check_destinations): contiguous CPU destinations read
// into directly, contiguous CUDA ones through the staging buffers, the others through host
// buffers of their own (pinned for CUDA) and copied. With verify, every byte is hashed as it is
// read; a mismatch raises (destinations may then be partly written: callers that must refuse
// with nothing written run check_reads first).
void read_into(const format::CheckpointDir& dir, const LoadPlan& plan, at::TensorList out,
               bool verify);

// Reads and verifies every byte the plan reads, writing nothing: what a check-then-write load
// runs before its first write.
void check_reads(const format::CheckpointDir& dir, const LoadPlan& plan, bool verify);

// Every tensor of one shard file, whole, fresh (as read_fresh: owned CPU memory read and verified
// in one pass, a CUDA device through the staging buffers, mmap views on the CPU).
std::vector<at::Tensor> read_file(const std::shared_ptr<const format::ShardFile>& file, bool verify,
                                  at::Device device, bool mmap);

}  // namespace fsdp_ema::ops
