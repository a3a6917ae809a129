#include "fsdp_ema/format/posthoc.h"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <sstream>
#include <utility>

#include "fsdp_ema/format/checkpoint_dir.h"
#include "fsdp_ema/format/dtype.h"
#include "fsdp_ema/format/dtype_cast.h"
#include "fsdp_ema/format/error.h"
#include "fsdp_ema/format/file_util.h"
#include "fsdp_ema/format/index.h"
#include "fsdp_ema/format/layout.h"
#include "fsdp_ema/format/names.h"
#include "fsdp_ema/format/paths.h"
#include "fsdp_ema/format/shape.h"
#include "fsdp_ema/format/shard_writer.h"

namespace fsdp_ema::format {
namespace {

std::string num(double v) {
  std::ostringstream s;
  s.precision(17);
  s << v;
  return s.str();
}

constexpr double kMaxDouble = std::numeric_limits<double>::max();
// Profiles whose gamma is beyond this lose (gamma + 1) / (gamma_a + gamma_b + 1) to rounding.
constexpr double kMaxGamma = 1e300;

// The shortest text that reads back as v (what a user typed, for the usual values).
std::string short_num(double v) {
  if (!std::isfinite(v)) return num(v);
  for (int precision = 1; precision < 17; ++precision) {
    std::ostringstream s;
    s.precision(precision);
    s << v;
    if (std::stod(s.str()) == v) return s.str();
  }
  return num(v);
}

// g^3 + 7 g^2 + (16 - s) g + (12 - s).
double sigma_cubic(double g, double s) { return ((g + 7.0) * g + (16.0 - s)) * g + (12.0 - s); }

}  // namespace

double power_ema_gamma(double sigma_rel) {
  if (!(sigma_rel > 0.0 && sigma_rel <= kMaxSigmaRel)) {
    throw FormatError("sigma_rel must be in (0, " + num(kMaxSigmaRel) +
                      "] (a power-function EMA with gamma >= 0; 1/sqrt(12) averages every step "
                      "alike), got " +
                      num(sigma_rel));
  }
  const double s = 1.0 / (sigma_rel * sigma_rel);
  if (!std::isfinite(s)) {
    // gamma is about 1 / sigma_rel: past double's range (7.5e-155 is the limit).
    throw FormatError("sigma_rel must be at least " + num(1.0 / std::sqrt(kMaxDouble)) +
                      " (a smaller one gives a gamma of about 1 / sigma_rel, beyond what a "
                      "double holds), got " +
                      num(sigma_rel));
  }
  // On [0, inf) the cubic is convex (its second derivative 6 g + 14 is positive) and not positive
  // at 0 (s >= 12), so it has exactly one root there, the largest real root: bisection to the
  // last bit, bracketed by [0, sqrt(s) + 8] (the cubic is positive at the upper end).
  double lo = 0.0, hi = std::sqrt(s) + 8.0;
  for (int i = 0; i < 2000 && lo < hi; ++i) {
    const double mid = 0.5 * (lo + hi);
    if (mid <= lo || mid >= hi) break;
    (sigma_cubic(mid, s) > 0.0 ? hi : lo) = mid;
  }
  // The end whose value is closer to zero.
  return std::abs(sigma_cubic(lo, s)) <= std::abs(sigma_cubic(hi, s)) ? lo : hi;
}

double power_ema_sigma_rel(double gamma) {
  if (!(gamma >= 0.0 && std::isfinite(gamma))) {
    throw FormatError("gamma must be finite and >= 0, got " + num(gamma));
  }
  return std::sqrt((gamma + 1.0) / ((gamma + 2.0) * (gamma + 2.0) * (gamma + 3.0)));
}

double power_profile_dot(double t_a, double gamma_a, double t_b, double gamma_b) {
  // Integral over [0, m], m = min(t_a, t_b), of (ga + 1)(gb + 1) x^(ga + gb) / (ta^(ga+1)
  // tb^(gb+1)) = (ga + 1)(gb + 1) m^(ga + gb + 1) / ((ga + gb + 1) ta^(ga+1) tb^(gb+1)); with
  // m = t_a this is (ga + 1)(gb + 1) (t_a / t_b)^gb / ((ga + gb + 1) t_b), symmetric otherwise.
  // Written with the ratio <= 1 so that no power overflows.
  // The ratio first, so that huge gammas do not overflow the product.
  const double num_factor = (gamma_a + 1.0) / (gamma_a + gamma_b + 1.0) * (gamma_b + 1.0);
  if (t_a <= t_b) return num_factor * std::pow(t_a / t_b, gamma_b) / t_b;
  return num_factor * std::pow(t_b / t_a, gamma_a) / t_a;
}

namespace {

// The arguments of posthoc_weights: one gamma per snapshot, steps >= 1, gammas in range, the
// target inside the snapshots' steps.
void check_weights_args(const std::string& op, std::span<const int64_t> steps,
                        std::span<const double> gammas, int64_t step, double gamma) {
  if (steps.empty()) throw FormatError(op + "no snapshots (steps is empty)");
  if (steps.size() != gammas.size()) {
    throw FormatError(op + "steps has " + std::to_string(steps.size()) + " entries but gammas " +
                      std::to_string(gammas.size()) + "; pass one gamma per snapshot");
  }
  const size_t n = steps.size();
  int64_t last = 0;
  for (size_t i = 0; i < n; ++i) {
    if (steps[i] < 1) {
      throw FormatError(op + "steps[" + std::to_string(i) + "] is " + std::to_string(steps[i]) +
                        "; snapshot steps count updates and start at 1");
    }
    if (!(gammas[i] >= 0.0 && gammas[i] <= kMaxGamma)) {
      throw FormatError(op + "gammas[" + std::to_string(i) +
                        "] must be finite and >= 0 (at most 1e300), got " + short_num(gammas[i]));
    }
    last = std::max(last, steps[i]);
  }
  if (step < 1 || step > last) {
    throw FormatError(op + "step must be in [1, " + std::to_string(last) +
                      "] (the last snapshot's step; the snapshots say nothing past it), got " +
                      std::to_string(step));
  }
  if (!(gamma >= 0.0 && gamma <= kMaxGamma)) {
    throw FormatError(op + "gamma must be finite and >= 0 (at most 1e300), got " +
                      short_num(gamma));
  }
}

// The Gram system [A | b] of the profiles' inner products (row-major, n x (n + 1)), scaled by
// the diagonal; norm[i] = sqrt(A_ii) of the unscaled system.
struct GramSystem {
  size_t n;
  std::vector<double> norm;
  std::vector<double> m;
  double& at(size_t r, size_t c) { return m[r * (n + 1) + c]; }
};

GramSystem gram_system(std::span<const int64_t> steps, std::span<const double> gammas, int64_t step,
                       double gamma) {
  const size_t n = steps.size();
  // The Gram system A w = b of the profiles' inner products, scaled by the diagonal: row and
  // column i divided by sqrt(A_ii), so that A has a unit diagonal (cosines of the profiles) and
  // snapshots 2^63 steps apart are as well conditioned as 10 steps apart (unscaled, a pivot of
  // 1/t next to one of 1/1 looked singular). w_i = w'_i / sqrt(A_ii).
  GramSystem g{n, std::vector<double>(n), std::vector<double>(n * (n + 1))};
  std::vector<double>& norm = g.norm;
  for (size_t i = 0; i < n; ++i) {
    const double t = static_cast<double>(steps[i]);
    norm[i] = std::sqrt(power_profile_dot(t, gammas[i], t, gammas[i]));
  }
  auto at = [&](size_t r, size_t c) -> double& { return g.at(r, c); };
  for (size_t i = 0; i < n; ++i) {
    for (size_t j = 0; j < n; ++j) {
      at(i, j) = power_profile_dot(static_cast<double>(steps[i]), gammas[i],
                                   static_cast<double>(steps[j]), gammas[j]) /
                 norm[i] / norm[j];
    }
    at(i, n) = power_profile_dot(static_cast<double>(steps[i]), gammas[i],
                                 static_cast<double>(step), gamma) /
               norm[i];
  }
  return g;
}

// Two snapshots whose profiles are one and the same (cosine 1 to rounding) are named: the same
// step and gamma, or steps past 2^53 that are one number as doubles.
void check_distinct_profiles(const std::string& op, std::span<const int64_t> steps,
                             std::span<const double> gammas, GramSystem& g) {
  const size_t n = g.n;
  auto at = [&](size_t r, size_t c) -> double& { return g.at(r, c); };
  for (size_t i = 0; i < n; ++i) {
    for (size_t j = i + 1; j < n; ++j) {
      if (at(i, j) < 1.0 - 64 * std::numeric_limits<double>::epsilon()) continue;
      const auto snap = [&](size_t k) {
        return "snapshot " + std::to_string(k) + " (step " + std::to_string(steps[k]) + ", gamma " +
               num(gammas[k]) + ")";
      };
      const bool same_step = static_cast<double>(steps[i]) == static_cast<double>(steps[j]);
      throw FormatError(op + snap(i) + " and " + snap(j) + " have the same profile" +
                        (same_step && steps[i] != steps[j]
                             ? " (their steps differ, but are one number as doubles: steps "
                               "past 2^53 must differ by more than double precision resolves)"
                             : "") +
                        "; drop one of them");
    }
  }
}

// The scaled weights w' of A w' = b.
std::vector<double> solve(const std::string& op, GramSystem& g) {
  const size_t n = g.n;
  auto at = [&](size_t r, size_t c) -> double& { return g.at(r, c); };
  // Gaussian elimination with partial pivoting (what LAPACK's gesv, behind numpy.linalg.solve
  // and torch.linalg.solve, does); on the unit-diagonal system a pivot at rounding level means
  // profiles that are combinations of others.
  const double tiny = static_cast<double>(n) * 16 * std::numeric_limits<double>::epsilon();
  for (size_t col = 0; col < n; ++col) {
    size_t pivot = col;
    for (size_t r = col + 1; r < n; ++r) {
      if (std::abs(at(r, col)) > std::abs(at(pivot, col))) pivot = r;
    }
    if (!(std::abs(at(pivot, col)) > tiny)) {
      throw FormatError(op +
                        "the snapshots' profiles are linearly dependent to double "
                        "precision (snapshot " +
                        std::to_string(col) +
                        " is a combination of others); the least-squares system is singular");
    }
    if (pivot != col) {
      for (size_t c = col; c <= n; ++c) std::swap(at(col, c), at(pivot, c));
    }
    for (size_t r = col + 1; r < n; ++r) {
      const double f = at(r, col) / at(col, col);
      if (f == 0.0) continue;
      for (size_t c = col; c <= n; ++c) at(r, c) -= f * at(col, c);
    }
  }
  std::vector<double> w(n);
  for (size_t i = n; i-- > 0;) {
    double v = at(i, n);
    for (size_t c = i + 1; c < n; ++c) v -= at(i, c) * w[c];
    w[i] = v / at(i, i);
  }
  return w;
}

}  // namespace

std::vector<double> posthoc_weights(std::span<const int64_t> steps, std::span<const double> gammas,
                                    int64_t step, double gamma) {
  const std::string op = "posthoc_weights: ";
  check_weights_args(op, steps, gammas, step, gamma);
  GramSystem g = gram_system(steps, gammas, step, gamma);
  check_distinct_profiles(op, steps, gammas, g);
  std::vector<double> w = solve(op, g);
  for (size_t i = 0; i < g.n; ++i) w[i] /= g.norm[i];
  return w;
}

bool is_snapshot_metadata_tensor(std::string_view name) {
  return name == kSnapshotStepTensor || name == kSnapshotGammaTensor;
}

void check_posthoc_output(const PosthocPlan& plan, const std::string& out_dir) {
  check_path(out_dir, "posthoc output");
  const std::string where = "posthoc(" + out_dir + "): ";
  for (const PosthocSnapshot& s : plan.snapshots) {
    if (same_or_inside(out_dir, s.dir)) {
      throw FormatError(where + "the output must not be a snapshot or inside one: it is (in) " +
                        s.dir);
    }
  }
  if (!plan.root.empty() && same_or_inside(out_dir, plan.root)) {
    throw FormatError(where + "the output must not be inside the snapshot root " + plan.root +
                      " (the next plan would find it there as a checkpoint that is no snapshot)");
  }
  if (!plan.root.empty() && same_or_inside(plan.root, out_dir)) {
    throw FormatError(where + "the output must not hold the snapshot root " + plan.root);
  }
}

namespace {

// The step and gamma of the snapshot in `dir` (a 0-dim I64 and a 0-dim F64 tensor).
PosthocSnapshot read_snapshot(const CheckpointDir& ckpt, const std::string& dir,
                              const std::string& where) {
  const IndexTensor* st = ckpt.find(kSnapshotStepTensor);
  const IndexTensor* gt = ckpt.find(kSnapshotGammaTensor);
  if (st == nullptr || gt == nullptr) {
    throw FormatError(where + dir + " is a checkpoint but not a power-EMA snapshot (no '" +
                      std::string(st == nullptr ? kSnapshotStepTensor : kSnapshotGammaTensor) +
                      "' tensor); snapshot_root must hold only ShardedEMA snapshots");
  }
  if (st->dtype != DType::kI64 || !st->shape.empty() || gt->dtype != DType::kF64 ||
      !gt->shape.empty()) {
    throw FormatError(where + dir +
                      ": the snapshot tensors must be a 0-dim I64 step and a 0-dim "
                      "F64 gamma");
  }
  PosthocSnapshot s;
  s.dir = dir;
  ckpt.read_full(kSnapshotStepTensor, &s.step, sizeof(s.step));
  ckpt.read_full(kSnapshotGammaTensor, &s.gamma, sizeof(s.gamma));
  return s;
}

// Two snapshots of one model: the same names, dtypes and global shapes.
void check_same_model(const CheckpointIndex& first, const std::string& first_dir,
                      const CheckpointIndex& index, const std::string& dir,
                      const std::string& where) {
  // Both lists are sorted by name.
  const auto& a = first.tensors;
  const auto& b = index.tensors;
  for (size_t i = 0; i < std::max(a.size(), b.size()); ++i) {
    if (i >= a.size() || i >= b.size() || a[i].name != b[i].name) {
      const std::string extra = i >= a.size()   ? b[i].name
                                : i >= b.size() ? a[i].name
                                                : std::min(a[i].name, b[i].name);
      throw FormatError(where + "snapshots of different models: " + first_dir + " and " + dir +
                        " differ in tensor names (first difference: '" + extra + "')");
    }
    if (a[i].dtype != b[i].dtype || a[i].shape != b[i].shape) {
      throw FormatError(where + "snapshots of different models: tensor '" + a[i].name + "' is " +
                        std::string(dtype_name(a[i].dtype)) + shape_to_string(a[i].shape) + " in " +
                        first_dir + " but " + std::string(dtype_name(b[i].dtype)) +
                        shape_to_string(b[i].shape) + " in " + dir);
    }
  }
}

// No profile twice (the snapshots sorted by step and gamma).
void check_distinct_snapshots(const std::vector<PosthocSnapshot>& snapshots,
                              const std::string& where) {
  for (size_t i = 1; i < snapshots.size(); ++i) {  // sorted: duplicates are neighbours
    const PosthocSnapshot& a = snapshots[i - 1];
    const PosthocSnapshot& b = snapshots[i];
    if (a.step == b.step && a.gamma == b.gamma) {
      throw FormatError(where + "snapshots " + a.dir + " and " + b.dir +
                        " have the same step and gamma (" + std::to_string(a.step) + ", " +
                        num(a.gamma) +
                        "): one profile twice makes the least-squares system "
                        "singular; remove one of them");
    }
  }
}

}  // namespace

PosthocPlan plan_posthoc(const std::string& snapshot_root, double sigma_rel,
                         std::optional<int64_t> step) {
  const std::string where = "posthoc(" + snapshot_root + "): ";
  check_path(snapshot_root, "posthoc snapshot root");
  PosthocPlan plan;
  plan.root = snapshot_root;
  plan.sigma_rel = sigma_rel;
  plan.gamma = power_ema_gamma(sigma_rel);
  if (!detail::is_directory(snapshot_root)) {
    throw FormatError(where + "no such directory");
  }
  std::vector<std::string> names = detail::list_dir(snapshot_root);
  std::sort(names.begin(), names.end());
  const CheckpointIndex* first_index = nullptr;
  std::string first_dir;
  std::vector<CheckpointDir> opened;  // keeps first_index alive
  opened.reserve(names.size());
  for (const std::string& name : names) {
    const std::string dir = snapshot_root + "/" + name;
    if (name.empty() || name[0] == '.' || !detail::is_directory(dir)) continue;
    if (!detail::path_exists(dir + "/" + std::string(kIndexFileName))) {
      plan.skipped.push_back(dir);
      continue;
    }
    CheckpointDir ckpt = CheckpointDir::open(dir);
    PosthocSnapshot s = read_snapshot(ckpt, dir, where);
    const CheckpointIndex& index = ckpt.index();
    if (first_index == nullptr) {
      plan.world_size = ckpt.world_size();
      for (const IndexTensor& t : index.tensors) {
        if (!is_snapshot_metadata_tensor(t.name)) plan.tensors.push_back(t.name);
      }
    } else {
      if (ckpt.world_size() != plan.world_size) {
        throw FormatError(where + "snapshots written at different world sizes: " + first_dir +
                          " at " + std::to_string(plan.world_size) + ", " + dir + " at " +
                          std::to_string(ckpt.world_size()) + " (not one training run)");
      }
      check_same_model(*first_index, first_dir, index, dir, where);
    }
    plan.snapshots.push_back(std::move(s));
    opened.push_back(std::move(ckpt));
    if (first_index == nullptr) {
      first_index = &opened.back().index();
      first_dir = dir;
    }
  }
  if (plan.snapshots.empty()) {
    throw FormatError(where + "no snapshots (no subdirectory holds a committed checkpoint" +
                      (plan.skipped.empty() ? std::string()
                                            : "; " + std::to_string(plan.skipped.size()) +
                                                  " incomplete ones without an index") +
                      ")");
  }
  std::sort(plan.snapshots.begin(), plan.snapshots.end(), [](const auto& x, const auto& y) {
    return std::pair(x.step, x.gamma) < std::pair(y.step, y.gamma);
  });
  check_distinct_snapshots(plan.snapshots, where);
  plan.step = step.value_or(plan.snapshots.back().step);
  std::vector<int64_t> steps;
  std::vector<double> gammas;
  for (const PosthocSnapshot& s : plan.snapshots) {
    steps.push_back(s.step);
    gammas.push_back(s.gamma);
  }
  try {
    plan.weights = posthoc_weights(steps, gammas, plan.step, plan.gamma);
  } catch (const FormatError& e) {
    throw FormatError(where + e.what());
  }
  return plan;
}

void posthoc_combine(const PosthocPlan& plan, const std::string& out_dir,
                     const PosthocOptions& options) {
  const std::string where = "posthoc(" + out_dir + "): ";
  if (plan.snapshots.empty() || plan.weights.size() != plan.snapshots.size()) {
    throw FormatError(where + "the plan has no snapshots or no weight per snapshot");
  }
  check_posthoc_output(plan, out_dir);
  std::vector<CheckpointDir> in;
  in.reserve(plan.snapshots.size());
  for (const PosthocSnapshot& s : plan.snapshots) in.push_back(CheckpointDir::open(s.dir));
  const CheckpointDir& last = in.back();
  if (!options.overwrite && is_committed(out_dir)) {
    throw FormatError(where + "the output is already committed (" + std::string(kIndexFileName) +
                      " exists); pass overwrite to replace it");
  }

  uint64_t total = 0;
  for (const std::string& name : plan.tensors) total += last.tensor_nbytes(name);
  auto done = std::make_shared<uint64_t>(0);
  std::vector<TensorToWrite> tensors;
  tensors.reserve(plan.tensors.size());
  for (const std::string& name : plan.tensors) {
    const IndexTensor& info = last.tensor(name);
    TensorToWrite t;
    t.name = name;
    t.dtype = info.dtype;
    t.shape = info.shape;
    t.offsets = Shape(info.shape.size(), 0);
    t.global_shape = info.shape;
    const uint64_t nbytes = last.tensor_nbytes(name);
    if (nbytes == 0) {
      tensors.push_back(std::move(t));
      continue;
    }
    const DType dtype = info.dtype;
    const size_t es = dtype_size(dtype);
    const bool combine = can_cast(dtype, DType::kF64);
    // Called with byte ranges of the tensor in file order; they need not fall on element
    // boundaries, so each call covers the elements it touches and copies its bytes.
    t.fill = [&in, &plan, &options, done, total, name, dtype, es, combine](
                 uint64_t offset, uint64_t length, void* dst) {
      const uint64_t e0 = offset / es;
      const uint64_t e1 = (offset + length + es - 1) / es;
      const size_t count = static_cast<size_t>(e1 - e0);
      std::vector<std::byte> out(count * es);
      if (!combine) {
        in.back().read_flat(name, e0, e1, out.data(), out.size(), options.verify);
      } else {
        std::vector<double> acc(count, 0.0), x(count);
        std::vector<std::byte> raw(count * es);
        for (size_t i = 0; i < in.size(); ++i) {
          in[i].read_flat(name, e0, e1, raw.data(), raw.size(), options.verify);
          cast_elements(dtype, raw.data(), DType::kF64, x.data(), count);
          const double w = plan.weights[i];
          // Product then sum, each rounded once (no fused multiply-add), in snapshot order: the
          // Python front's torch ops do the same, so both give the same bits.
          for (size_t k = 0; k < count; ++k) {
            const double p = w * x[k];
            acc[k] = acc[k] + p;
          }
        }
        cast_elements(DType::kF64, acc.data(), dtype, out.data(), count);
      }
      std::memcpy(dst, out.data() + (offset - e0 * es), length);
      *done += length;
      if (options.progress) options.progress({*done, total, name});
    };
    tensors.push_back(std::move(t));
  }
  WriteOptions wo;
  wo.fsync = options.fsync;
  wo.rank = 0;
  wo.world_size = 1;
  // The layout's own save and commit (fsdp_ema/format/layout.h): the directory lock, stale
  // temporaries, and what an overwrite replaces.
  save_shard_to_dir(out_dir, std::move(tensors), wo, options.overwrite);
  commit_directory(out_dir, 1, options.overwrite, options.fsync);
}

}  // namespace fsdp_ema::format
