// The CUDA batched copy kernel (gather_shards' pack and unpack) driven directly: every source and
// destination byte alignment 0..15, lengths around the word and block sizes, many segments in one
// launch, each against at::Tensor copies. Skipped without a CUDA device.
#include <ATen/ATen.h>
#include <ATen/cuda/Sleep.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <gtest/gtest.h>

#include <vector>

#include "kernels/batched_copy.h"
#include "ops/gather/gather_shards_cuda.h"
#include "test_helpers.h"

namespace {

using fsdp_ema::kernels::CopySegment;

const at::TensorOptions kBytes = at::TensorOptions().dtype(at::kByte).device(at::kCUDA);

at::Tensor random_bytes(int64_t n, int64_t seed) {
  at::manual_seed(seed);
  return at::randint(0, 256, {n}, kBytes);
}

// Copies src[s_off, s_off + n) to dst[d_off, d_off + n) for every case in one launch and checks
// the destination: the copied range equals the source, everything else keeps its bytes.
struct Case {
  int64_t src_offset, dst_offset, nbytes;
};

void run_cases(const std::vector<Case>& cases, int64_t seed) {
  std::vector<at::Tensor> srcs, dsts, before;
  std::vector<CopySegment> segments;
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    srcs.push_back(random_bytes(c.src_offset + c.nbytes + 32, seed + 2 * i));
    dsts.push_back(random_bytes(c.dst_offset + c.nbytes + 32, seed + 2 * i + 1));
    before.push_back(dsts.back().clone());
    if (c.nbytes == 0) continue;  // the op never passes empty segments
    segments.push_back({static_cast<const char*>(srcs.back().const_data_ptr()) + c.src_offset,
                        static_cast<char*>(dsts.back().data_ptr()) + c.dst_offset, c.nbytes, 0});
  }
  fsdp_ema::ops::batched_copy_cuda(segments, at::Device(at::kCUDA, 0));
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    const at::Tensor& d = dsts[i];
    SCOPED_TRACE(::testing::Message() << "src offset " << c.src_offset << ", dst offset "
                                      << c.dst_offset << ", " << c.nbytes << " bytes");
    EXPECT_TRUE(
        at::equal(d.narrow(0, c.dst_offset, c.nbytes), srcs[i].narrow(0, c.src_offset, c.nbytes)));
    EXPECT_TRUE(at::equal(d.narrow(0, 0, c.dst_offset), before[i].narrow(0, 0, c.dst_offset)))
        << "wrote before the destination";
    const int64_t end = c.dst_offset + c.nbytes;
    EXPECT_TRUE(
        at::equal(d.narrow(0, end, d.numel() - end), before[i].narrow(0, end, d.numel() - end)))
        << "wrote past the destination";
  }
}

TEST(CudaBatchedCopy, EveryAlignmentPairAndShortLengths) {
  if (!fsdp_ema::testing::cuda_available()) GTEST_SKIP() << "no CUDA device";
  std::vector<Case> cases;
  for (int64_t s = 0; s < 16; ++s) {
    for (int64_t d = 0; d < 16; ++d) {
      for (const int64_t n : {1, 3, 15, 16, 17, 33, 4099}) cases.push_back({s, d, n});
    }
  }
  run_cases(cases, 0);  // 1,792 segments: two table-fill launches, one copy launch
}

TEST(CudaBatchedCopy, LengthsAroundTheBlockSize) {
  if (!fsdp_ema::testing::cuda_available()) GTEST_SKIP() << "no CUDA device";
  constexpr int64_t kBlock = fsdp_ema::kernels::kCopyBlockBytes;
  std::vector<Case> cases;
  for (const int64_t n : {kBlock - 1, kBlock, kBlock + 1, 3 * kBlock + 5, 1000003L}) {
    for (const auto& [s, d] : std::vector<std::pair<int64_t, int64_t>>{
             {0, 0}, {0, 8}, {4, 12}, {3, 3}, {1, 2}, {7, 0}, {10, 6}}) {
      cases.push_back({s, d, n});
    }
  }
  run_cases(cases, 100);
}

TEST(CudaBatchedCopy, RunsOnTheCurrentStream) {
  if (!fsdp_ema::testing::cuda_available()) GTEST_SKIP() << "no CUDA device";
  const at::Tensor src = at::zeros({1 << 20}, kBytes);
  const at::Tensor dst = at::zeros({1 << 20}, kBytes);
  c10::cuda::getCurrentCUDAStream().synchronize();  // the zeros are written
  const c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool();
  {
    const c10::cuda::CUDAStreamGuard guard(side);
    at::cuda::sleep(200000000);  // the fill below lands only after ~0.1 s on this stream
    src.fill_(7);
    std::vector<CopySegment> segments = {{src.const_data_ptr(), dst.data_ptr(), src.numel(), 0}};
    fsdp_ema::ops::batched_copy_cuda(segments, at::Device(at::kCUDA, 0));
  }
  side.synchronize();
  EXPECT_TRUE(at::equal(dst, at::full_like(dst, 7)));
}

}  // namespace
