// fsdp_ema::load_tensors, load_tensors.after and the private _load_tensors they call (see
// ops/tracing.h for why): named tensors of a committed checkpoint, whole or the dim-0 rows one rank
// of any world size holds. Their kernels, and load_tensors_from, which OpenCheckpoint and the C++
// reader share.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/util/string_view.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "fsdp_ema/format/checkpoint_dir.h"
#include "ops/reads.h"

namespace fsdp_ema::ops {

// Tensors of a committed checkpoint (or DCP HuggingFace directory): for world_size == 1 the full
// tensors, else the dim-0 rows rank `rank` of `world_size` holds (torch.chunk semantics). Owned
// memory read and verified in one pass; with mmap (opt-in), zero-copy views where one stored
// piece holds exactly the rows asked for.
std::vector<at::Tensor> load_tensors(c10::string_view directory,
                                     const std::vector<std::string>& names, int64_t rank,
                                     int64_t world_size, bool verify,
                                     std::optional<at::Device> device, bool mmap);
// load_tensors on a directory opened already (errors are format::FormatError, untranslated).
std::vector<at::Tensor> load_tensors_from(const std::shared_ptr<const format::CheckpointDir>& dir,
                                          const std::vector<std::string>& names, int64_t rank,
                                          int64_t world_size, bool verify,
                                          std::optional<at::Device> device, bool mmap);
// load_tensors_from of a plan made already (the C++ reader's load_all plans from the index).
std::vector<at::Tensor> load_plan(const std::shared_ptr<const format::CheckpointDir>& dir,
                                  const RowsPlan& plan, bool verify,
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

}  // namespace fsdp_ema::ops
