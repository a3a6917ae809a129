#include "ops/update.h"

#include <ATen/MemoryOverlap.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>
#include <c10/util/irange.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/update_cpu.h"
#include "ops/dtypes.h"

namespace fsdp_ema::ops {
namespace {

constexpr const char* kOp = "fsdp_ema::update_: ";
constexpr const char* kMultiOp = "fsdp_ema::update_multi_: ";

// Byte range [lo, hi) a tensor's elements can touch.
struct Extent {
  uintptr_t lo;
  uintptr_t hi;
  bool is_ema;
  int64_t index;
};

Extent extent_of(const at::Tensor& t, bool is_ema, int64_t index) {
  int64_t last = 0;  // offset of the farthest element, in elements
  for (const auto d : c10::irange(t.dim())) {
    if (t.size(d) > 1) last += (t.size(d) - 1) * std::abs(t.stride(d));
  }
  const auto lo = reinterpret_cast<uintptr_t>(t.data_ptr());
  return {lo, lo + static_cast<uintptr_t>((last + 1) * t.element_size()), is_ema, index};
}

std::string describe(const Extent& e) {
  return std::string(e.is_ema ? "ema[" : "model[") + std::to_string(e.index) + "]";
}

// Calls f(address) for the first byte of every element of t.
template <typename F>
void for_each_element(const at::Tensor& t, F&& f) {
  const int64_t dims = t.dim();
  const auto base = reinterpret_cast<uintptr_t>(t.data_ptr());
  const auto size = static_cast<uintptr_t>(t.element_size());
  std::vector<int64_t> index(dims, 0);
  for (int64_t n = 0; n < t.numel(); ++n) {
    int64_t offset = 0;
    for (int64_t d = 0; d < dims; ++d) offset += index[d] * t.stride(d);
    f(base + static_cast<uintptr_t>(offset) * size);
    for (int64_t d = dims - 1; d >= 0; --d) {
      if (++index[d] < t.size(d)) break;
      index[d] = 0;
    }
  }
}

// Whether two tensors whose byte extents intersect share a byte. ATen answers for dense tensors;
// strided views (say, every other column of one matrix) are checked element by element over their
// common extent, and counted as overlapping when that extent is too large to map.
bool really_overlap(const at::Tensor& a, const at::Tensor& b, const Extent& ea, const Extent& eb) {
  const auto status = at::get_overlap_status(a, b);
  if (status != at::MemOverlapStatus::TooHard) return status != at::MemOverlapStatus::No;
  const uintptr_t lo = std::max(ea.lo, eb.lo);
  const uintptr_t hi = std::min(ea.hi, eb.hi);
  constexpr uintptr_t kMaxMappedBytes = uintptr_t{1} << 28;
  if (hi - lo > kMaxMappedBytes) return true;
  std::vector<bool> used(hi - lo, false);
  const auto size = static_cast<uintptr_t>(a.element_size());
  for_each_element(a, [&](uintptr_t p) {
    for (uintptr_t k = 0; k < size; ++k) {
      if (p + k >= lo && p + k < hi) used[p + k - lo] = true;
    }
  });
  bool hit = false;
  const auto size_b = static_cast<uintptr_t>(b.element_size());
  for_each_element(b, [&](uintptr_t p) {
    for (uintptr_t k = 0; k < size_b && !hit; ++k) {
      hit = p + k >= lo && p + k < hi && used[p + k - lo];
    }
  });
  return hit;
}

[[noreturn]] void fail_overlap(const char* op, const Extent& a, const Extent& b) {
  const Extent& ema = a.is_ema ? a : b;
  const Extent& other = a.is_ema ? b : a;
  TORCH_CHECK(false, op, describe(ema), " overlaps ", describe(other),
              " in memory; every EMA tensor needs storage of its own");
}

// An EMA tensor may share memory with nothing else in the call; model tensors may share with
// each other. Contiguous tensors: one sort and sweep. Strided ones: exact pairwise checks.
// `ema` may hold several lists of model.size() tensors (update_multi_): each is checked once.
void check_no_overlap(const char* op, TensorList ema, TensorList model) {
  std::vector<Extent> dense;
  std::vector<Extent> strided;
  auto add = [&](const at::Tensor& t, bool is_ema, int64_t i) {
    if (t.numel() == 0) return;
    (t.is_contiguous() ? dense : strided).push_back(extent_of(t, is_ema, i));
  };
  for (const auto i : c10::irange(ema.size())) add(ema[i], true, i);
  for (const auto i : c10::irange(model.size())) add(model[i], false, i);
  std::sort(dense.begin(), dense.end(),
            [](const Extent& a, const Extent& b) { return a.lo < b.lo; });
  // Farthest end so far among all ranges and among EMA ranges: any overlap involving an EMA range
  // shows up against one of the two when the later-starting range is visited.
  const Extent* far_all = nullptr;
  const Extent* far_ema = nullptr;
  for (const Extent& e : dense) {
    if (e.is_ema && far_all != nullptr && e.lo < far_all->hi) fail_overlap(op, e, *far_all);
    if (far_ema != nullptr && e.lo < far_ema->hi) fail_overlap(op, e, *far_ema);
    if (far_all == nullptr || e.hi > far_all->hi) far_all = &e;
    if (e.is_ema && (far_ema == nullptr || e.hi > far_ema->hi)) far_ema = &e;
  }
  auto tensor_of = [&](const Extent& e) -> const at::Tensor& {
    return e.is_ema ? ema[e.index] : model[e.index];
  };
  for (const Extent& s : strided) {
    for (const auto* group : {&dense, &strided}) {
      for (const Extent& o : *group) {
        if (&o == &s || (!s.is_ema && !o.is_ema)) continue;
        if (s.lo < o.hi && o.lo < s.hi && really_overlap(tensor_of(s), tensor_of(o), s, o)) {
          fail_overlap(op, s, o);
        }
      }
    }
  }
}

void check_float_dtype(const char* op, const at::Tensor& t, const char* name, size_t i) {
  TORCH_CHECK(is_supported_dtype(t.scalar_type()), op, name, "[", i, "] has dtype ",
              t.scalar_type(), "; expected Float, Double, BFloat16 or Half");
}

}  // namespace

void validate_pairs(const char* op, TensorList ema, TensorList model, UpdateChecks checks) {
  TORCH_CHECK(!model.empty(), op, "model is empty; pass at least one (ema, model) pair");
  TORCH_CHECK(ema.size() % model.size() == 0, op, "ema has ", ema.size(), " tensors but model has ",
              model.size(), "; pass one model tensor per EMA tensor");
  const c10::Device device = ema[0].device();
  // ema[j] pairs with model[j % N]: one list per profile, profile-major (update_multi_).
  for (const auto j : c10::irange(ema.size())) {
    const size_t i = j % model.size();
    const at::Tensor& e = ema[j];
    const at::Tensor& m = model[i];
    TORCH_CHECK(e.defined(), op, "ema[", j, "] is an undefined tensor");
    TORCH_CHECK(m.defined(), op, "model[", i, "] is an undefined tensor");
    check_float_dtype(op, e, "ema", j);
    check_float_dtype(op, m, "model", i);
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
      TORCH_CHECK(at::has_internal_overlap(e) != at::MemOverlap::Yes, op, "ema[", j,
                  "] has internally overlapping memory (an expanded tensor?) and cannot be "
                  "updated in place");
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
  if (checks == UpdateChecks::kAll) check_no_overlap(kOp, ema, model);
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
  if (checks == UpdateChecks::kAll) check_no_overlap(kMultiOp, ema, model);
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
                     to_kernel_dtype(p.ema[i].scalar_type()),
                     to_kernel_dtype(p.model[i].scalar_type())});
  }
  kernels::update_cpu(pairs.data(), static_cast<int64_t>(pairs.size()), decay);
  p.finish();
}

}  // namespace

void update_cpu(TensorList ema, TensorList model, double decay) {
  validate_update(ema, model, decay, nullptr, UpdateChecks::kAll);
  run_cpu(ema, model, decay);
}

void update_tensor_cpu(TensorList ema, TensorList model, const at::Tensor& decay) {
  validate_update(ema, model, std::nullopt, &decay, UpdateChecks::kAll);
  run_cpu(ema, model, cpu_decay_value(decay, kOp, "decay"));
}

void update_meta(TensorList ema, TensorList model, double decay) {
  validate_update(ema, model, decay, nullptr, UpdateChecks::kNoStorage);
}

void update_tensor_meta(TensorList ema, TensorList model, const at::Tensor& decay) {
  validate_update(ema, model, std::nullopt, &decay, UpdateChecks::kNoStorage);
}

}  // namespace fsdp_ema::ops
