// Host side of load_into_: a committed checkpoint read into existing tensors.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>
#include <torch/custom_class.h>

#include <memory>
#include <string>
#include <vector>

#include "fsdp_ema/format/checkpoint_dir.h"

namespace fsdp_ema::ops {

// Reads the named tensors of the committed checkpoint `directory` (ours, or a DCP HuggingFace
// directory) into `out`: whole for world_size == 1, else the dim-0 rows rank `rank` of
// `world_size` holds (torch.chunk semantics).
//   names: [N]  fully qualified names
//   out:   [N]  destinations (CPU or CUDA, any strides) of the stored dtype and of the shape of
//               the rows read; no two may share memory
// Validates every destination and (verify) hashes every stored piece it reads before writing
// any destination; then fstat's every file (size, mtime, ctime) before the first write and after
// the last read: a file modified in place after it was hashed is refused with nothing written,
// one modified while it is read raises (destinations may then be partly written).
void load_into_(c10::string_view directory, const std::vector<std::string>& names,
                at::TensorList out, int64_t rank, int64_t world_size, bool verify);

// Tracing: the same checks against the index (no tensor data read, nothing written).
void load_into_meta(c10::string_view directory, const std::vector<std::string>& names,
                    at::TensorList out, int64_t rank, int64_t world_size, bool verify);

// The op class torch.classes.fsdp_ema.OpenCheckpoint: a checkpoint directory opened once (its
// index and shard headers parsed, its files held open), so that a collective load can check
// everything on every rank, agree, and only then write, with every read of one rank going to the
// same files and each stored piece hashed once:
//   check_into  what load_into_ checks and hashes, writing nothing
//   load_into_  load_into_ on this directory (pieces check_into hashed are not hashed again)
//   load        load_tensors on this directory (owned CPU tensors)
//   check_unchanged  no file modified since it was opened (fstat: size, mtime, ctime)
//   info        checkpoint_info's JSON
// Once open, a file replaced by rename (an overwrite committed meanwhile) is read as it was when
// opened, or refused ("changed since it was opened") if its descriptor had to be reopened; a
// file modified in place between check_into and load_into_ / load (same size, mtime set back)
// is refused by their fstat check: its ctime, which no user can set, moved.
class OpenCheckpoint : public torch::CustomClassHolder {
 public:
  explicit OpenCheckpoint(const std::string& directory);
  void check_into(const std::vector<std::string>& names, const std::vector<at::Tensor>& out,
                  int64_t rank, int64_t world_size, bool verify) const;
  void load_into_(const std::vector<std::string>& names, const std::vector<at::Tensor>& out,
                  int64_t rank, int64_t world_size, bool verify) const;
  std::vector<at::Tensor> load(const std::vector<std::string>& names, int64_t rank,
                               int64_t world_size, bool verify) const;
  // fstat of every file against what was opened (format::CheckpointDir::check_unchanged).
  void check_unchanged() const;
  std::string info() const;

 private:
  std::string directory_;
  std::shared_ptr<const format::CheckpointDir> dir_;
};

}  // namespace fsdp_ema::ops
