// fsdp_ema::commit_checkpoint and commit_checkpoint.after: the index written once every rank's
// shard file is there (format::commit_directory). Their kernels and the validation they share.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

#include <cstdint>
#include <string>
#include <vector>

namespace fsdp_ema::ops {

// Writes <directory>/fsdp_ema.index.json from the headers of the world_size shard files: the
// commit marker (an overwrite replaces the old index in one rename, then removes the files only
// the old one referenced). Returns the number of tensors.
int64_t commit_checkpoint(c10::string_view directory, int64_t world_size, bool overwrite,
                          bool fsync);
// .metadata: the same, with `metadata` (key, value, key, value, ...) as the index's "metadata"
// object; an odd count or a repeated key is refused before any file is touched.
int64_t commit_with_metadata(c10::string_view directory, int64_t world_size,
                             const std::vector<std::string>& metadata, bool overwrite, bool fsync);
// .after (CPU and CUDA): the same, returning the count as a 0-dim int64 tensor on the device of the
// first non-CPU tensor of `after` (the CPU when there is none). `after` (the save_shard results)
// is not read: it makes the commit depend on the saves inside a graph.
at::Tensor commit_after(c10::string_view directory, int64_t world_size, at::TensorList after,
                        bool overwrite, bool fsync);
// .after's Meta kernel: the validation, and a 0-dim int64 meta tensor.
at::Tensor commit_after_meta(c10::string_view directory, int64_t world_size, at::TensorList after,
                             bool overwrite, bool fsync);

}  // namespace fsdp_ema::ops
