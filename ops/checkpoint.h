// Host side of the checkpoint ops: save_shard, commit_checkpoint, load_shard, load_tensors,
// checkpoint_info, and the directory ops the Python front needs (prepare_checkpoint,
// write_sidecar, committed_checkpoints, remove_checkpoint). The file format and every rule of the
// directory layout live in format/ (torch-free; layout.h); this file adapts torch tensors to it and
// back. dtype maps and error translation: ops/format_bridge.h.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/util/ArrayRef.h>

#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "fsdp_ema/format/checkpoint_dir.h"
#include "fsdp_ema/format/dtype.h"
#include "ops/checkpoint_read.h"
#include "ops/format_bridge.h"

namespace fsdp_ema::ops {

// Writes one rank's local shards to <directory>/shard-<rank>-of-<world_size>.safetensors (with
// overwrite, into a committed directory: under a name its index does not reference, see
// fsdp_ema/format/layout.h; without, a committed directory is refused).
//   names:         [N]    fully qualified names
//   shards:        [N]    local shards (any device; CUDA staged through pinned memory)
//   offsets:       [sum of shards[i].dim()]  global offset of each shard, concatenated
//   global_shapes: [sum of shards[i].dim()]  global shape of each tensor, concatenated
// Returns the file's size in bytes (0-dim int64 CPU tensor).
at::Tensor save_shard(c10::string_view directory, int64_t rank, int64_t world_size,
                      const std::vector<std::string>& names, at::TensorList shards,
                      at::IntArrayRef offsets, at::IntArrayRef global_shapes, bool fsync,
                      bool overwrite);

// Writes <directory>/fsdp_ema.index.json from the headers of the world_size shard files: the
// commit marker (format::commit_directory: an overwrite replaces the old index in one rename, then
// removes the files only the old one referenced). Returns the number of tensors.
int64_t commit_checkpoint(c10::string_view directory, int64_t world_size, bool overwrite,
                          bool fsync);

// One shard file back: names, local shards, concatenated offsets and global shapes. The shards
// are memory the caller owns, read and verified in one pass; with mmap (opt-in) CPU shards are
// zero-copy views of a private mapping of the file instead (truncating the file while they live,
// then touching them, raises SIGBUS, as with torch.load(mmap=True)).
std::tuple<std::vector<std::string>, std::vector<at::Tensor>, std::vector<int64_t>,
           std::vector<int64_t>>
load_shard(c10::string_view path, bool verify, std::optional<at::Device> device, bool mmap);

// Tensors of a committed checkpoint (or DCP HuggingFace directory): for world_size == 1 the full
// tensors, else the dim-0 rows rank `rank` of `world_size` holds (torch.chunk semantics).
std::vector<at::Tensor> load_tensors(c10::string_view directory,
                                     const std::vector<std::string>& names, int64_t rank,
                                     int64_t world_size, bool verify,
                                     std::optional<at::Device> device, bool mmap);

// load_tensors on a directory opened already (errors are format::FormatError, untranslated).
std::vector<at::Tensor> load_tensors_from(const std::shared_ptr<const format::CheckpointDir>& dir,
                                          const std::vector<std::string>& names, int64_t rank,
                                          int64_t world_size, bool verify,
                                          std::optional<at::Device> device, bool mmap);

// checkpoint_info's JSON of a directory opened already.
std::string info_json(const format::CheckpointDir& dir);

// JSON: {"layout", "world_size", "tensors": {name: {"dtype", "torch_dtype", "shape"}},
// "metadata"}; "torch_dtype" is the torch attribute name ("float32").
std::string checkpoint_info(c10::string_view directory);

// Creates `directory` (and parents) if missing; true when it holds a committed checkpoint already
// (format::prepare_checkpoint_dir).
bool prepare_checkpoint(c10::string_view directory);
// Whether `directory` holds a committed checkpoint (format::is_committed); creates nothing.
bool is_committed(c10::string_view directory);
// A small file beside the shard files, written atomically (format::write_sidecar).
void write_sidecar(c10::string_view directory, c10::string_view name, c10::string_view content,
                   bool fsync);
// Names of the committed checkpoint directories in `root`, in name order.
std::vector<std::string> committed_checkpoints(c10::string_view root, bool follow_links);
// Removes a checkpoint directory, index first (format::remove_checkpoint).
void remove_checkpoint(c10::string_view directory);

}  // namespace fsdp_ema::ops
