// format/posthoc: the power-EMA gamma, the least-squares weights, the snapshot plan and the
// streaming combination, checked against values computed here independently.
#include "fsdp_ema/format/posthoc.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

#include "fsdp_ema/format/checkpoint_dir.h"
#include "fsdp_ema/format/layout.h"
#include "fsdp_ema/format/names.h"
#include "fsdp_ema/format/shard_file.h"
#include "fsdp_ema/format/shard_writer.h"
#include "tests/format/test_util.h"

namespace fsdp_ema::format {
namespace {

using ::testing::AllOf;
using testing::error_of;
using ::testing::HasSubstr;
using testing::TempDir;

TEST(PowerEmaGamma, MatchesTheCubicsLargestRoot) {
  // numpy.roots([1, 7, 16 - s, 12 - s]).real.max() for s = sigma_rel ** -2.
  EXPECT_NEAR(power_ema_gamma(0.05), 16.972198602303447, 1e-12);
  EXPECT_NEAR(power_ema_gamma(0.10), 6.937203937601806, 1e-12);
  EXPECT_EQ(power_ema_gamma(kMaxSigmaRel), 0.0);
  for (const double s : {0.01, 0.05, 0.1, 0.2, 0.28}) {
    const double g = power_ema_gamma(s);
    EXPECT_NEAR(power_ema_sigma_rel(g), s, 1e-14) << s;
  }
}

TEST(PowerEmaGamma, RejectsSigmaRelOutOfRange) {
  for (const double s : {0.0, -0.1, 0.2887513, 1.0, std::nan("")}) {
    EXPECT_THAT(error_of([&] { power_ema_gamma(s); }), HasSubstr("sigma_rel must be in (0, "));
  }
  EXPECT_THAT(error_of([&] { power_ema_sigma_rel(-1); }), HasSubstr("gamma must be finite"));
}

TEST(PosthocWeights, ReproduceATrackedProfileAndSolveTheNormalEquations) {
  const std::vector<int64_t> steps = {100, 200, 100, 200};
  const std::vector<double> gammas = {6.9, 6.9, 16.9, 16.9};
  const std::vector<double> one_hot = posthoc_weights(steps, gammas, 200, 16.9);
  for (size_t i = 0; i < 4; ++i) EXPECT_NEAR(one_hot[i], i == 3 ? 1.0 : 0.0, 1e-9) << i;
  // A w = b, with A and b from the profiles' inner products written out here.
  auto dot = [](double ta, double ga, double tb, double gb) {
    const double m = std::min(ta, tb);
    return (ga + 1) * (gb + 1) * std::pow(m, ga + gb + 1) /
           ((ga + gb + 1) * std::pow(ta, ga + 1) * std::pow(tb, gb + 1));
  };
  const std::vector<double> w = posthoc_weights(steps, gammas, 180, 9.5);
  for (size_t i = 0; i < 4; ++i) {
    double lhs = 0;
    for (size_t j = 0; j < 4; ++j) lhs += dot(steps[i], gammas[i], steps[j], gammas[j]) * w[j];
    EXPECT_NEAR(lhs, dot(steps[i], gammas[i], 180, 9.5), 1e-12) << i;
  }
}

TEST(PosthocWeights, BadArgumentsAreNamed) {
  const std::vector<int64_t> s = {10, 20};
  const std::vector<double> g = {1, 2};
  const std::vector<double> g2 = {2, 2};
  EXPECT_THAT(error_of([&] { posthoc_weights({}, {}, 1, 1); }), HasSubstr("no snapshots"));
  EXPECT_THAT(error_of([&] { posthoc_weights(s, std::vector<double>{1}, 1, 1); }),
              HasSubstr("steps has 2 entries but gammas 1"));
  EXPECT_THAT(error_of([&] {
                posthoc_weights(std::vector<int64_t>{0, 20}, g, 1, 1);
              }),
              HasSubstr("steps[0] is 0"));
  EXPECT_THAT(error_of([&] {
                posthoc_weights(s, std::vector<double>{1, -2}, 1, 1);
              }),
              HasSubstr("gammas[1] must be finite and >= 0"));
  EXPECT_THAT(error_of([&] { posthoc_weights(s, g, 21, 1); }),
              HasSubstr("step must be in [1, 20]"));
  EXPECT_THAT(error_of([&] {
                posthoc_weights(std::vector<int64_t>{10, 10}, g2, 10, 1);
              }),
              HasSubstr("snapshot 0 (step 10, gamma 2) and snapshot 1 (step 10, gamma 2) have the "
                        "same profile"));
}

// #28: what used to be called "linearly dependent", and what it really was.
TEST(PosthocWeights, StepsFarApartAreSolvedNotCalledDependent) {
  // 1 and 2^63 - 1: unscaled, the pivot 1/t of the late snapshot was under the threshold set by
  // the early one's, and the system was refused as singular.
  constexpr int64_t kLast = std::numeric_limits<int64_t>::max();
  const std::vector<int64_t> steps = {1, 1 << 20, kLast, kLast};
  const std::vector<double> gammas = {6.9, 6.9, 6.9, 16.9};
  const std::vector<double> w = posthoc_weights(steps, gammas, kLast, 16.9);
  for (size_t i = 0; i < 4; ++i) EXPECT_NEAR(w[i], i == 3 ? 1.0 : 0.0, 1e-9) << i;
  // The normal equations A w = b hold, each row relative to its diagonal.
  const std::vector<double> mid = posthoc_weights(steps, gammas, kLast, 10.0);
  for (size_t i = 0; i < 4; ++i) {
    const double ti = static_cast<double>(steps[i]);
    double lhs = 0;
    for (size_t j = 0; j < 4; ++j) {
      lhs += power_profile_dot(ti, gammas[i], static_cast<double>(steps[j]), gammas[j]) * mid[j];
    }
    const double b = power_profile_dot(ti, gammas[i], static_cast<double>(kLast), 10.0);
    EXPECT_NEAR(lhs / power_profile_dot(ti, gammas[i], ti, gammas[i]),
                b / power_profile_dot(ti, gammas[i], ti, gammas[i]), 1e-9)
        << i;
  }
}

TEST(PosthocWeights, HugeGammasAreSolvedOrNamed) {
  // A profile of gamma 1e200 is all at its last step: orthogonal to the others, not dependent.
  const std::vector<double> w = posthoc_weights(std::vector<int64_t>{10, 20, 20},
                                                std::vector<double>{5, 5, 1e200}, 20, 1e200);
  EXPECT_NEAR(w[2], 1.0, 1e-9);
  EXPECT_NEAR(w[0], 0.0, 1e-9);
  EXPECT_THAT(error_of([&] {
                posthoc_weights(std::vector<int64_t>{10, 20}, std::vector<double>{5, 1e301}, 20, 1);
              }),
              HasSubstr("gammas[1] must be finite and >= 0 (at most 1e300), got 1e+301"));
}

TEST(PosthocWeights, StepsThatAreOneDoubleAreNamedAsSuch) {
  const int64_t big = int64_t{1} << 62;
  EXPECT_THAT(
      error_of([&] {
        posthoc_weights(std::vector<int64_t>{big, big + 1}, std::vector<double>{5, 5}, big, 5);
      }),
      AllOf(HasSubstr("have the same profile"),
            HasSubstr("their steps differ, but are one number as doubles")));
}

TEST(PowerEmaGamma, ATinySigmaRelIsNamedNotAnInfiniteGamma) {
  EXPECT_THAT(error_of([] { power_ema_gamma(1e-320); }),
              AllOf(HasSubstr("sigma_rel must be at least 7.4583407312002"),
                    HasSubstr("got 9.9998886718268301e-321")));
  EXPECT_NEAR(power_ema_gamma(1e-150), 1e150, 1e140);  // still a number at the edge
}

// A snapshot written by `world` ranks: tensor "w" (5 x 2 floats, value base + row), a 0-dim
// int64 "n" and the two metadata tensors.
void write_snapshot(const std::string& dir, int64_t world, int64_t step, double gamma, float base) {
  std::vector<float> w(10);
  for (int i = 0; i < 10; ++i) w[i] = base + static_cast<float>(i / 2);
  const int64_t n = step * 7;
  for (int64_t r = 0; r < world; ++r) {
    std::vector<TensorToWrite> t;
    const int64_t rows = (5 + world - 1) / world;
    const int64_t begin = std::min<int64_t>(5, r * rows), end = std::min<int64_t>(5, begin + rows);
    if (end > begin) {
      TensorToWrite x;
      x.name = "w";
      x.dtype = DType::kF32;
      x.shape = {end - begin, 2};
      x.offsets = {begin, 0};
      x.global_shape = {5, 2};
      x.host_data = w.data() + begin * 2;
      t.push_back(x);
    }
    if (r == 0) {
      t.push_back(TensorToWrite::full("n", DType::kI64, {}, &n));
      t.push_back(TensorToWrite::full(std::string(kSnapshotStepTensor), DType::kI64, {}, &step));
      t.push_back(TensorToWrite::full(std::string(kSnapshotGammaTensor), DType::kF64, {}, &gamma));
    }
    WriteOptions o;
    o.rank = r;
    o.world_size = world;
    o.fsync = false;
    std::filesystem::create_directories(dir);
    write_shard_file(dir + "/" + shard_file_name(r, world), t, o);
  }
  commit_directory(dir, world, false, false);
}

TEST(PosthocCombine, WritesTheWeightedSumAndCopiesIntegers) {
  TempDir tmp;
  const std::string root = tmp.subdir("snapshots");
  write_snapshot(root + "/a", 2, 10, 6.9, 1.0f);
  write_snapshot(root + "/b", 2, 20, 6.9, 2.0f);
  write_snapshot(root + "/c", 2, 20, 16.9, 3.0f);
  std::filesystem::create_directories(root + "/incomplete");
  const PosthocPlan plan = plan_posthoc(root, 0.08);
  ASSERT_EQ(plan.snapshots.size(), 3u);
  EXPECT_EQ(plan.step, 20);
  EXPECT_EQ(plan.world_size, 2);
  EXPECT_EQ(plan.tensors, (std::vector<std::string>{"n", "w"}));
  EXPECT_EQ(plan.skipped, (std::vector<std::string>{root + "/incomplete"}));
  uint64_t last_done = 0;
  PosthocOptions opts;
  opts.fsync = false;
  opts.progress = [&](const PosthocProgress& p) { last_done = p.bytes_done; };
  posthoc_combine(plan, tmp.file("out"), opts);
  EXPECT_EQ(last_done, 40u + 8u);
  const CheckpointDir out = CheckpointDir::open(tmp.file("out"));
  std::vector<float> w(10);
  out.read_full("w", w.data(), 40);
  const double bases[3] = {1.0, 2.0, 3.0};
  for (int i = 0; i < 10; ++i) {
    double want = 0;
    for (int s = 0; s < 3; ++s) want += plan.weights[s] * (bases[s] + i / 2);
    EXPECT_EQ(w[i], static_cast<float>(want)) << i;
  }
  int64_t n = 0;
  out.read_full("n", &n, 8);
  EXPECT_EQ(n, 20 * 7);  // integers come from the last snapshot
  EXPECT_EQ(out.find(kSnapshotStepTensor), nullptr);
  EXPECT_THAT(error_of([&] { posthoc_combine(plan, tmp.file("out"), opts); }),
              HasSubstr("already committed"));
}

TEST(PosthocCombine, RefusesAnOutputThatIsASnapshotOrInTheRootByInodeAndCreatesNothing) {
  TempDir tmp;
  const std::string root = tmp.subdir("snapshots");
  write_snapshot(root + "/s001", 1, 10, 6.9, 1.0f);
  write_snapshot(root + "/s002", 1, 20, 6.9, 2.0f);
  std::filesystem::create_directory_symlink(root + "/s002", tmp.file("link"));
  const PosthocPlan plan = plan_posthoc(root, 0.08);
  PosthocOptions opts;
  opts.fsync = false;
  opts.overwrite = true;  // even so: a snapshot is never replaced
  const std::vector<std::string> snapshots = {root + "/s002/", root + "/s002/.",
                                              root + "/s001/../s002", tmp.file("link"),
                                              tmp.file("link") + "/new"};
  for (const std::string& out : snapshots) {
    EXPECT_THAT(error_of([&] { posthoc_combine(plan, out, opts); }),
                HasSubstr("the output must not be a snapshot or inside one"))
        << out;
  }
  EXPECT_THAT(error_of([&] { posthoc_combine(plan, root + "/s003", opts); }),
              HasSubstr("must not be inside the snapshot root"));
  EXPECT_THAT(error_of([&] { posthoc_combine(plan, root, opts); }),
              HasSubstr("must not be inside the snapshot root"));
  EXPECT_THAT(error_of([&] { posthoc_combine(plan, tmp.path(), opts); }),
              HasSubstr("must not hold the snapshot root"));
  const std::string nul = tmp.file("out") + std::string(1, '\0') + "x";
  EXPECT_THAT(error_of([&] { posthoc_combine(plan, nul, opts); }),
              HasSubstr("holds a NUL byte at offset"));
  EXPECT_FALSE(std::filesystem::exists(root + "/s003"));
  EXPECT_FALSE(std::filesystem::exists(tmp.file("out")));
  // Every snapshot is still whole: the plan over the root is unchanged.
  EXPECT_EQ(plan_posthoc(root, 0.08).snapshots.size(), 2u);
}

TEST(PosthocCombine, AFailedCombineLeavesNoOutputDirectory) {
  TempDir tmp;
  const std::string root = tmp.subdir("snapshots");
  write_snapshot(root + "/a", 1, 10, 6.9, 1.0f);
  write_snapshot(root + "/b", 1, 20, 6.9, 2.0f);
  const PosthocPlan plan = plan_posthoc(root, 0.08);
  // Corrupt a snapshot's data: the combine fails while writing.
  const std::string file = root + "/b/" + shard_file_name(0, 1);
  auto bytes = testing::read_bytes(file);
  bytes[ShardFile::open(file).tensor("w").data_offset] ^= std::byte{1};
  testing::write_bytes(file, bytes);
  PosthocOptions opts;
  opts.fsync = false;
  EXPECT_THAT(error_of([&] { posthoc_combine(plan, tmp.file("out/deeper"), opts); }),
              HasSubstr("checksum mismatch"));
  EXPECT_FALSE(std::filesystem::exists(tmp.file("out")));
}

TEST(PosthocPlan, RefusesMixedWorldSizesAndModels) {
  TempDir tmp;
  const std::string root = tmp.subdir("s");
  EXPECT_THAT(error_of([&] { plan_posthoc(root, 0.1); }), HasSubstr("no snapshots"));
  write_snapshot(root + "/a", 1, 10, 6.9, 1.0f);
  write_snapshot(root + "/b", 2, 20, 6.9, 2.0f);
  EXPECT_THAT(error_of([&] { plan_posthoc(root, 0.1); }),
              HasSubstr("snapshots written at different world sizes"));
  EXPECT_THAT(error_of([&] { plan_posthoc(tmp.file("missing"), 0.1); }),
              HasSubstr("no such directory"));
  EXPECT_THAT(error_of([&] { plan_posthoc(root, 0.3); }), HasSubstr("sigma_rel must be in"));
}

}  // namespace
}  // namespace fsdp_ema::format
