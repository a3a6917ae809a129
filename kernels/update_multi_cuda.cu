#include <type_traits>

#include "kernels/device_table.cuh"
#include "kernels/update_cuda_math.cuh"
#include "kernels/update_multi_cuda.h"

namespace fsdp_ema::kernels {
namespace {

using cuda_math::from_op;
using cuda_math::lerp;
using cuda_math::Pack;
using cuda_math::to_op;

constexpr int kThreads = 256;

template <typename E, typename M>
__device__ void update_multi_chunk(const CudaMultiEntry& entry, int64_t chunk,
                                   const CudaDecay* __restrict__ decays) {
  // Math in fp32, or fp64 when the EMA is fp64 (as update_).
  using Op = typename std::conditional<std::is_same<E, double>::value, double, float>::type;
  constexpr int V = 16 / static_cast<int>(sizeof(E) < sizeof(M) ? sizeof(E) : sizeof(M));
  // Packs in flight per thread: update_'s 64 bytes of the wider side for the model; the EMAs are
  // streamed one profile at a time against the model packs held in registers.
  constexpr int kWide = static_cast<int>(sizeof(E) > sizeof(M) ? sizeof(E) : sizeof(M));
  constexpr int U = 64 / (kWide * V) > 0 ? 64 / (kWide * V) : 1;
  const int count = entry.count;
  Op w[kCudaMaxProfiles], c[kCudaMaxProfiles];
  bool small[kCudaMaxProfiles];
  E* __restrict__ ema[kCudaMaxProfiles];
  const int64_t begin = chunk * kCudaChunk;
  const int64_t n = min(kCudaChunk, entry.numel - begin);
#pragma unroll
  for (int j = 0; j < kCudaMaxProfiles; ++j) {
    if (j < count) {
      w[j] = ema_weight<Op>(cuda_math::decay_value(decays[entry.decay_index[j]]));
      c[j] = Op(1) - w[j];
      small[j] = w[j] < Op(0.5);
      ema[j] = static_cast<E*>(entry.ema[j]) + begin;
      __builtin_assume(__isGlobal(ema[j]));
    }
  }
  const M* __restrict__ model = static_cast<const M*>(entry.model) + begin;
  __builtin_assume(__isGlobal(model));
  auto one = [&](int64_t i) {
    const Op m = to_op<Op>(model[i]);
#pragma unroll
    for (int j = 0; j < kCudaMaxProfiles; ++j) {
      if (j < count)
        ema[j][i] = from_op<E>(lerp<Op>(to_op<Op>(ema[j][i]), m, w[j], c[j], small[j]));
    }
  };
  // Head, packs and tail exactly as update_chunk (kernels/update_cuda.cu).
  int64_t head = 0, packs = 0;
  if (entry.vector_head >= 0) {
    head = min(static_cast<int64_t>(entry.vector_head), n);
    packs = (n - head) / V;
    if (threadIdx.x < head) one(threadIdx.x);
  }
  const M* model_v = model + head;
  for (int64_t base = 0; base < packs; base += static_cast<int64_t>(kThreads) * U) {
    Pack<M, V> m[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t p = base + u * kThreads + threadIdx.x;
      if (p < packs) m[u].load(model_v + p * V);
    }
#pragma unroll
    for (int j = 0; j < kCudaMaxProfiles; ++j) {
      if (j >= count) break;
      E* ema_v = ema[j] + head;
      Pack<E, V> e[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t p = base + u * kThreads + threadIdx.x;
        if (p < packs) e[u].load(ema_v + p * V);
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t p = base + u * kThreads + threadIdx.x;
        if (p < packs) {
#pragma unroll
          for (int k = 0; k < V; ++k) {
            e[u].v[k] = from_op<E>(
                lerp<Op>(to_op<Op>(e[u].v[k]), to_op<Op>(m[u].v[k]), w[j], c[j], small[j]));
          }
          e[u].store(ema_v + p * V);
        }
      }
    }
  }
  for (int64_t i = head + packs * V + threadIdx.x; i < n; i += kThreads) one(i);
}

template <typename E>
__device__ void update_multi_chunk_model(const CudaMultiEntry& entry, int64_t chunk,
                                         const CudaDecay* decays) {
  switch (entry.model_dtype) {
    case Dtype::kFloat32:
      return update_multi_chunk<E, float>(entry, chunk, decays);
    case Dtype::kFloat64:
      return update_multi_chunk<E, double>(entry, chunk, decays);
    case Dtype::kBFloat16:
      return update_multi_chunk<E, __nv_bfloat16>(entry, chunk, decays);
    case Dtype::kFloat16:
      return update_multi_chunk<E, __half>(entry, chunk, decays);
  }
}

__global__ void __launch_bounds__(kThreads)
    update_multi_kernel(const CudaMultiEntry* __restrict__ table, int num_entries,
                        const CudaDecay* __restrict__ decays) {
  __shared__ int entry_index;
  const int64_t chunk = blockIdx.x;
  if (threadIdx.x == 0) entry_index = find_entry(table, num_entries, chunk);
  __syncthreads();
  const CudaMultiEntry entry = table[entry_index];
  const int64_t local = chunk - entry.first_block;
  switch (entry.ema_dtype) {
    case Dtype::kFloat32:
      return update_multi_chunk_model<float>(entry, local, decays);
    case Dtype::kFloat64:
      return update_multi_chunk_model<double>(entry, local, decays);
    case Dtype::kBFloat16:
      return update_multi_chunk_model<__nv_bfloat16>(entry, local, decays);
    case Dtype::kFloat16:
      return update_multi_chunk_model<__half>(entry, local, decays);
  }
}

int64_t entries_bytes(int64_t num_entries) {
  // Rounded up to 16 bytes so the decays that follow are aligned.
  return (num_entries * static_cast<int64_t>(sizeof(CudaMultiEntry)) + 15) / 16 * 16;
}

}  // namespace

int64_t cuda_multi_table_bytes(int64_t num_entries, int64_t num_decays) {
  return entries_bytes(num_entries) + num_decays * static_cast<int64_t>(sizeof(CudaDecay));
}

cudaError_t launch_update_multi_cuda(const CudaMultiEntry* entries, int64_t num_entries,
                                     const CudaDecay* decays, int64_t num_decays,
                                     int64_t total_chunks, void* device_table,
                                     cudaStream_t stream) {
  if (num_entries == 0 || total_chunks == 0) return cudaSuccess;
  if (total_chunks > 0x7fffffffLL) return cudaErrorInvalidConfiguration;
  auto* table = static_cast<CudaMultiEntry*>(device_table);
  auto* device_decays =
      reinterpret_cast<CudaDecay*>(static_cast<char*>(device_table) + entries_bytes(num_entries));
  cudaError_t err = upload_table(entries, num_entries, table, stream);
  if (err != cudaSuccess) return err;
  err = upload_table(decays, num_decays, device_decays, stream);
  if (err != cudaSuccess) return err;
  update_multi_kernel<<<static_cast<unsigned>(total_chunks), kThreads, 0, stream>>>(
      table, static_cast<int>(num_entries), device_decays);
  return cudaGetLastError();
}

}  // namespace fsdp_ema::kernels
