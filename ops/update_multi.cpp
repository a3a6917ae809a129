#include "ops/update_multi.h"

#include <c10/util/Exception.h>
#include <c10/util/irange.h>

#include <string>
#include <vector>

#include "kernels/update_cpu.h"
#include "ops/format_bridge.h"
#include "ops/memory.h"
#include "ops/update.h"

namespace fsdp_ema::ops {
namespace {

constexpr const char* kOp = "fsdp_ema::update_multi_: ";

void run_cpu(at::TensorList ema, at::TensorList model, const std::vector<double>& decays) {
  TORCH_CHECK(ema[0].device().is_cpu(), kOp, "the CPU kernel got tensors on ", ema[0].device());
  PreparedUpdate p = prepare_update_multi(ema, model);
  const int64_t n = static_cast<int64_t>(p.model.size());
  std::vector<kernels::UpdatePair> pairs;
  pairs.reserve(p.ema.size());
  for (const auto j : c10::irange(p.ema.size())) {
    const at::Tensor& m = p.model[j % n];
    pairs.push_back({p.ema[j].data_ptr(), m.const_data_ptr(), m.numel(),
                     to_format_dtype(p.ema[j].scalar_type(), "ema"),
                     to_format_dtype(m.scalar_type(), "model")});
  }
  if (n > 0) {
    kernels::update_multi_cpu(pairs.data(), n, static_cast<int64_t>(decays.size()), decays.data());
  }
  p.finish();
}

}  // namespace

void update_multi_cpu(at::TensorList ema, at::TensorList model, c10::ArrayRef<double> decays) {
  validate_update_multi(ema, model, decays, {}, UpdateChecks::kAll);
  bump_versions(ema);
  run_cpu(ema, model, decays.vec());
}

void update_multi_tensor_cpu(at::TensorList ema, at::TensorList model, at::TensorList decays) {
  validate_update_multi(ema, model, {}, decays, UpdateChecks::kAll);
  std::vector<double> values;
  values.reserve(decays.size());
  for (const auto k : c10::irange(decays.size())) {
    values.push_back(cpu_decay_value(decays[k], kOp, "decays[" + std::to_string(k) + "]"));
  }
  bump_versions(ema);
  run_cpu(ema, model, values);
}

void update_multi_meta(at::TensorList ema, at::TensorList model, c10::ArrayRef<double> decays) {
  validate_update_multi(ema, model, decays, {}, UpdateChecks::kNoStorage);
}

void update_multi_tensor_meta(at::TensorList ema, at::TensorList model, at::TensorList decays) {
  validate_update_multi(ema, model, {}, decays, UpdateChecks::kNoStorage);
}

}  // namespace fsdp_ema::ops
