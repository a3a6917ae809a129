// CheckpointReader::load_into for AOTInductor packages, through the package loader's
// constant-update API (kept apart: only this file needs the AOTInductor runtime headers).
#include <c10/util/Exception.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>

#include <map>
#include <string>
#include <unordered_map>
#include <vector>

#include "fsdp_ema/checkpoint.h"

namespace fsdp_ema {
namespace {

// Constants the compiler derived from others (runtime constant folding recomputes them).
bool is_folded(const std::string& fqn) { return fqn.rfind("_FOLDED_CONST_", 0) == 0; }

}  // namespace

void CheckpointReader::load_into(torch::inductor::AOTIModelPackageLoader& package,
                                 const LoadOptions& options) const {
  torch::inductor::AOTIModelContainerRunner* runner = package.get_runner();
  TORCH_CHECK(runner != nullptr,
              "fsdp_ema::CheckpointReader: the AOTInductor package has no "
              "runner");
  // The package's current constants, keyed by their internal names: what names and shapes the
  // checkpoint must match.
  const auto constants = runner->extract_constants_map(/*use_inactive=*/false);
  std::map<std::string, at::Tensor> targets;
  for (const auto& [name, fqn] : runner->getConstantNamesToOriginalFQNs()) {
    if (is_folded(fqn)) continue;
    auto it = constants.find(name);
    if (it == constants.end()) it = constants.find(fqn);
    TORCH_CHECK(it != constants.end(),
                "fsdp_ema::CheckpointReader: the AOTInductor package lists "
                "constant '",
                fqn, "' but holds no tensor for it");
    targets.emplace(fqn, it->second);
  }
  if (options.strict) {
    // Said here rather than as read_for's "unexpected in checkpoint": the usual cause is a package
    // whose weights were folded into derived constants at compile time.
    std::vector<std::string> absent;
    for (const CheckpointTensor& t : tensors()) {
      if (targets.count(t.name) == 0) absent.push_back(t.name);
    }
    if (!absent.empty()) {
      std::string names;
      for (size_t i = 0; i < absent.size() && i < 20; ++i) names += (i ? ", " : "") + absent[i];
      if (absent.size() > 20) names += ", ... (" + std::to_string(absent.size()) + " in all)";
      TORCH_CHECK(false, "fsdp_ema::CheckpointReader: cannot load ", directory(),
                  " into the AOTInductor package: it has no constant for ", names,
                  " (compile it with inductor_configs={\"aot_inductor.use_runtime_constant_"
                  "folding\": True} so that every weight stays a constant, or load with "
                  "strict=false)");
    }
  }
  const auto values = read_for(targets, options);
  // torch's type. Its keys are the package's constant names (read_for returns only names both
  // sides have), so a checkpoint cannot choose them to collide.
  std::unordered_map<std::string, at::Tensor> update(values.begin(), values.end());
  // Into the active buffer (the package's own update validates the names once more and reruns
  // the constant folding); a full update when strict, so no weight keeps its compiled value.
  package.load_constants(update, /*use_inactive=*/false, /*check_full_update=*/options.strict);
}

}  // namespace fsdp_ema
