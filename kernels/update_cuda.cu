#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <type_traits>

#include "kernels/device_table.cuh"
#include "kernels/update_cuda.h"
#include "kernels/update_cuda_math.cuh"

namespace fsdp_ema::kernels {
namespace {

using cuda_math::from_op;
using cuda_math::lerp;
using cuda_math::Pack;
using cuda_math::to_op;

constexpr int kThreads = 256;

template <typename E, typename M>
__device__ void update_chunk(const CudaUpdateEntry& entry, int64_t chunk, double decay) {
  // Math in fp32, or fp64 when the EMA is fp64.
  using Op = typename std::conditional<std::is_same<E, double>::value, double, float>::type;
  constexpr int V = 16 / static_cast<int>(sizeof(E) < sizeof(M) ? sizeof(E) : sizeof(M));
  // Packs each thread loads before it stores any (instruction-level parallelism): 64 bytes of the
  // wider side in flight per thread, enough outstanding loads to cover DRAM latency with a few
  // blocks per SM while the registers stay bounded (one pack at a time does not cover it).
  constexpr int kWide = static_cast<int>(sizeof(E) > sizeof(M) ? sizeof(E) : sizeof(M));
  constexpr int U = 64 / (kWide * V) > 0 ? 64 / (kWide * V) : 1;
  const Op w = ema_weight<Op>(decay);
  const Op c = Op(1) - w;
  const bool small = w < Op(0.5);
  const int64_t begin = chunk * kCudaChunk;
  const int64_t n = min(kCudaChunk, entry.numel - begin);
  E* __restrict__ ema = static_cast<E*>(entry.ema) + begin;
  const M* __restrict__ model = static_cast<const M*>(entry.model) + begin;
  // The pointers come from the device table, so the compiler cannot tell their address space:
  // without this it emits generic LD/ST instead of global LDG/STG.
  __builtin_assume(__isGlobal(ema));
  __builtin_assume(__isGlobal(model));
  auto one = [&](int64_t i) {
    ema[i] = from_op<E>(lerp<Op>(to_op<Op>(ema[i]), to_op<Op>(model[i]), w, c, small));
  };
  // Every chunk starts at the pair's own alignment (kCudaChunk is a multiple of the pack), so
  // the host's head applies to each chunk: [0, head) one by one, then whole packs, then the tail
  // [head + packs * V, n) one by one. Without a head, the tail is the whole chunk.
  int64_t head = 0, packs = 0;
  if (entry.vector_head >= 0) {
    head = min(static_cast<int64_t>(entry.vector_head), n);
    packs = (n - head) / V;
    if (threadIdx.x < head) one(threadIdx.x);  // head < V <= 8 < kThreads
  }
  E* ema_v = ema + head;
  const M* model_v = model + head;
  for (int64_t base = 0; base < packs; base += static_cast<int64_t>(kThreads) * U) {
    Pack<E, V> e[U];
    Pack<M, V> m[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t p = base + u * kThreads + threadIdx.x;
      if (p < packs) {
        e[u].load(ema_v + p * V);
        m[u].load(model_v + p * V);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t p = base + u * kThreads + threadIdx.x;
      if (p < packs) {
#pragma unroll
        for (int k = 0; k < V; ++k) {
          e[u].v[k] = from_op<E>(lerp<Op>(to_op<Op>(e[u].v[k]), to_op<Op>(m[u].v[k]), w, c, small));
        }
        e[u].store(ema_v + p * V);
      }
    }
  }
  for (int64_t i = head + packs * V + threadIdx.x; i < n; i += kThreads) one(i);
}

template <typename E>
__device__ void update_chunk_model(const CudaUpdateEntry& entry, int64_t chunk, double decay) {
  switch (entry.model_dtype) {
    case Dtype::kFloat32:
      return update_chunk<E, float>(entry, chunk, decay);
    case Dtype::kFloat64:
      return update_chunk<E, double>(entry, chunk, decay);
    case Dtype::kBFloat16:
      return update_chunk<E, __nv_bfloat16>(entry, chunk, decay);
    case Dtype::kFloat16:
      return update_chunk<E, __half>(entry, chunk, decay);
  }
}

__global__ void __launch_bounds__(kThreads)
    update_kernel(const CudaUpdateEntry* __restrict__ table, int num_entries, CudaDecay decay) {
  __shared__ int entry_index;
  const int64_t chunk = blockIdx.x;
  if (threadIdx.x == 0) entry_index = find_entry(table, num_entries, chunk);
  __syncthreads();
  const CudaUpdateEntry entry = table[entry_index];
  const double d = cuda_math::decay_value(decay);
  const int64_t local = chunk - entry.first_block;
  switch (entry.ema_dtype) {
    case Dtype::kFloat32:
      return update_chunk_model<float>(entry, local, d);
    case Dtype::kFloat64:
      return update_chunk_model<double>(entry, local, d);
    case Dtype::kBFloat16:
      return update_chunk_model<__nv_bfloat16>(entry, local, d);
    case Dtype::kFloat16:
      return update_chunk_model<__half>(entry, local, d);
  }
}

}  // namespace

int64_t cuda_table_bytes(int64_t num_entries) {
  return num_entries * static_cast<int64_t>(sizeof(CudaUpdateEntry));
}

cudaError_t launch_update_cuda(const CudaUpdateEntry* entries, int64_t num_entries,
                               int64_t total_chunks, CudaUpdateEntry* device_table, CudaDecay decay,
                               cudaStream_t stream) {
  if (num_entries == 0 || total_chunks == 0) return cudaSuccess;
  if (total_chunks > 0x7fffffffLL) return cudaErrorInvalidConfiguration;
  const cudaError_t err = upload_table(entries, num_entries, device_table, stream);
  if (err != cudaSuccess) return err;
  update_kernel<<<static_cast<unsigned>(total_chunks), kThreads, 0, stream>>>(
      device_table, static_cast<int>(num_entries), decay);
  return cudaGetLastError();
}

}  // namespace fsdp_ema::kernels
