// include/fsdp_ema/ops.h: typed wrappers that go through the dispatcher.
#include "fsdp_ema/ops.h"

#include <ATen/core/dispatch/Dispatcher.h>

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
                   c10::ArrayRef<int64_t> offsets, c10::ArrayRef<int64_t> global_shapes,
                   bool fsync, bool overwrite) {
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

bool built_with_cuda() {
#if defined(FSDP_EMA_WITH_CUDA)
  return true;
#else
  return false;
#endif
}

}  // namespace fsdp_ema
