// include/fsdp_ema/checkpoint.h on top of format::CheckpointDir.
#include <ATen/MemoryOverlap.h>
#include <ATen/ops/empty.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>
#include <torch/script.h>

#include <map>
#include <sstream>

#include "fsdp_ema/checkpoint.h"
#include "fsdp_ema/format/checkpoint_dir.h"
#include "fsdp_ema/format/error.h"
#include "fsdp_ema/format/rows.h"
#include "ops/common/format_bridge.h"
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

}  // namespace

struct CheckpointReader::Impl {
  std::shared_ptr<const format::CheckpointDir> owner;  // also kept by zero-copy tensors
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
  // Every destination checked and every tensor read (and verified) before the first write, so a
  // bad destination or a bad file leaves the module as it was.
  const auto values = read_for(targets, options);
  const at::NoGradGuard no_grad;
  for (const auto& [name, value] : values) targets.at(name).copy_(value);
}

std::vector<std::pair<std::string, at::Tensor>> CheckpointReader::read_for(
    const std::map<std::string, at::Tensor>& targets, const LoadOptions& options) const {
  std::vector<std::string> missing, unexpected, misshaped;
  for (const auto& [name, target] : targets) {
    // What copy_ would refuse only once earlier destinations were written.
    TORCH_CHECK(target.defined(), kWhere, "cannot load ", directory(), ": destination '", name,
                "' is an undefined tensor");
    TORCH_CHECK(target.layout() == at::kStrided, kWhere, "cannot load ", directory(),
                ": destination '", name, "' is a ", target.layout(), " tensor; it must be dense");
    TORCH_CHECK(at::has_internal_overlap(target) != at::MemOverlap::Yes, kWhere, "cannot load ",
                directory(), ": destination '", name,
                "' has elements that share memory (an "
                "expanded tensor); load into a tensor of its own");
    TORCH_CHECK(!target.is_inference() || c10::InferenceMode::is_enabled(), kWhere, "cannot load ",
                directory(), ": destination '", name,
                "' is an inference tensor, which only an InferenceMode scope may write; load "
                "inside one (c10::InferenceMode guard;) or into a tensor made outside it");
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
  }
  for (const auto& t : impl().dir.tensors()) {
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

  // Owned reads even on a zero-copy reader: a view of the mapping would be read again by the
  // copy into the destination, after its verification (another process's write in between would
  // reach the module unverified). Each value is hashed in the pass that read it.
  const Impl& r = impl();
  std::vector<std::pair<std::string, at::Tensor>> values;
  for (const auto& [name, target] : targets) {
    if (r.dir.find(name) == nullptr) continue;
    at::Tensor value = translate([&] {
      return ops::read_fresh(r.owner, ops::plan_rows(r.dir, {name}, 0, 1), options.verify,
                             target.device(), /*mmap=*/false)[0];
    });
    values.emplace_back(name, value.to(target.dtype()));
  }
  return values;
}

}  // namespace fsdp_ema
