// CUDA host side of fsdp_ema::update_: builds the device tensor table and launches on the current
// stream. No host synchronization anywhere, so it runs inside CUDA-graph capture.
#include "kernels/update_cuda.h"

#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/irange.h>

#include <vector>

#include "ops/dtypes.h"
#include "ops/memory.h"
#include "ops/update.h"
#include "ops/update_cuda.h"

namespace fsdp_ema::ops {

// Elements to update one by one before ema and model are both 16-byte aligned, or -1 when no such
// count below the pack width exists (their offsets disagree modulo the pack): then the kernel
// updates the pair element by element. Only a pack-width's worth of candidates is tried.
int8_t cuda_vector_head(const at::Tensor& e, const at::Tensor& m, kernels::Dtype ed,
                        kernels::Dtype md) {
  const auto ea = reinterpret_cast<uintptr_t>(e.const_data_ptr());
  const auto ma = reinterpret_cast<uintptr_t>(m.const_data_ptr());
  const int pack = kernels::cuda_pack_elements(ed, md);
  for (int h = 0; h < pack; ++h) {
    if ((ea + h * e.element_size()) % 16 == 0 && (ma + h * m.element_size()) % 16 == 0) {
      return static_cast<int8_t>(h);
    }
  }
  return -1;
}

namespace {

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
    const kernels::Dtype ed = to_kernel_dtype(e.scalar_type());
    const kernels::Dtype md = to_kernel_dtype(m.scalar_type());
    entries.push_back({e.data_ptr(), m.const_data_ptr(), e.numel(), chunks, ed, md,
                       cuda_vector_head(e, m, ed, md)});
    chunks += (e.numel() + kernels::kCudaChunk - 1) / kernels::kCudaChunk;
  }
  if (!entries.empty()) {
    // The table comes from the caching allocator on the current stream (a graph's private pool
    // while capturing), so it lives exactly as long as the kernels that read it.
    const at::Tensor table =
        at::empty({kernels::cuda_table_bytes(static_cast<int64_t>(entries.size()))},
                  ema[0].options().dtype(at::kByte));
    C10_CUDA_CHECK(
        kernels::launch_update_cuda(entries.data(), static_cast<int64_t>(entries.size()), chunks,
                                    static_cast<kernels::CudaUpdateEntry*>(table.data_ptr()), decay,
                                    at::cuda::getCurrentCUDAStream()));
  }
  p.finish();
}

}  // namespace

void update_cuda(TensorList ema, TensorList model, double decay) {
  validate_update(ema, model, decay, nullptr, UpdateChecks::kAll);
  bump_versions(ema);
  run_cuda(ema, model, {decay, nullptr, false});
}

void update_tensor_cuda(TensorList ema, TensorList model, const at::Tensor& decay) {
  validate_update(ema, model, std::nullopt, &decay, UpdateChecks::kAll);
  if (decay.device().is_cpu()) {
    // A host tensor is read on the host: no device synchronization is involved.
    const double value = cpu_decay_value(decay, "fsdp_ema::update_: ", "decay");
    bump_versions(ema);
    run_cuda(ema, model, {value, nullptr, false});
    return;
  }
  bump_versions(ema);
  // Read by the kernel itself; other float dtypes are widened on the device first (async).
  const at::Tensor d = decay.scalar_type() == at::kDouble ? decay : decay.to(at::kFloat);
  run_cuda(ema, model, {0.0, d.const_data_ptr(), d.scalar_type() == at::kDouble});
}

}  // namespace fsdp_ema::ops
