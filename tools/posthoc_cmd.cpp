#include "tools/posthoc_cmd.h"

#include <cinttypes>
#include <cstdio>

#include "fsdp_ema/format/names.h"
#include "fsdp_ema/format/posthoc.h"
#include "tools/progress.h"
#include "tools/terminal_text.h"

namespace fsdp_ema::tools {

int cmd_posthoc(const PosthocArgs& args) {
  namespace fmt = fsdp_ema::format;
  const fmt::PosthocPlan plan = fmt::plan_posthoc(args.snapshot_root, args.sigma_rel, args.step);
  if (!args.quiet) {
    std::printf("post-hoc EMA: sigma_rel %.6g (gamma %.6g) at step %" PRId64
                " from %zu snapshots"
                " (world size %" PRId64 ", %zu tensors)\n",
                plan.sigma_rel, plan.gamma, plan.step, plan.snapshots.size(), plan.world_size,
                plan.tensors.size());
    for (size_t i = 0; i < plan.snapshots.size(); ++i) {
      const fmt::PosthocSnapshot& s = plan.snapshots[i];
      std::printf("  %-60s step %9" PRId64 "  gamma %9.4f  sigma_rel %.4f  weight %+.9g\n",
                  printable(s.dir).c_str(), s.step, s.gamma, fmt::power_ema_sigma_rel(s.gamma),
                  plan.weights[i]);
    }
    for (const std::string& d : plan.skipped) {
      std::printf("  skipped %s (no %s: an incomplete save)\n", printable(d).c_str(),
                  std::string(fmt::kIndexFileName).c_str());
    }
  }
  if (args.dry_run) return 0;
  fmt::PosthocOptions opts;
  opts.overwrite = args.overwrite;
  opts.verify = !args.no_verify;
  Progress progress(stderr, Progress::pick_mode(stderr, args.quiet), "posthoc");
  uint64_t total = 0;
  opts.progress = [&](const fmt::PosthocProgress& p) {
    total = p.bytes_total;
    progress.update(p.bytes_done, p.bytes_total, p.tensor);
  };
  fmt::posthoc_combine(plan, args.out, opts);
  progress.finish(total, total);
  if (!args.quiet) {
    std::printf("wrote %s (%s, 1 rank)\n", printable(args.out).c_str(), human_bytes(total).c_str());
  }
  return 0;
}

}  // namespace fsdp_ema::tools
