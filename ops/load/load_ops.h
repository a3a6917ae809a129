// Every load op and its kernels, on the one read pipeline (ops/load/pipeline.h):
//   load_tensors (+ .after and the private _load_tensors it calls; ops/common/tracing.h says why),
//   load_shard (+ _load_shard), load_into_, and the op class OpenCheckpoint.
// Each byte a load returns or writes was verified in the pass that read it (with verify).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/util/string_view.h>
#include <torch/custom_class.h>

#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "fsdp_ema/format/checkpoint_dir.h"

namespace fsdp_ema::ops {

// --- load_tensors --------------------------------------------------------------------------------
// Tensors of a committed checkpoint (or DCP HuggingFace directory): for world_size == 1 the full
// tensors, else the dim-0 rows rank `rank` of `world_size` holds (torch.chunk semantics). Owned
// memory read and verified in one pass; with mmap (opt-in), zero-copy views where one stored piece
// holds exactly the rows asked for (live views of the file, verified at load time).
std::vector<at::Tensor> load_tensors(c10::string_view directory,
                                     const std::vector<std::string>& names, int64_t rank,
                                     int64_t world_size, bool verify,
                                     std::optional<at::Device> device, bool mmap);
// CompositeImplicitAutograd kernels of load_tensors and load_tensors.after: the private op on an
// empty `target` tensor on `device` (and `after` moved there).
std::vector<at::Tensor> load_tensors_entry(c10::string_view directory,
                                           const std::vector<std::string>& names, int64_t rank,
                                           int64_t world_size, bool verify,
                                           std::optional<at::Device> device, bool mmap);
std::vector<at::Tensor> load_tensors_after_entry(c10::string_view directory,
                                                 const std::vector<std::string>& names,
                                                 at::TensorList after, int64_t rank,
                                                 int64_t world_size, bool verify,
                                                 std::optional<at::Device> device, bool mmap);
// _load_tensors on CPU and CUDA: load_tensors onto target's device.
//   target: an empty tensor on the device to load to (only its device is used)
//   after:  tensors on target's device the load must follow in a graph (not read)
std::vector<at::Tensor> load_tensors_to(const at::Tensor& target, at::TensorList after,
                                        c10::string_view directory,
                                        const std::vector<std::string>& names, int64_t rank,
                                        int64_t world_size, bool verify, bool mmap);
// _load_tensors' Meta kernel: reads the index only; meta tensors of each result's dtype and shape.
std::vector<at::Tensor> load_tensors_meta(const at::Tensor& target, at::TensorList after,
                                          c10::string_view directory,
                                          const std::vector<std::string>& names, int64_t rank,
                                          int64_t world_size, bool verify, bool mmap);

// --- load_shard ----------------------------------------------------------------------------------
// Names, local shards, concatenated global offsets, concatenated global shapes.
using ShardContents = std::tuple<std::vector<std::string>, std::vector<at::Tensor>,
                                 std::vector<int64_t>, std::vector<int64_t>>;
// One shard file back, read and verified in one pass (mmap: CPU views of the file's mapping).
ShardContents load_shard(c10::string_view path, bool verify, std::optional<at::Device> device,
                         bool mmap);
ShardContents load_shard_entry(c10::string_view path, bool verify, std::optional<at::Device> device,
                               bool mmap);
ShardContents load_shard_to(const at::Tensor& target, c10::string_view path, bool verify,
                            bool mmap);
// _load_shard's Meta kernel: reads the file's header only.
ShardContents load_shard_meta(const at::Tensor& target, c10::string_view path, bool verify,
                              bool mmap);

// --- load_into_ ----------------------------------------------------------------------------------
// Reads the named tensors (as load_tensors would return them for `rank` of `world_size`) into
// `out`:
//   names: [N]  fully qualified names
//   out:   [N]  destinations (CPU or CUDA, any strides) of the stored dtype and of the shape of
//               the rows read; no two may share memory
// Two passes: the check (every destination, then every byte it will read hashed, nothing written)
// and the write (every byte hashed again as it is read into the destinations). A bad request or
// a corrupted file is refused with nothing written; a file that changes between the passes, or
// during the write, raises from the write (destinations may then be partly written).
void load_into_(c10::string_view directory, const std::vector<std::string>& names,
                at::TensorList out, int64_t rank, int64_t world_size, bool verify);
// Tracing: the same checks against the index (no tensor data read, nothing written).
void load_into_meta(c10::string_view directory, const std::vector<std::string>& names,
                    at::TensorList out, int64_t rank, int64_t world_size, bool verify);

// --- OpenCheckpoint ------------------------------------------------------------------------------
// torch.classes.fsdp_ema.OpenCheckpoint: a checkpoint directory opened once (index and headers
// parsed, files held open), so that a collective load can check everything on every rank, agree,
// and only then write, every read of one rank going to the same files:
//   check_into       load_into_'s check pass (every destination; every byte read and hashed)
//   load_into_       load_into_ on this directory: the check pass (skipped with `checked`: the
//                    caller ran check_into with the same arguments), then the write pass (every
//                    byte hashed again as it is read into place)
//   load             load_tensors on this directory (owned CPU tensors, verified as read)
//   load_boxes       boxes of tensors (offsets and shapes concatenated), fresh, reading only the
//                    blocks the boxes touch
//   check_unchanged  an early refusal: fstat of every file against the open (size, mtime, ctime)
//   info             checkpoint_info's JSON
// A file replaced by rename (an overwrite committed meanwhile) is read as it was when opened, or
// refused ("changed since it was opened") if its descriptor had to be reopened. A file changed in
// place between check_into and load_into_ is refused by load_into_'s hashes (a write through a
// shared mapping moves neither mtime nor ctime, so fstat alone cannot prove a file unchanged).
class OpenCheckpoint : public torch::CustomClassHolder {
 public:
  explicit OpenCheckpoint(const std::string& directory);
  void check_into(const std::vector<std::string>& names, const std::vector<at::Tensor>& out,
                  int64_t rank, int64_t world_size, bool verify) const;
  void load_into_(const std::vector<std::string>& names, const std::vector<at::Tensor>& out,
                  int64_t rank, int64_t world_size, bool verify, bool checked) const;
  std::vector<at::Tensor> load(const std::vector<std::string>& names, int64_t rank,
                               int64_t world_size, bool verify) const;
  std::vector<at::Tensor> load_boxes(const std::vector<std::string>& names,
                                     const std::vector<int64_t>& offsets,
                                     const std::vector<int64_t>& shapes, bool verify) const;
  void check_unchanged() const;
  std::string info() const;

 private:
  std::shared_ptr<const format::CheckpointDir> dir_;
};

}  // namespace fsdp_ema::ops
