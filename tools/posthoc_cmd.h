// `fsdp-ema posthoc`: post-hoc EMA reconstruction from power-EMA snapshots
// (fsdp_ema/format/posthoc.h).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace fsdp_ema::tools {

struct PosthocArgs {
  std::string snapshot_root;
  std::string out;
  double sigma_rel = 0;
  std::optional<int64_t> step;
  bool overwrite = false;
  bool no_verify = false;
  bool quiet = false;
  bool dry_run = false;  // print the plan only
};

// Prints the plan (snapshots, weights), streams the combination into args.out with a progress
// display, and returns the exit status (0; errors are thrown as FormatError).
int cmd_posthoc(const PosthocArgs& args);

}  // namespace fsdp_ema::tools
