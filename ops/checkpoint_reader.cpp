// include/fsdp_ema/checkpoint.h on top of format::CheckpointDir.
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>
#include <torch/script.h>

#include <map>
#include <sstream>

#include "fsdp_ema/checkpoint.h"
#include "fsdp_ema/format/checkpoint_dir.h"
#include "fsdp_ema/format/error.h"
#include "fsdp_ema/format/rows.h"
#include "ops/format_bridge.h"
#include "ops/load_tensors.h"
#include "ops/reads.h"

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

}  // namespace

struct CheckpointReader::Impl {
  std::shared_ptr<const format::CheckpointDir> owner;  // also kept by zero-copy tensors
  const format::CheckpointDir& dir;
  bool mmap;
};

CheckpointReader::CheckpointReader(const std::string& directory, bool mmap)
    : impl_(translate([&] {
        auto dir =
            std::make_shared<const format::CheckpointDir>(format::CheckpointDir::open(directory));
        const format::CheckpointDir& ref = *dir;
        return std::make_unique<Impl>(Impl{std::move(dir), ref, mmap});
      })) {}

CheckpointReader::~CheckpointReader() = default;
CheckpointReader::CheckpointReader(CheckpointReader&&) noexcept = default;
CheckpointReader& CheckpointReader::operator=(CheckpointReader&&) noexcept = default;

const std::string& CheckpointReader::directory() const { return impl_->dir.path(); }

std::string CheckpointReader::layout() const {
  return std::string(format::layout_name(impl_->dir.layout()));
}

int64_t CheckpointReader::world_size() const { return impl_->dir.world_size(); }

std::vector<CheckpointTensor> CheckpointReader::tensors() const {
  std::vector<CheckpointTensor> out;
  for (const auto& t : impl_->dir.tensors()) {
    out.push_back({t.name, ops::to_scalar_type(t.dtype), {t.shape.begin(), t.shape.end()}});
  }
  return out;
}

bool CheckpointReader::contains(const std::string& name) const {
  return impl_->dir.find(name) != nullptr;
}

at::Tensor CheckpointReader::load(const std::string& name, at::Device device, bool verify) const {
  return load_chunk(name, 0, 1, device, verify);
}

at::Tensor CheckpointReader::load_chunk(const std::string& name, int64_t rank, int64_t world_size,
                                        at::Device device, bool verify) const {
  ops::check_rank(kWhere, rank, world_size);
  // CUDA: through the two pinned staging buffers (ops/staged_reads.h).
  return translate([&] {
    return ops::load_tensors_from(impl_->owner, {name}, rank, world_size, verify, device,
                                  impl_->mmap)[0];
  });
}

std::map<std::string, at::Tensor> CheckpointReader::load_all(at::Device device, bool verify) const {
  std::map<std::string, at::Tensor> out;
  if (!device.is_cpu() && !device.is_cuda()) {
    // One tensor at a time: the host copy of the whole checkpoint is never held at once.
    for (const auto& t : impl_->dir.tensors()) {
      out.emplace_hint(out.end(), t.name, load(t.name, device, verify));
    }
    return out;
  }
  ops::RowsPlan plan;
  for (const auto& t : impl_->dir.tensors()) {
    plan.emplace_back(&t, format::tensor_rows(t.shape, 0, 1));
  }
  // One batch: on the CPU read and hashed in one pass (or zero-copy views, hashed first); to CUDA
  // through the two pinned staging buffers, so the host never holds the checkpoint.
  const auto tensors =
      translate([&] { return ops::load_plan(impl_->owner, plan, verify, device, impl_->mmap); });
  // tensors() is sorted by name: each insert goes at the end, in constant time.
  for (size_t i = 0; i < plan.size(); ++i)
    out.emplace_hint(out.end(), plan[i].first->name, tensors[i]);
  return out;
}

size_t CheckpointReader::verify_all() const {
  return translate([&] { return impl_->dir.verify_all(); });
}

void CheckpointReader::load_into(torch::jit::Module& module, const LoadOptions& options) const {
  // Every destination (parameters, then buffers), by dotted name.
  std::map<std::string, at::Tensor> targets;
  for (const auto& p : module.named_parameters(/*recurse=*/true)) targets.emplace(p.name, p.value);
  for (const auto& b : module.named_buffers(/*recurse=*/true)) targets.emplace(b.name, b.value);
  load_into(targets, options);
}

void CheckpointReader::load_into(torch::nn::Module& module, const LoadOptions& options) const {
  std::map<std::string, at::Tensor> targets;
  for (const auto& p : module.named_parameters(/*recurse=*/true))
    targets.emplace(p.key(), p.value());
  for (const auto& b : module.named_buffers(/*recurse=*/true)) targets.emplace(b.key(), b.value());
  load_into(targets, options);
}

void CheckpointReader::load_into(const std::map<std::string, at::Tensor>& targets,
                                 const LoadOptions& options) const {
  // Read (and verify) everything before the first write, so a bad file leaves the module as it was.
  const auto values = read_for(targets, options);
  const at::NoGradGuard no_grad;
  for (const auto& [name, value] : values) targets.at(name).copy_(value);
}

std::vector<std::pair<std::string, at::Tensor>> CheckpointReader::read_for(
    const std::map<std::string, at::Tensor>& targets, const LoadOptions& options) const {
  std::vector<std::string> missing, unexpected, misshaped;
  for (const auto& [name, target] : targets) {
    const format::IndexTensor* info = impl_->dir.find(name);
    if (info == nullptr) {
      missing.push_back(name);
    } else if (!std::equal(info->shape.begin(), info->shape.end(), target.sizes().begin(),
                           target.sizes().end())) {
      std::ostringstream os;
      os << name << " (checkpoint " << c10::IntArrayRef(info->shape) << ", module "
         << target.sizes() << ")";
      misshaped.push_back(os.str());
    }
  }
  for (const auto& t : impl_->dir.tensors()) {
    if (targets.count(t.name) == 0) unexpected.push_back(t.name);
  }
  std::ostringstream problems;
  if (!misshaped.empty()) problems << " shape mismatch: " << join_names(misshaped) << ";";
  if (options.strict && !missing.empty())
    problems << " missing in checkpoint: " << join_names(missing) << ";";
  if (options.strict && !unexpected.empty())
    problems << " unexpected in checkpoint: " << join_names(unexpected) << ";";
  TORCH_CHECK(problems.str().empty(), kWhere, "cannot load ", directory(),
              " into the module:", problems.str());

  std::vector<std::pair<std::string, at::Tensor>> values;
  for (const auto& [name, target] : targets) {
    if (impl_->dir.find(name) == nullptr) continue;
    values.emplace_back(name, load(name, target.device(), options.verify).to(target.dtype()));
  }
  return values;
}

}  // namespace fsdp_ema
