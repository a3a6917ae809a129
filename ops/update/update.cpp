#include "ops/update/update.h"

#include <ATen/MemoryOverlap.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>
#include <c10/util/irange.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "fsdp_ema/ops.h"
#include "kernels/update_cpu.h"
#include "ops/common/dispatch.h"
#include "ops/common/format_bridge.h"
#include "ops/common/memory.h"

namespace fsdp_ema::ops {
namespace {

constexpr const char* kOp = "fsdp_ema::update_: ";
constexpr const char* kMultiOp = "fsdp_ema::update_multi_: ";

std::string ema_label(size_t i) { return "ema[" + std::to_string(i) + "]"; }
std::string model_label(size_t i) { return "model[" + std::to_string(i) + "]"; }

// An EMA tensor may share memory with nothing else in the call; model tensors may share with
// each other. `ema` may hold several lists of model.size() tensors (update_multi_).
void check_no_shared_memory(const char* op, TensorList ema, TensorList model) {
  check_no_overlap(op, ema, ema_label, model, model_label,
                   "; every EMA tensor needs storage of its own");
}

// An EMA or model dtype of the update kernels (fsdp_ema/format/dtype_table.h).
void check_float_dtype(const char* op, const at::Tensor& t, const char* name, size_t i,
                       format::DTypeRole role) {
  TORCH_CHECK(has_role(t.scalar_type(), role), op, name, "[", i, "] has dtype ", t.scalar_type(),
              "; expected ", torch_dtypes_with_role(role));
}

}  // namespace

void validate_pairs(const char* op, TensorList ema, TensorList model, UpdateChecks checks) {
  TORCH_CHECK(!model.empty(), op, "model is empty; pass at least one (ema, model) pair");
  TORCH_CHECK(ema.size() % model.size() == 0, op, "ema has ", ema.size(), " tensors but model has ",
              model.size(), "; pass one model tensor per EMA tensor");
  TORCH_CHECK(ema[0].defined(), op, "ema[0] is an undefined tensor");
  const c10::Device device = ema[0].device();
  // ema[j] pairs with model[j % N]: one list per profile, profile-major (update_multi_).
  for (const auto j : c10::irange(ema.size())) {
    const size_t i = j % model.size();
    const at::Tensor& e = ema[j];
    const at::Tensor& m = model[i];
    TORCH_CHECK(e.defined(), op, "ema[", j, "] is an undefined tensor");
    TORCH_CHECK(m.defined(), op, "model[", i, "] is an undefined tensor");
    check_strided(op, e, ema_label, j);
    check_strided(op, m, model_label, i);
    check_float_dtype(op, e, "ema", j, format::kRoleEma);
    check_float_dtype(op, m, "model", i, format::kRoleModel);
    TORCH_CHECK(m.device() == e.device(), op, "model[", i, "] is on ", m.device(), " but ema[", j,
                "] is on ", e.device());
    TORCH_CHECK(e.device() == device, op, "ema[", j, "] is on ", e.device(), " but ema[0] is on ",
                device, "; all tensors of one call must be on one device");
    // sym_*: the meta kernel sees symbolic shapes under torch.compile's dynamic tracing.
    TORCH_CHECK(e.sym_numel() == m.sym_numel(), op, "ema[", j, "] has ", e.sym_numel(),
                " elements but model[", i, "] has ", m.sym_numel());
    TORCH_CHECK(e.sym_sizes() == m.sym_sizes(), op, "ema[", j, "] has shape ", e.sym_sizes(),
                " but model[", i, "] has shape ", m.sym_sizes());
    if (checks == UpdateChecks::kAll) {
      check_in_storage(op, e, ema_label, j, /*written=*/true);
      check_in_storage(op, m, model_label, i, /*written=*/false);
    }
  }
}

void validate_decay(const char* op, const std::string& name, double decay) {
  TORCH_CHECK(decay >= 0.0 && decay <= 1.0, op, name, " must be in [0, 1], got ", decay);
}

void validate_decay_tensor(const char* op, const std::string& name, const at::Tensor& d,
                           c10::Device device, UpdateChecks checks) {
  TORCH_CHECK(d.defined(), op, name, " is an undefined tensor");
  TORCH_CHECK(d.dim() == 0, op, name, " must be a 0-dim tensor, got shape ", d.sym_sizes());
  TORCH_CHECK(at::isFloatingType(d.scalar_type()), op, name,
              " must be a floating-point tensor, got dtype ", d.scalar_type());
  if (checks == UpdateChecks::kAll) {
    TORCH_CHECK(d.device().is_cpu() || d.device() == device, op, name, " is on ", d.device(),
                " but the tensors are on ", device, "; put ", name, " on the CPU or on ", device);
  }
}

void validate_update(TensorList ema, TensorList model, std::optional<double> decay,
                     const at::Tensor* decay_tensor, UpdateChecks checks) {
  TORCH_CHECK(ema.size() == model.size(), kOp, "ema has ", ema.size(), " tensors but model has ",
              model.size(), "; pass one model tensor per EMA tensor");
  TORCH_CHECK(!ema.empty(), kOp, "ema is empty; pass at least one (ema, model) pair");
  validate_pairs(kOp, ema, model, checks);
  if (decay.has_value()) validate_decay(kOp, "decay", *decay);
  if (decay_tensor != nullptr) {
    validate_decay_tensor(kOp, "decay", *decay_tensor, ema[0].device(), checks);
  }
  if (checks == UpdateChecks::kAll) check_no_shared_memory(kOp, ema, model);
}

void validate_update_multi(TensorList ema, TensorList model, c10::ArrayRef<double> decays,
                           TensorList decay_tensors, UpdateChecks checks) {
  const size_t k = decays.size() + decay_tensors.size();
  TORCH_CHECK(k > 0, kMultiOp, "decays is empty; pass one decay per EMA list");
  TORCH_CHECK(!model.empty(), kMultiOp, "model is empty; pass at least one model tensor");
  TORCH_CHECK(ema.size() == k * model.size(), kMultiOp, "ema has ", ema.size(),
              " tensors but model has ", model.size(), " and decays has ", k, "; pass ", k,
              " lists of ", model.size(), " EMA tensors (ema[k * ", model.size(),
              " + i] pairs with model[i] and decays[k])");
  validate_pairs(kMultiOp, ema, model, checks);
  for (const auto i : c10::irange(decays.size())) {
    validate_decay(kMultiOp, "decays[" + std::to_string(i) + "]", decays[i]);
  }
  for (const auto i : c10::irange(decay_tensors.size())) {
    validate_decay_tensor(kMultiOp, "decays[" + std::to_string(i) + "]", decay_tensors[i],
                          ema[0].device(), checks);
  }
  if (checks == UpdateChecks::kAll) check_no_shared_memory(kMultiOp, ema, model);
}

double cpu_decay_value(const at::Tensor& decay, const char* op, const std::string& name) {
  const double value = decay.item<double>();
  validate_decay(op, name, value);
  return value;
}

void PreparedUpdate::finish() {
  for (auto& [original, updated] : write_back) original.copy_(updated);
}

PreparedUpdate prepare_update(TensorList ema, TensorList model) {
  PreparedUpdate p;
  p.ema.reserve(ema.size());
  p.model.reserve(model.size());
  for (const auto i : c10::irange(ema.size())) {
    if (ema[i].numel() == 0) continue;
    if (ema[i].is_contiguous()) {
      p.ema.push_back(ema[i]);
    } else {
      p.ema.push_back(ema[i].contiguous());
      p.write_back.emplace_back(ema[i], p.ema.back());
    }
    p.model.push_back(model[i].contiguous());
  }
  return p;
}

PreparedUpdate prepare_update_multi(TensorList ema, TensorList model) {
  const size_t n = model.size();
  const size_t k = ema.size() / n;
  PreparedUpdate p;
  std::vector<size_t> kept;
  for (const auto i : c10::irange(n)) {
    if (model[i].numel() == 0) continue;
    kept.push_back(i);
    p.model.push_back(model[i].contiguous());
  }
  p.ema.reserve(k * kept.size());
  for (const auto profile : c10::irange(k)) {
    for (const size_t i : kept) {
      const at::Tensor& e = ema[profile * n + i];
      if (e.is_contiguous()) {
        p.ema.push_back(e);
      } else {
        p.ema.push_back(e.contiguous());
        p.write_back.emplace_back(e, p.ema.back());
      }
    }
  }
  return p;
}

namespace {

// Runs a validated call on the CPU.
void run_cpu(TensorList ema, TensorList model, double decay) {
  TORCH_CHECK(ema[0].device().is_cpu(), kOp, "the CPU kernel got tensors on ", ema[0].device());
  PreparedUpdate p = prepare_update(ema, model);
  std::vector<kernels::UpdatePair> pairs;
  pairs.reserve(p.ema.size());
  for (const auto i : c10::irange(p.ema.size())) {
    pairs.push_back({p.ema[i].data_ptr(), p.model[i].const_data_ptr(), p.ema[i].numel(),
                     to_format_dtype(p.ema[i].scalar_type(), "ema"),
                     to_format_dtype(p.model[i].scalar_type(), "model")});
  }
  kernels::update_cpu(pairs.data(), static_cast<int64_t>(pairs.size()), decay);
  p.finish();
}

}  // namespace

void update_cpu(TensorList ema, TensorList model, double decay) {
  validate_update(ema, model, decay, nullptr, UpdateChecks::kAll);
  bump_versions(ema);
  run_cpu(ema, model, decay);
}

void update_tensor_cpu(TensorList ema, TensorList model, const at::Tensor& decay) {
  validate_update(ema, model, std::nullopt, &decay, UpdateChecks::kAll);
  const double value = cpu_decay_value(decay, kOp, "decay");
  bump_versions(ema);
  run_cpu(ema, model, value);
}

void update_meta(TensorList ema, TensorList model, double decay) {
  validate_update(ema, model, decay, nullptr, UpdateChecks::kNoStorage);
}

void update_tensor_meta(TensorList ema, TensorList model, const at::Tensor& decay) {
  validate_update(ema, model, std::nullopt, &decay, UpdateChecks::kNoStorage);
}

// --- update_multi_ ---------------------------------------------------------------------------
namespace {

// Runs a validated update_multi_ call on the CPU.
void run_multi_cpu(at::TensorList ema, at::TensorList model, const std::vector<double>& decays) {
  TORCH_CHECK(ema[0].device().is_cpu(), kMultiOp, "the CPU kernel got tensors on ",
              ema[0].device());
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
  run_multi_cpu(ema, model, decays.vec());
}

void update_multi_tensor_cpu(at::TensorList ema, at::TensorList model, at::TensorList decays) {
  validate_update_multi(ema, model, {}, decays, UpdateChecks::kAll);
  std::vector<double> values;
  values.reserve(decays.size());
  for (const auto k : c10::irange(decays.size())) {
    values.push_back(cpu_decay_value(decays[k], kMultiOp, "decays[" + std::to_string(k) + "]"));
  }
  bump_versions(ema);
  run_multi_cpu(ema, model, values);
}

void update_multi_meta(at::TensorList ema, at::TensorList model, c10::ArrayRef<double> decays) {
  validate_update_multi(ema, model, decays, {}, UpdateChecks::kNoStorage);
}

void update_multi_tensor_meta(at::TensorList ema, at::TensorList model, at::TensorList decays) {
  validate_update_multi(ema, model, {}, decays, UpdateChecks::kNoStorage);
}

void update_no_kernel(at::TensorList ema, at::TensorList model, double decay) {
  update_meta(ema, model, decay);
  TORCH_CHECK(false, kOp, "no kernel for tensors on ", ema[0].device());
}

void update_multi_no_kernel(at::TensorList ema, at::TensorList model,
                            c10::ArrayRef<double> decays) {
  update_multi_meta(ema, model, decays);
  TORCH_CHECK(false, kMultiOp, "no kernel for tensors on ", ema[0].device());
}

}  // namespace fsdp_ema::ops

// --- the public C++ API (include/fsdp_ema/ops.h): through the dispatcher ------------------------
namespace fsdp_ema {
namespace {

template <typename Decay>
using UpdateSignature = void(ops::TensorList, ops::TensorList, Decay);

}  // namespace

void update_(ops::TensorList ema, ops::TensorList model, double decay) {
  static const auto op = ops::typed_op<UpdateSignature<double>>("fsdp_ema::update_");
  op.call(ema, model, decay);
}

void update_(ops::TensorList ema, ops::TensorList model, const at::Tensor& decay) {
  static const auto op =
      ops::typed_op<UpdateSignature<const at::Tensor&>>("fsdp_ema::update_", "Tensor");
  op.call(ema, model, decay);
}

// The seed recipe's name: the same schemas and kernels (registration.cpp's def_update), so the
// same call.
void ema_shard_update_(ops::TensorList ema, ops::TensorList model, double decay) {
  update_(ema, model, decay);
}

void ema_shard_update_(ops::TensorList ema, ops::TensorList model, const at::Tensor& decay) {
  update_(ema, model, decay);
}

void update_multi_(ops::TensorList ema, ops::TensorList model, c10::ArrayRef<double> decays) {
  static const auto op =
      ops::typed_op<UpdateSignature<c10::ArrayRef<double>>>("fsdp_ema::update_multi_");
  op.call(ema, model, decays);
}

void update_multi_(ops::TensorList ema, ops::TensorList model, ops::TensorList decays) {
  static const auto op =
      ops::typed_op<UpdateSignature<ops::TensorList>>("fsdp_ema::update_multi_", "Tensor");
  op.call(ema, model, decays);
}

}  // namespace fsdp_ema
