// include/fsdp_ema/checkpoint.h on top of format::CheckpointDir.
#include <ATen/ops/empty.h>
#include <ATen/ops/equal.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>
#include <torch/script.h>

#include <map>
#include <sstream>
#include <unordered_map>
#include <utility>
#include <vector>

#include "fsdp_ema/checkpoint.h"
#include "fsdp_ema/format/checkpoint_dir.h"
#include "fsdp_ema/format/error.h"
#include "fsdp_ema/format/rows.h"
#include "ops/common/format_bridge.h"
#include "ops/common/memory.h"
#include "ops/load/pipeline.h"

namespace fsdp_ema {
namespace {

constexpr const char* kWhere = "fsdp_ema::CheckpointReader: ";

template <typename F>
auto translate(F&& f) -> decltype(f()) {
  return ops::translate_errors(kWhere, std::forward<F>(f));
}

std::string join_names(const std::vector<std::string>& names, size_t limit = 20) {
  std::ostringstream os;
  for (size_t i = 0; i < names.size() && i < limit; ++i) os << (i ? ", " : "") << names[i];
  if (names.size() > limit) os << ", ... (" << names.size() << " in all)";
  return os.str();
}

// A module's destinations by name: a tensor registered under several names (tied weights) is
// one destination under its first name, its other names (tied) mapped to that one.
std::pair<std::map<std::string, at::Tensor>, std::map<std::string, std::string>> untie(
    const std::vector<std::pair<std::string, at::Tensor>>& named) {
  std::map<std::string, at::Tensor> all(named.begin(), named.end());  // the first of a name wins
  std::map<std::string, at::Tensor> targets;
  std::map<std::string, std::string> tied;
  std::unordered_map<const c10::TensorImpl*, const std::string*> first;
  for (const auto& [name, t] : all) {
    const auto [it, fresh] = first.emplace(t.unsafeGetTensorImpl(), &name);
    if (!t.defined() || fresh) {
      targets.emplace_hint(targets.end(), name, t);
    } else {
      tied.emplace_hint(tied.end(), name, *it->second);
    }
  }
  return {std::move(targets), std::move(tied)};
}

// Bit for bit the same values (0-dim and bool included; NaN equals itself).
bool same_bits(const at::Tensor& a, const at::Tensor& b) {
  auto bytes = [](const at::Tensor& t) { return t.contiguous().reshape({-1}).view(at::kByte); };
  return a.scalar_type() == b.scalar_type() && a.sizes() == b.sizes() &&
         at::equal(bytes(a), bytes(b));
}

}  // namespace

struct CheckpointReader::Impl {
  std::shared_ptr<const format::CheckpointDir> owner;
  const format::CheckpointDir& dir;
  bool mmap;
};

CheckpointReader::CheckpointReader(const std::string& directory, bool mmap)
    : impl_([&] {
        auto dir = ops::open_dir(kWhere, directory);
        const format::CheckpointDir& ref = *dir;
        return std::make_unique<Impl>(Impl{std::move(dir), ref, mmap});
      }()) {}

CheckpointReader::~CheckpointReader() = default;
CheckpointReader::CheckpointReader(CheckpointReader&&) noexcept = default;
CheckpointReader& CheckpointReader::operator=(CheckpointReader&&) noexcept = default;

const CheckpointReader::Impl& CheckpointReader::impl() const {
  TORCH_CHECK(impl_ != nullptr, kWhere,
              "this reader was moved from; use the CheckpointReader it was moved to");
  return *impl_;
}

const std::string& CheckpointReader::directory() const { return impl().dir.path(); }

std::string CheckpointReader::layout() const {
  return std::string(format::layout_name(impl().dir.layout()));
}

int64_t CheckpointReader::world_size() const { return impl().dir.world_size(); }

std::vector<CheckpointTensor> CheckpointReader::tensors() const {
  std::vector<CheckpointTensor> out;
  for (const auto& t : impl().dir.tensors()) {
    out.push_back({t.name, ops::to_scalar_type(t.dtype), {t.shape.begin(), t.shape.end()}});
  }
  return out;
}

bool CheckpointReader::contains(const std::string& name) const {
  return impl().dir.find(name) != nullptr;
}

at::Tensor CheckpointReader::load(const std::string& name, at::Device device, bool verify) const {
  return load_chunk(name, 0, 1, device, verify);
}

at::Tensor CheckpointReader::load_chunk(const std::string& name, int64_t rank, int64_t world_size,
                                        at::Device device, bool verify) const {
  ops::check_rank(kWhere, rank, world_size);
  const Impl& r = impl();
  // Read (and verified) again on every call: bytes from the file as it is now, never from an
  // earlier verdict. CUDA: through the two pinned staging buffers (ops/load/pipeline.h).
  return translate([&] {
    return ops::read_fresh(r.owner, ops::plan_rows(r.dir, {name}, rank, world_size), verify, device,
                           r.mmap)[0];
  });
}

std::map<std::string, at::Tensor> CheckpointReader::load_all(at::Device device, bool verify) const {
  const Impl& r = impl();
  std::vector<std::string> names;
  names.reserve(r.dir.tensors().size());
  for (const auto& t : r.dir.tensors()) names.push_back(t.name);
  // One batch: on the CPU read and hashed in one pass (or zero-copy views, hashed through the
  // mapping); to CUDA through the two pinned staging buffers, so the host never holds the
  // checkpoint; other devices one tensor at a time.
  const auto tensors = translate([&] {
    return ops::read_fresh(r.owner, ops::plan_rows(r.dir, names, 0, 1), verify, device, r.mmap);
  });
  std::map<std::string, at::Tensor> out;
  // tensors() is sorted by name: each insert goes at the end, in constant time.
  for (size_t i = 0; i < names.size(); ++i) out.emplace_hint(out.end(), names[i], tensors[i]);
  return out;
}

size_t CheckpointReader::verify_all() const {
  return translate([&] { return impl().dir.verify_all(); });
}

void CheckpointReader::load_into(torch::jit::Module& module, const LoadOptions& options) const {
  // Every destination (parameters, then buffers), by dotted name.
  std::vector<std::pair<std::string, at::Tensor>> named;
  for (const auto& p : module.named_parameters(/*recurse=*/true))
    named.emplace_back(p.name, p.value);
  for (const auto& b : module.named_buffers(/*recurse=*/true)) named.emplace_back(b.name, b.value);
  auto [targets, tied] = untie(named);
  write_into(targets, tied, options);
}

void CheckpointReader::load_into(torch::nn::Module& module, const LoadOptions& options) const {
  std::vector<std::pair<std::string, at::Tensor>> named;
  for (const auto& p : module.named_parameters(/*recurse=*/true))
    named.emplace_back(p.key(), p.value());
  for (const auto& b : module.named_buffers(/*recurse=*/true))
    named.emplace_back(b.key(), b.value());
  auto [targets, tied] = untie(named);
  write_into(targets, tied, options);
}

void CheckpointReader::load_into(const std::map<std::string, at::Tensor>& targets,
                                 const LoadOptions& options) const {
  write_into(targets, {}, options);
}

void CheckpointReader::write_into(const std::map<std::string, at::Tensor>& targets,
                                  const Tied& tied, const LoadOptions& options) const {
  // Every destination checked (the rules of every in-place op: ops/common/memory.h) and every
  // tensor read (and verified) before the first write, so a bad destination or a bad file leaves
  // the module as it was.
  const std::string op = std::string(kWhere) + "cannot load " + directory() + ": ";
  std::vector<at::Tensor> tensors;
  std::vector<const std::string*> names;
  for (const auto& [name, target] : targets) {
    tensors.push_back(target);
    names.push_back(&name);
  }
  const ops::Label label = [&](size_t i) { return "destination '" + *names[i] + "'"; };
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    TORCH_CHECK(t.defined(), op, label(i), " is an undefined tensor");
    ops::check_strided(op.c_str(), t, label, i);
    TORCH_CHECK(!t.is_meta(), op, label(i),
                " is a meta tensor, which has no memory to load into; pass a tensor on a device");
    ops::check_in_storage(op.c_str(), t, label, i, /*written=*/true);
    TORCH_CHECK(!t.is_inference() || c10::InferenceMode::is_enabled(), op, label(i),
                " is an inference tensor, which only an InferenceMode scope may write; load "
                "inside one (c10::InferenceMode guard;) or into a tensor made outside it");
  }
  // Sorted extents: n log n in the destinations, exact for interleaved views.
  ops::check_no_overlap(op.c_str(), tensors, label, {}, label,
                        "; no two destinations may share memory (a tensor under two names: "
                        "load it under one)");
  const auto values = read_for(targets, options, tied);
  const at::NoGradGuard no_grad;
  for (const auto& [name, value] : values) targets.at(name).copy_(value);
}

std::vector<std::pair<std::string, at::Tensor>> CheckpointReader::read_for(
    const std::map<std::string, at::Tensor>& targets, const LoadOptions& options,
    const Tied& tied) const {
  std::vector<std::string> missing, unexpected, misshaped;
  auto check_name = [&](const std::string& name, const at::Tensor& target) {
    TORCH_CHECK(target.defined(), kWhere, "cannot load ", directory(), ": destination '", name,
                "' is an undefined tensor");
    const format::IndexTensor* info = impl().dir.find(name);
    if (info == nullptr) {
      missing.push_back(name);
    } else if (!std::equal(info->shape.begin(), info->shape.end(), target.sizes().begin(),
                           target.sizes().end())) {
      std::ostringstream os;
      os << name << " (checkpoint " << c10::IntArrayRef(info->shape) << ", module "
         << target.sizes() << ")";
      misshaped.push_back(os.str());
    }
  };
  for (const auto& [name, target] : targets) check_name(name, target);
  for (const auto& [alias, name] : tied) check_name(alias, targets.at(name));
  for (const auto& t : impl().dir.tensors()) {
    if (targets.count(t.name) == 0 && tied.count(t.name) == 0) unexpected.push_back(t.name);
  }
  std::ostringstream problems;
  if (!misshaped.empty()) problems << " shape mismatch: " << join_names(misshaped) << ";";
  if (options.strict && !missing.empty())
    problems << " missing in checkpoint: " << join_names(missing) << ";";
  if (options.strict && !unexpected.empty())
    problems << " unexpected in checkpoint: " << join_names(unexpected) << ";";
  TORCH_CHECK(problems.str().empty(), kWhere, "cannot load ", directory(),
              " into the module:", problems.str());

  // Owned reads even on a zero-copy reader: a view of the mapping would be read again by the
  // copy into the destination, after its verification (another process's write in between would
  // reach the module unverified). Each value is hashed in the pass that read it.
  const Impl& r = impl();
  auto read = [&](const std::string& name, const at::Tensor& target) {
    at::Tensor value = translate([&] {
      return ops::read_fresh(r.owner, ops::plan_rows(r.dir, {name}, 0, 1), options.verify,
                             target.device(), /*mmap=*/false)[0];
    });
    return value.to(target.dtype());
  };
  std::map<std::string, at::Tensor> values;
  for (const auto& [name, target] : targets) {
    if (r.dir.find(name) != nullptr) values.emplace(name, read(name, target));
  }
  for (const auto& [alias, name] : tied) {
    if (r.dir.find(alias) == nullptr) continue;
    const at::Tensor value = read(alias, targets.at(name));
    const auto [it, first] = values.emplace(name, value);
    TORCH_CHECK(first || same_bits(it->second, value), kWhere, "cannot load ", directory(), ": '",
                alias, "' is the same tensor as '", name,
                "' (tied) but the checkpoint holds other values under the two names");
  }
  return {values.begin(), values.end()};
}

}  // namespace fsdp_ema
