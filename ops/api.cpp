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

bool built_with_cuda() {
#if defined(FSDP_EMA_WITH_CUDA)
  return true;
#else
  return false;
#endif
}

}  // namespace fsdp_ema
