#include "ops/posthoc.h"

#include <c10/util/Exception.h>

#include <nlohmann/json.hpp>

#include "fsdp_ema/format/error.h"
#include "fsdp_ema/format/posthoc.h"

namespace fsdp_ema::ops {
namespace {

// Format errors surface as c10::Error (RuntimeError in Python) with the op's name in front.
template <typename F>
auto translate(const char* op, F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const format::FormatError& e) {
    TORCH_CHECK(false, op, e.what());
  }
}

}  // namespace

double power_ema_gamma(double sigma_rel) {
  return translate("fsdp_ema::power_ema_gamma: ",
                   [&] { return format::power_ema_gamma(sigma_rel); });
}

double power_ema_sigma_rel(double gamma) {
  return translate("fsdp_ema::power_ema_sigma_rel: ",
                   [&] { return format::power_ema_sigma_rel(gamma); });
}

std::vector<double> posthoc_weights(c10::ArrayRef<int64_t> steps, c10::ArrayRef<double> gammas,
                                    int64_t step, double gamma) {
  return translate("fsdp_ema::", [&] {
    return format::posthoc_weights({steps.data(), steps.size()}, {gammas.data(), gammas.size()},
                                   step, gamma);
  });
}

std::string posthoc_plan(c10::string_view snapshot_root, double sigma_rel,
                         std::optional<int64_t> step, std::optional<c10::string_view> out) {
  return translate("fsdp_ema::", [&] {
    const format::PosthocPlan plan =
        format::plan_posthoc(std::string(snapshot_root), sigma_rel, step);
    if (out.has_value()) format::check_posthoc_output(plan, std::string(*out));
    nlohmann::json j;
    j["snapshots"] = nlohmann::json::array();
    for (const auto& s : plan.snapshots) {
      j["snapshots"].push_back({{"dir", s.dir}, {"step", s.step}, {"gamma", s.gamma}});
    }
    j["weights"] = plan.weights;
    j["step"] = plan.step;
    j["gamma"] = plan.gamma;
    j["sigma_rel"] = plan.sigma_rel;
    j["world_size"] = plan.world_size;
    j["tensors"] = plan.tensors;
    j["skipped"] = plan.skipped;
    return j.dump();
  });
}

}  // namespace fsdp_ema::ops
