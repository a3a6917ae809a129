// CUDA host side of fsdp_ema::update_: builds the device tensor table and launches on the current
// stream. No host synchronization anywhere, so it runs inside CUDA-graph capture.
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/irange.h>

#include <vector>

#include "kernels/update_cuda.h"
#include "ops/dtypes.h"
#include "ops/update.h"

namespace fsdp_ema::ops {
namespace {

bool aligned_for_vectors(const at::Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.const_data_ptr()) % (4 * t.element_size()) == 0;
}

void run_cuda(TensorList ema, TensorList model, kernels::CudaDecay decay) {
  TORCH_CHECK(ema[0].is_cuda(), "fsdp_ema::update_: the CUDA kernel got tensors on ",
              ema[0].device());
  const c10::cuda::CUDAGuard guard(ema[0].device());
  PreparedUpdate p = prepare_update(ema, model);
  std::vector<kernels::CudaUpdateEntry> entries;
  entries.reserve(p.ema.size());
  int64_t chunks = 0;
  for (const auto i : c10::irange(p.ema.size())) {
    const at::Tensor& e = p.ema[i];
    const at::Tensor& m = p.model[i];
    entries.push_back({e.data_ptr(), m.const_data_ptr(), e.numel(), chunks,
                       to_kernel_dtype(e.scalar_type()), to_kernel_dtype(m.scalar_type()),
                       aligned_for_vectors(e) && aligned_for_vectors(m)});
    chunks += (e.numel() + kernels::kCudaChunk - 1) / kernels::kCudaChunk;
  }
  if (!entries.empty()) {
    // The table comes from the caching allocator on the current stream (a graph's private pool
    // while capturing), so it lives exactly as long as the kernels that read it.
    const at::Tensor table =
        at::empty({kernels::cuda_table_bytes(static_cast<int64_t>(entries.size()))},
                  ema[0].options().dtype(at::kByte));
    C10_CUDA_CHECK(kernels::launch_update_cuda(
        entries.data(), static_cast<int64_t>(entries.size()), chunks,
        static_cast<kernels::CudaUpdateEntry*>(table.data_ptr()), decay,
        at::cuda::getCurrentCUDAStream()));
  }
  p.finish();
}

}  // namespace

void update_cuda(TensorList ema, TensorList model, double decay) {
  validate_update(ema, model, decay, nullptr, UpdateChecks::kAll);
  run_cuda(ema, model, {decay, nullptr, false});
}

void update_tensor_cuda(TensorList ema, TensorList model, const at::Tensor& decay) {
  validate_update(ema, model, std::nullopt, &decay, UpdateChecks::kAll);
  if (decay.device().is_cpu()) {
    // A host tensor is read on the host: no device synchronization is involved.
    run_cuda(ema, model, {cpu_decay_value(decay), nullptr, false});
    return;
  }
  // Read by the kernel itself; other float dtypes are widened on the device first (async).
  const at::Tensor d = decay.scalar_type() == at::kDouble ? decay : decay.to(at::kFloat);
  run_cuda(ema, model, {0.0, d.const_data_ptr(), d.scalar_type() == at::kDouble});
}

}  // namespace fsdp_ema::ops
