// CUDA host side of update_ and update_multi_ (one kernel, kernels/update_cuda.h: update_ is
// K = 1): builds the device table and launches on the current stream. No host synchronization
// anywhere, so both run inside CUDA-graph capture.
#include "kernels/update_cuda.h"

#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/irange.h>

#include <algorithm>
#include <string>
#include <vector>

#include "ops/common/format_bridge.h"
#include "ops/common/memory.h"
#include "ops/update/update.h"

namespace fsdp_ema::ops {
namespace {

constexpr const char* kOp = "fsdp_ema::update_: ";
constexpr const char* kMultiOp = "fsdp_ema::update_multi_: ";

// Elements to update one by one before ema and model are both 16-byte aligned, or -1 when no such
// count below the pack width exists (their offsets disagree modulo the pack): then the kernel
// updates the pair element by element. Only a pack-width's worth of candidates is tried.
int8_t vector_head(const at::Tensor& e, const at::Tensor& m, format::DType ed, format::DType md) {
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

// The table of a prepared call (p.ema: k lists of p.model.size() tensors, profile-major): each
// model tensor's EMAs grouped by (dtype, vector head), up to K per entry (one model read each).
// Usually every EMA of a tensor lands in one group; k is small (quadratic in k, linear in
// tensors). Returns the number of blocks.
template <int K>
int64_t build_table(const PreparedUpdate& p, size_t k,
                    std::vector<kernels::CudaUpdateEntry<K>>& entries) {
  const size_t n = p.model.size();
  entries.reserve(n * ((k + K - 1) / K));
  int64_t chunks = 0;
  std::vector<bool> placed(k);
  for (const auto i : c10::irange(n)) {
    const at::Tensor& m = p.model[i];
    const format::DType md = to_format_dtype(m.scalar_type(), "model");
    const int64_t blocks = (m.numel() + kernels::kCudaChunk - 1) / kernels::kCudaChunk;
    std::fill(placed.begin(), placed.end(), false);
    for (const auto first : c10::irange(k)) {
      if (placed[first]) continue;
      const at::Tensor& e0 = p.ema[first * n + i];
      const format::DType ed = to_format_dtype(e0.scalar_type(), "ema");
      const int8_t head = vector_head(e0, m, ed, md);
      kernels::CudaUpdateEntry<K> entry{};
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
        if (to_format_dtype(e.scalar_type(), "ema") != ed || vector_head(e, m, ed, md) != head) {
          continue;
        }
        placed[j] = true;
        entry.ema[entry.count] = e.data_ptr();
        entry.decay_index[entry.count] = static_cast<int32_t>(j);
        if (++entry.count == K) flush();
      }
      if (entry.count > 0) flush();
    }
  }
  return chunks;
}

template <int K>
void launch(const PreparedUpdate& p, const std::vector<kernels::CudaDecay>& decays,
            const at::TensorOptions& options) {
  std::vector<kernels::CudaUpdateEntry<K>> entries;
  const int64_t chunks = build_table<K>(p, decays.size(), entries);
  if (entries.empty()) return;
  // The table comes from the caching allocator on the current stream (a graph's private pool
  // while capturing), so it lives exactly as long as the kernels that read it.
  const at::Tensor table =
      at::empty({kernels::cuda_update_table_bytes(K, static_cast<int64_t>(entries.size()),
                                                  static_cast<int64_t>(decays.size()))},
                options.dtype(at::kByte));
  C10_CUDA_CHECK(
      kernels::launch_update_cuda<K>(entries.data(), static_cast<int64_t>(entries.size()),
                                     decays.data(), static_cast<int64_t>(decays.size()), chunks,
                                     table.data_ptr(), at::cuda::getCurrentCUDAStream()));
}

// A validated call: `ema` holds decays.size() lists of model.size() tensors, profile-major.
// `keep` holds device decay tensors widened to float: the caching allocator keeps them until the
// stream is done with them.
void run_cuda(const char* op, at::TensorList ema, at::TensorList model,
              const std::vector<kernels::CudaDecay>& decays, const std::vector<at::Tensor>& keep) {
  TORCH_CHECK(ema[0].is_cuda(), op, "the CUDA kernel got tensors on ", ema[0].device());
  const c10::cuda::CUDAGuard guard(ema[0].device());
  bump_versions(ema);
  PreparedUpdate p = prepare_update_multi(ema, model);
  if (decays.size() == 1) {
    launch<1>(p, decays, ema[0].options());
  } else {
    launch<kernels::kCudaMaxProfiles>(p, decays, ema[0].options());
  }
  p.finish();
  (void)keep;
}

// A 0-dim decay tensor as the kernel reads it: a host value read on the host (no device
// synchronization), or the device tensor itself (other float dtypes widened on the device first,
// asynchronously, into `keep`).
kernels::CudaDecay decay_of(const at::Tensor& t, const char* op, const std::string& name,
                            std::vector<at::Tensor>& keep) {
  if (t.device().is_cpu()) return {cpu_decay_value(t, op, name), nullptr, false};
  keep.push_back(t.scalar_type() == at::kDouble ? t : t.to(at::kFloat));
  return {0.0, keep.back().const_data_ptr(), keep.back().scalar_type() == at::kDouble};
}

}  // namespace

void update_cuda(TensorList ema, TensorList model, double decay) {
  validate_update(ema, model, decay, nullptr, UpdateChecks::kAll);
  run_cuda(kOp, ema, model, {{decay, nullptr, false}}, {});
}

void update_tensor_cuda(TensorList ema, TensorList model, const at::Tensor& decay) {
  validate_update(ema, model, std::nullopt, &decay, UpdateChecks::kAll);
  std::vector<at::Tensor> keep;
  const kernels::CudaDecay d = decay_of(decay, kOp, "decay", keep);
  run_cuda(kOp, ema, model, {d}, keep);
}

void update_multi_cuda(at::TensorList ema, at::TensorList model, c10::ArrayRef<double> decays) {
  validate_update_multi(ema, model, decays, {}, UpdateChecks::kAll);
  std::vector<kernels::CudaDecay> d;
  d.reserve(decays.size());
  for (const double v : decays) d.push_back({v, nullptr, false});
  run_cuda(kMultiOp, ema, model, d, {});
}

void update_multi_tensor_cuda(at::TensorList ema, at::TensorList model, at::TensorList decays) {
  validate_update_multi(ema, model, {}, decays, UpdateChecks::kAll);
  std::vector<kernels::CudaDecay> d;
  std::vector<at::Tensor> keep;
  d.reserve(decays.size());
  for (const auto j : c10::irange(decays.size())) {
    d.push_back(decay_of(decays[j], kMultiOp, "decays[" + std::to_string(j) + "]", keep));
  }
  run_cuda(kMultiOp, ema, model, d, keep);
}

}  // namespace fsdp_ema::ops
