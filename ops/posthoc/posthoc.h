// Host side of the post-hoc EMA operators: thin adapters over fsdp_ema/format/posthoc.h, the one
// implementation of the power-EMA gamma and the least-squares weights (the `fsdp-ema posthoc`
// command uses it directly).
#pragma once

#include <c10/util/ArrayRef.h>
#include <c10/util/string_view.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace fsdp_ema::ops {

double power_ema_gamma(double sigma_rel);
double power_ema_sigma_rel(double gamma);
std::vector<double> posthoc_weights(c10::ArrayRef<int64_t> steps, c10::ArrayRef<double> gammas,
                                    int64_t step, double gamma);
// JSON: {"snapshots": [{"dir", "step", "gamma"}], "weights", "step", "gamma", "sigma_rel",
// "world_size", "tensors", "skipped"}. With `out`, also checks that out may receive the result
// (format::check_posthoc_output: not a snapshot, not in the root, by inode).
std::string posthoc_plan(c10::string_view snapshot_root, double sigma_rel,
                         std::optional<int64_t> step, std::optional<c10::string_view> out);

}  // namespace fsdp_ema::ops
