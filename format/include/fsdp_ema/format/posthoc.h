// Post-hoc EMA (Karras et al., "Analyzing and Improving the Training Dynamics of Diffusion
// Models", EDM2, 2024, section 3): power-function EMA profiles, the least-squares weights that
// combine snapshots of them into the EMA of another profile, and that combination done on
// checkpoint directories, tensor by tensor with bounded memory. Torch-free: the `fsdp-ema
// posthoc` command and the Python front (through the power_ema_gamma / posthoc_plan operators)
// both use this one implementation.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace fsdp_ema::format {

// Largest sigma_rel a power-function EMA has with gamma >= 0: 1/sqrt(12), the uniform average of
// every step so far (gamma = 0). Smaller sigma_rel means a shorter average (larger gamma).
inline constexpr double kMaxSigmaRel = 0.28867513459481292;  // the double nearest 1/sqrt(12)

// gamma of the profile with relative standard deviation sigma_rel: the largest real root of
// sigma_rel^2 (g + 2)^2 (g + 3) = g + 1 (the std of the density (g + 1) x^g on [0, 1]), i.e. of
// g^3 + 7 g^2 + (16 - s) g + (12 - s) with s = 1 / sigma_rel^2. Throws FormatError unless
// 0 < sigma_rel <= kMaxSigmaRel.
double power_ema_gamma(double sigma_rel);
// The inverse: sqrt((g + 1) / ((g + 2)^2 (g + 3))); throws unless gamma >= 0 and finite.
double power_ema_sigma_rel(double gamma);

// Inner product of two normalized power-function profiles p(x) = (g + 1) x^g / t^(g + 1) on
// [0, t], each ending at its step t: the integral of p_a p_b over [0, min(t_a, t_b)].
double power_profile_dot(double t_a, double gamma_a, double t_b, double gamma_b);

// Least-squares weights w that make sum_i w_i p_i closest (in L2) to the profile (step, gamma):
// the normal equations A w = b with A_ij = <p_i, p_j> and b_i = <p_i, p_r> (EDM2 Algorithm 3),
// solved in double precision by Gaussian elimination with partial pivoting. Throws FormatError
// naming the argument for: no snapshot, lengths that differ, a step < 1, a gamma < 0 or not
// finite, a target step < 1 or past the last snapshot, and a singular system (two snapshots with
// the same step and gamma).
std::vector<double> posthoc_weights(std::span<const int64_t> steps, std::span<const double> gammas,
                                    int64_t step, double gamma);

// Every snapshot (a committed checkpoint) records its update count and profile as 0-dim tensors
// under these names, next to the EMA tensors (the checkpoint format itself is unchanged).
inline constexpr std::string_view kSnapshotStepTensor = "fsdp_ema.snapshot.step";    // I64
inline constexpr std::string_view kSnapshotGammaTensor = "fsdp_ema.snapshot.gamma";  // F64
bool is_snapshot_metadata_tensor(std::string_view name);

struct PosthocSnapshot {
  std::string dir;  // the snapshot's checkpoint directory
  int64_t step = 0;
  double gamma = 0;
};

struct PosthocPlan {
  std::string root;                        // the snapshot root the plan was made from
  std::vector<PosthocSnapshot> snapshots;  // sorted by (step, gamma)
  std::vector<double> weights;             // one per snapshot
  int64_t step = 0;                        // the target: the last snapshot's step by default
  double gamma = 0;
  double sigma_rel = 0;
  int64_t world_size = 1;            // the world size every snapshot was written at
  std::vector<std::string> tensors;  // the EMA tensors (metadata tensors excluded), sorted
  std::vector<std::string> skipped;  // subdirectories without a committed index (incomplete)
};

// Finds the snapshots under snapshot_root (every direct subdirectory holding a committed
// checkpoint with the two metadata tensors; subdirectories without an index are incomplete
// saves, listed in `skipped`), checks they are one model (the same tensor names, dtypes and
// global shapes) written at one world size, and solves the weights for sigma_rel at `step`
// (default: the last snapshot's step). Throws FormatError naming the directory at fault.
PosthocPlan plan_posthoc(const std::string& snapshot_root, double sigma_rel,
                         std::optional<int64_t> step = std::nullopt);

// Refuses an output directory that is the snapshot root, a snapshot, or inside either (an output
// in the root would be found by the next plan as a checkpoint that is no snapshot), or that holds
// the root: compared by device and inode (paths.h), so "<root>/s002/", "./s002", "s002/." and
// links are caught. Throws FormatError before anything is created.
void check_posthoc_output(const PosthocPlan& plan, const std::string& out_dir);

struct PosthocProgress {
  uint64_t bytes_done = 0;  // output bytes written so far
  uint64_t bytes_total = 0;
  std::string_view tensor;  // the tensor being written
};

struct PosthocOptions {
  bool verify = true;  // check the checksum of every piece read
  bool fsync = true;
  bool overwrite = false;  // replace a committed checkpoint in out_dir (else error)
  std::function<void(const PosthocProgress&)> progress;
};

// Writes the EMA of plan.sigma_rel at plan.step to out_dir as a one-rank checkpoint (the same
// names, dtypes and shapes as the snapshots; no metadata tensors): floating tensors are
// sum_i weights[i] * snapshot_i accumulated in double in snapshot order, rounded once to the
// tensor's dtype; other tensors (integer buffers) are copied from the last snapshot. Streams in
// the writer's chunks, so memory stays a few chunks whatever the model size. Checks out_dir
// (check_posthoc_output) first; a failure leaves no directory it created.
void posthoc_combine(const PosthocPlan& plan, const std::string& out_dir,
                     const PosthocOptions& options = {});

}  // namespace fsdp_ema::format
