// CUDA host side of fsdp_ema::update_multi_: one device table for every (model tensor, group of
// its EMAs), one launch on the current stream, no host synchronization (CUDA-graph capturable).
#include "kernels/update_multi_cuda.h"

#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/irange.h>

#include <string>
#include <vector>

#include "ops/dtypes.h"
#include "ops/memory.h"
#include "ops/update.h"
#include "ops/update_cuda.h"
#include "ops/update_multi.h"

namespace fsdp_ema::ops {
namespace {

constexpr const char* kOp = "fsdp_ema::update_multi_: ";

void run_cuda(at::TensorList ema, at::TensorList model,
              const std::vector<kernels::CudaDecay>& decays, const std::vector<at::Tensor>& keep) {
  TORCH_CHECK(ema[0].is_cuda(), kOp, "the CUDA kernel got tensors on ", ema[0].device());
  const c10::cuda::CUDAGuard guard(ema[0].device());
  PreparedUpdate p = prepare_update_multi(ema, model);
  const size_t n = p.model.size();
  const size_t k = decays.size();
  std::vector<kernels::CudaMultiEntry> entries;
  entries.reserve(n * ((k + kernels::kCudaMaxProfiles - 1) / kernels::kCudaMaxProfiles));
  int64_t chunks = 0;
  std::vector<bool> placed(k);
  for (const auto i : c10::irange(n)) {
    const at::Tensor& m = p.model[i];
    const kernels::Dtype md = to_kernel_dtype(m.scalar_type());
    const int64_t blocks = (m.numel() + kernels::kCudaChunk - 1) / kernels::kCudaChunk;
    // The tensor's EMAs grouped by (dtype, vector head): one entry (one model read) per group of
    // up to kCudaMaxProfiles. Usually every EMA lands in one group; K is small (quadratic in K,
    // linear in tensors).
    std::fill(placed.begin(), placed.end(), false);
    for (const auto first : c10::irange(k)) {
      if (placed[first]) continue;
      const at::Tensor& e0 = p.ema[first * n + i];
      const kernels::Dtype ed = to_kernel_dtype(e0.scalar_type());
      const int8_t head = cuda_vector_head(e0, m, ed, md);
      kernels::CudaMultiEntry entry{};
      entry.model = m.const_data_ptr();
      entry.numel = m.numel();
      entry.ema_dtype = ed;
      entry.model_dtype = md;
      entry.vector_head = head;
      auto flush = [&] {
        entry.first_block = chunks;
        chunks += blocks;
        entries.push_back(entry);
        entry.count = 0;
      };
      for (size_t j = first; j < k; ++j) {
        if (placed[j]) continue;
        const at::Tensor& e = p.ema[j * n + i];
        if (to_kernel_dtype(e.scalar_type()) != ed || cuda_vector_head(e, m, ed, md) != head) {
          continue;
        }
        placed[j] = true;
        entry.ema[entry.count] = e.data_ptr();
        entry.decay_index[entry.count] = static_cast<int32_t>(j);
        if (++entry.count == kernels::kCudaMaxProfiles) flush();
      }
      if (entry.count > 0) flush();
    }
  }
  if (!entries.empty()) {
    // From the caching allocator on the current stream: lives as long as the kernel reading it.
    const at::Tensor table =
        at::empty({kernels::cuda_multi_table_bytes(static_cast<int64_t>(entries.size()),
                                                   static_cast<int64_t>(k))},
                  ema[0].options().dtype(at::kByte));
    C10_CUDA_CHECK(kernels::launch_update_multi_cuda(
        entries.data(), static_cast<int64_t>(entries.size()), decays.data(),
        static_cast<int64_t>(k), chunks, table.data_ptr(), at::cuda::getCurrentCUDAStream()));
  }
  p.finish();
  (void)keep;  // widened decay copies: the caching allocator keeps them until the stream is done
}

}  // namespace

void update_multi_cuda(at::TensorList ema, at::TensorList model, c10::ArrayRef<double> decays) {
  validate_update_multi(ema, model, decays, {}, UpdateChecks::kAll);
  std::vector<kernels::CudaDecay> d;
  d.reserve(decays.size());
  for (const double v : decays) d.push_back({v, nullptr, false});
  bump_versions(ema);
  run_cuda(ema, model, d, {});
}

void update_multi_tensor_cuda(at::TensorList ema, at::TensorList model, at::TensorList decays) {
  validate_update_multi(ema, model, {}, decays, UpdateChecks::kAll);
  std::vector<kernels::CudaDecay> d;
  std::vector<at::Tensor> keep;
  d.reserve(decays.size());
  for (const auto j : c10::irange(decays.size())) {
    const at::Tensor& t = decays[j];
    if (t.device().is_cpu()) {
      // A host tensor is read on the host: no device synchronization is involved.
      d.push_back({cpu_decay_value(t, kOp, "decays[" + std::to_string(j) + "]"), nullptr, false});
      continue;
    }
    // Read by the kernel itself; other float dtypes are widened on the device first (async).
    keep.push_back(t.scalar_type() == at::kDouble ? t : t.to(at::kFloat));
    d.push_back({0.0, keep.back().const_data_ptr(), keep.back().scalar_type() == at::kDouble});
  }
  bump_versions(ema);
  run_cuda(ema, model, d, keep);
}

}  // namespace fsdp_ema::ops
