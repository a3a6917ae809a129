#include "ops/checkpoint_meta.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/scalar_tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/irange.h>

#include <utility>

#include "fsdp_ema/format/error.h"
#include "fsdp_ema/format/shard_file.h"
#include "ops/checkpoint.h"
#include "ops/checkpoint_read.h"
#include "ops/format_bridge.h"

namespace fsdp_ema::ops {
namespace {

const at::TensorOptions kMeta = at::TensorOptions().device(at::kMeta);

// The device of the first non-CPU tensor, else the CPU: where FakeTensorMode puts the results of
// a Meta kernel whose tensor inputs are 0-dim (a CPU 0-dim tensor defers to any other device).
at::Device result_device(at::TensorList tensors) {
  for (const at::Tensor& t : tensors) {
    if (!t.device().is_cpu()) return t.device();
  }
  return at::kCPU;
}

// An empty tensor on the device the results go to: what the private load ops dispatch on.
at::Tensor target_on(std::optional<at::Device> device) {
  return at::empty({0}, at::TensorOptions().dtype(at::kByte).device(device.value_or(at::kCPU)));
}

}  // namespace

bool is_real_meta(const at::Tensor& t) {
  return t.is_meta() && !t.key_set().has(c10::DispatchKey::Python);
}

at::Tensor save_shard_cuda(c10::string_view directory, int64_t rank, int64_t world_size,
                           const std::vector<std::string>& names, at::TensorList shards,
                           at::IntArrayRef offsets, at::IntArrayRef global_shapes, bool fsync,
                           bool overwrite) {
  const int64_t bytes = save_shard(directory, rank, world_size, names, shards, offsets,
                                   global_shapes, fsync, overwrite)
                            .item<int64_t>();
  // A fill on the device, not a copy from pageable memory.
  return at::scalar_tensor(bytes,
                           at::TensorOptions().dtype(at::kLong).device(result_device(shards)));
}

at::Tensor save_shard_meta(c10::string_view directory, int64_t rank, int64_t world_size,
                           const std::vector<std::string>& names, at::TensorList shards,
                           at::IntArrayRef offsets, at::IntArrayRef global_shapes, bool fsync,
                           bool overwrite) {
  constexpr const char* kOp = "fsdp_ema::save_shard: ";
  check_rank(kOp, rank, world_size);
  TORCH_CHECK(names.size() == shards.size(), kOp, "names has ", names.size(),
              " entries but shards has ", shards.size());
  int64_t dims = 0;
  for (const auto i : c10::irange(shards.size())) {
    TORCH_CHECK(!is_real_meta(shards[i]), kOp, "shards[", i, "] ('", names[i],
                "') is a meta tensor, which has no data to save");
    dims += shards[i].dim();
  }
  TORCH_CHECK(static_cast<int64_t>(offsets.size()) == dims, kOp, "offsets has ", offsets.size(),
              " entries but the shards have ", dims, " dimensions in total (one offset per dim)");
  TORCH_CHECK(static_cast<int64_t>(global_shapes.size()) == dims, kOp, "global_shapes has ",
              global_shapes.size(), " entries but the shards have ", dims,
              " dimensions in total (one size per dim)");
  return at::empty({}, kMeta.dtype(at::kLong));
}

at::Tensor commit_after(c10::string_view directory, int64_t world_size, at::TensorList after,
                        bool overwrite, bool fsync) {
  // Each save_shard in `after` wrote its file before it returned: nothing to wait for.
  const int64_t n = commit_checkpoint(directory, world_size, overwrite, fsync);
  return at::scalar_tensor(n, at::TensorOptions().dtype(at::kLong).device(result_device(after)));
}

at::Tensor commit_after_meta(c10::string_view directory, int64_t world_size, at::TensorList after,
                             bool overwrite, bool fsync) {
  constexpr const char* kOp = "fsdp_ema::commit_checkpoint: ";
  TORCH_CHECK(world_size >= 1, kOp, "world_size must be >= 1, got ", world_size);
  for (const auto i : c10::irange(after.size())) {
    TORCH_CHECK(!is_real_meta(after[i]), kOp, "after[", i,
                "] is a meta tensor: a call on meta tensors outside tracing would commit nothing");
  }
  return at::empty({}, kMeta.dtype(at::kLong));
}

std::vector<at::Tensor> load_tensors_entry(c10::string_view directory,
                                           const std::vector<std::string>& names, int64_t rank,
                                           int64_t world_size, bool verify,
                                           std::optional<at::Device> device, bool mmap) {
  return load_tensors_after_entry(directory, names, {}, rank, world_size, verify, device, mmap);
}

std::vector<at::Tensor> load_tensors_after_entry(c10::string_view directory,
                                                 const std::vector<std::string>& names,
                                                 at::TensorList after, int64_t rank,
                                                 int64_t world_size, bool verify,
                                                 std::optional<at::Device> device, bool mmap) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("fsdp_ema::_load_tensors", "")
                             .typed<std::vector<at::Tensor>(
                                 const at::Tensor&, at::TensorList, c10::string_view,
                                 const std::vector<std::string>&, int64_t, int64_t, bool, bool)>();
  const at::Tensor target = target_on(device);
  // On the target's device, so that the private op has one device to dispatch (and trace) on.
  std::vector<at::Tensor> moved;
  moved.reserve(after.size());
  for (const at::Tensor& t : after) moved.push_back(t.to(target.device()));
  return op.call(target, moved, directory, names, rank, world_size, verify, mmap);
}

std::vector<at::Tensor> load_tensors_to(const at::Tensor& target, at::TensorList after,
                                        c10::string_view directory,
                                        const std::vector<std::string>& names, int64_t rank,
                                        int64_t world_size, bool verify, bool mmap) {
  return load_tensors(directory, names, rank, world_size, verify, target.device(), mmap);
}

std::vector<at::Tensor> load_tensors_meta(const at::Tensor& target, at::TensorList after,
                                          c10::string_view directory,
                                          const std::vector<std::string>& names, int64_t rank,
                                          int64_t world_size, bool verify, bool mmap) {
  constexpr const char* kOp = "fsdp_ema::load_tensors: ";
  check_rank(kOp, rank, world_size);
  return translate_errors(kOp, [&] {
    // Opening validates the index and the shard headers; no tensor data is read.
    const format::CheckpointDir dir = format::CheckpointDir::open(std::string(directory));
    std::vector<at::Tensor> out;
    out.reserve(names.size());
    for (const auto& name : names) {
      const format::IndexTensor& info = dir.tensor(name);
      std::vector<int64_t> shape(info.shape.begin(), info.shape.end());
      if (!shape.empty()) shape[0] = rank_rows(info, rank, world_size).size();
      out.push_back(at::empty(shape, kMeta.dtype(to_scalar_type(info.dtype))));
    }
    return out;
  });
}

ShardContents load_shard_entry(c10::string_view path, bool verify, std::optional<at::Device> device,
                               bool mmap) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("fsdp_ema::_load_shard", "")
          .typed<ShardContents(const at::Tensor&, c10::string_view, bool, bool)>();
  return op.call(target_on(device), path, verify, mmap);
}

ShardContents load_shard_to(const at::Tensor& target, c10::string_view path, bool verify,
                            bool mmap) {
  return load_shard(path, verify, target.device(), mmap);
}

ShardContents load_shard_meta(const at::Tensor& target, c10::string_view path, bool verify,
                              bool mmap) {
  constexpr const char* kOp = "fsdp_ema::load_shard: ";
  return translate_errors(kOp, [&] {
    // Header only: the checksums are not checked (that would read the data).
    const format::ShardFile file = format::ShardFile::open(std::string(path), false);
    ShardContents out;
    auto& [names, tensors, offsets, global_shapes] = out;
    for (const format::TensorInfo& info : file.tensors()) {
      names.push_back(info.name);
      offsets.insert(offsets.end(), info.offsets.begin(), info.offsets.end());
      global_shapes.insert(global_shapes.end(), info.global_shape.begin(), info.global_shape.end());
      tensors.push_back(at::empty(info.shape, kMeta.dtype(to_scalar_type(info.dtype))));
    }
    return out;
  });
}

}  // namespace fsdp_ema::ops
