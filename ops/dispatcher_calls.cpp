// include/fsdp_ema/ops.h: typed wrappers that go through the dispatcher.
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <mutex>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <tuple>

#include "fsdp_ema/ops.h"

namespace fsdp_ema {
namespace {

using TensorList = c10::ArrayRef<at::Tensor>;

template <typename Decay>
c10::TypedOperatorHandle<void(TensorList, TensorList, Decay)> find_op(const char* name,
                                                                      const char* overload) {
  return c10::Dispatcher::singleton()
      .findSchemaOrThrow(name, overload)
      .template typed<void(TensorList, TensorList, Decay)>();
}

}  // namespace

void update_(TensorList ema, TensorList model, double decay) {
  static const auto op = find_op<double>("fsdp_ema::update_", "");
  op.call(ema, model, decay);
}

void update_(TensorList ema, TensorList model, const at::Tensor& decay) {
  static const auto op = find_op<const at::Tensor&>("fsdp_ema::update_", "Tensor");
  op.call(ema, model, decay);
}

void ema_shard_update_(TensorList ema, TensorList model, double decay) {
  static const auto op = find_op<double>("fsdp_ema::ema_shard_update_", "");
  op.call(ema, model, decay);
}

void ema_shard_update_(TensorList ema, TensorList model, const at::Tensor& decay) {
  static const auto op = find_op<const at::Tensor&>("fsdp_ema::ema_shard_update_", "Tensor");
  op.call(ema, model, decay);
}

void update_multi_(TensorList ema, TensorList model, c10::ArrayRef<double> decays) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("fsdp_ema::update_multi_", "")
                             .typed<void(TensorList, TensorList, c10::ArrayRef<double>)>();
  op.call(ema, model, decays);
}

void update_multi_(TensorList ema, TensorList model, TensorList decays) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("fsdp_ema::update_multi_", "Tensor")
                             .typed<void(TensorList, TensorList, TensorList)>();
  op.call(ema, model, decays);
}

int64_t save_shard(const std::string& directory, int64_t rank, int64_t world_size,
                   const std::vector<std::string>& names, TensorList shards,
                   c10::ArrayRef<int64_t> offsets, c10::ArrayRef<int64_t> global_shapes, bool fsync,
                   bool overwrite) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("fsdp_ema::save_shard", "")
          .typed<at::Tensor(c10::string_view, int64_t, int64_t, const std::vector<std::string>&,
                            TensorList, c10::ArrayRef<int64_t>, c10::ArrayRef<int64_t>, bool,
                            bool)>();
  return op
      .call(directory, rank, world_size, names, shards, offsets, global_shapes, fsync, overwrite)
      .item<int64_t>();
}

int64_t commit_checkpoint(const std::string& directory, int64_t world_size, bool overwrite,
                          bool fsync) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("fsdp_ema::commit_checkpoint", "")
                             .typed<int64_t(c10::string_view, int64_t, bool, bool)>();
  return op.call(directory, world_size, overwrite, fsync);
}

at::Tensor commit_checkpoint(const std::string& directory, int64_t world_size, TensorList after,
                             bool overwrite, bool fsync) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("fsdp_ema::commit_checkpoint", "after")
          .typed<at::Tensor(c10::string_view, int64_t, TensorList, bool, bool)>();
  return op.call(directory, world_size, after, overwrite, fsync);
}

std::vector<at::Tensor> load_tensors(const std::string& directory,
                                     const std::vector<std::string>& names, int64_t rank,
                                     int64_t world_size, bool verify,
                                     std::optional<at::Device> device, bool mmap) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("fsdp_ema::load_tensors", "")
          .typed<std::vector<at::Tensor>(c10::string_view, const std::vector<std::string>&, int64_t,
                                         int64_t, bool, std::optional<at::Device>, bool)>();
  return op.call(directory, names, rank, world_size, verify, device, mmap);
}

ShardFileContents load_shard(const std::string& path, bool verify, std::optional<at::Device> device,
                             bool mmap) {
  using Result = std::tuple<std::vector<std::string>, std::vector<at::Tensor>, std::vector<int64_t>,
                            std::vector<int64_t>>;
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("fsdp_ema::load_shard", "")
          .typed<Result(c10::string_view, bool, std::optional<at::Device>, bool)>();
  auto [names, shards, offsets, global_shapes] = op.call(path, verify, device, mmap);
  return {std::move(names), std::move(shards), std::move(offsets), std::move(global_shapes)};
}

std::string checkpoint_info(const std::string& directory) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("fsdp_ema::checkpoint_info", "")
                             .typed<std::string(c10::string_view)>();
  return op.call(directory);
}

std::pair<int64_t, int64_t> chunk_rows(int64_t rows, int64_t rank, int64_t world_size) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("fsdp_ema::chunk_rows", "")
                             .typed<std::vector<int64_t>(int64_t, int64_t, int64_t)>();
  const std::vector<int64_t> r = op.call(rows, rank, world_size);
  return {r[0], r[1]};
}

std::vector<at::Tensor> gather_shards(TensorList shards, c10::ArrayRef<int64_t> rows,
                                      const std::string& group_name) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("fsdp_ema::gather_shards", "")
          .typed<std::vector<at::Tensor>(TensorList, c10::ArrayRef<int64_t>, c10::string_view)>();
  return op.call(shards, rows, group_name);
}

std::vector<at::Tensor> gather_shards(TensorList shards, c10::ArrayRef<int64_t> rows,
                                      const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
  return gather_shards(shards, rows, register_process_group(group));
}

std::string register_process_group(const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
  TORCH_CHECK(group, "fsdp_ema::register_process_group: group is null");
  // Serialized so that two threads registering one group agree on its name.
  static std::mutex mutex;
  static std::atomic<int64_t> next{0};
  const std::lock_guard<std::mutex> lock(mutex);
  std::string current;
  try {
    current = group->getGroupName();  // throws for a group never named
  } catch (const std::exception&) {
  }
  if (!current.empty()) {
    bool taken = false;
    try {
      const auto registered = c10d::resolve_process_group(current);
      if (registered.get() == group.get()) return current;
      taken = true;  // another group holds the name: this one gets a fresh one
    } catch (const std::exception&) {
      // Named but not registered: register it under its own name.
    }
    if (!taken) {
      c10d::register_process_group(current, group);
      return current;
    }
  }
  const std::string name = "fsdp_ema_group_" + std::to_string(next++);
  group->setGroupName(name);
  c10d::register_process_group(name, group);
  return name;
}

bool built_with_cuda() {
#if defined(FSDP_EMA_WITH_CUDA)
  return true;
#else
  return false;
#endif
}

}  // namespace fsdp_ema
