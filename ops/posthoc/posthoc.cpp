#include "ops/posthoc/posthoc.h"

#include <c10/util/Exception.h>

#include "fsdp_ema/format/error.h"
#include "fsdp_ema/format/json_writer.h"
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
    format::JsonWriter j;
    j.begin_object().key("snapshots").begin_array();
    for (const auto& s : plan.snapshots) {
      j.begin_object().key("dir").value(s.dir).key("step").value(s.step).key("gamma").value(
          s.gamma);
      j.end_object();
    }
    j.end_array();
    j.key("weights").array(std::span<const double>(plan.weights));
    j.key("step").value(plan.step).key("gamma").value(plan.gamma);
    j.key("sigma_rel").value(plan.sigma_rel).key("world_size").value(plan.world_size);
    j.key("tensors").array(std::span<const std::string>(plan.tensors));
    j.key("skipped").array(std::span<const std::string>(plan.skipped));
    return j.end_object().str();
  });
}

}  // namespace fsdp_ema::ops
