#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstring>
#include <type_traits>
#include <vector>

#include "kernels/device_table.cuh"
#include "kernels/update_cuda.h"
#include "kernels/update_cuda_math.cuh"

namespace fsdp_ema::kernels {
namespace {

using cuda_math::from_op;
using cuda_math::Pack;
using cuda_math::to_op;

constexpr int kThreads = 256;

// The decay a launch uses: its host value, or the 0-dim device tensor it points at.
__device__ __forceinline__ double decay_value(const CudaDecay& decay) {
  const void* p = decay.device_ptr;
  if (p == nullptr) return decay.value;
  __builtin_assume(__isGlobal(p));  // a device tensor: a global load, not a generic one
  return decay.device_is_double ? *static_cast<const double*>(p)
                                : static_cast<double>(*static_cast<const float*>(p));
}

template <int K, typename E, typename M>
__device__ void update_chunk(const CudaUpdateEntry<K>& entry, int64_t chunk,
                             const CudaDecay* __restrict__ decays) {
  // Math in fp32, or fp64 when the EMA is fp64.
  using Op = typename std::conditional<std::is_same<E, double>::value, double, float>::type;
  constexpr int V = 16 / static_cast<int>(sizeof(E) < sizeof(M) ? sizeof(E) : sizeof(M));
  // Packs each thread loads before it stores any (instruction-level parallelism): 64 bytes of the
  // wider side in flight per thread, enough outstanding loads to cover DRAM latency with a few
  // blocks per SM while the registers stay bounded. The model packs stay in registers while the
  // EMAs are streamed one profile at a time against them, so the model is read once.
  constexpr int kWide = static_cast<int>(sizeof(E) > sizeof(M) ? sizeof(E) : sizeof(M));
  constexpr int U = 64 / (kWide * V) > 0 ? 64 / (kWide * V) : 1;
  const int count = K == 1 ? 1 : entry.count;
  Op w[K], c[K];
  bool small[K];
  E* __restrict__ ema[K];
  const int64_t begin = chunk * kCudaChunk;
  const int64_t n = min(kCudaChunk, entry.numel - begin);
#pragma unroll
  for (int j = 0; j < K; ++j) {
    if (j < count) {
      w[j] = ema_weight<Op>(decay_value(decays[K == 1 ? 0 : entry.decay_index[j]]));
      c[j] = Op(1) - w[j];
      small[j] = lerp_from_ema(w[j]);
      ema[j] = static_cast<E*>(entry.ema[j]) + begin;
      // The pointers come from the device table, so the compiler cannot tell their address
      // space: without this it emits generic LD/ST instead of global LDG/STG.
      __builtin_assume(__isGlobal(ema[j]));
    }
  }
  const M* __restrict__ model = static_cast<const M*>(entry.model) + begin;
  __builtin_assume(__isGlobal(model));
  auto one = [&](int64_t i) {
    const Op m = to_op<Op>(model[i]);
#pragma unroll
    for (int j = 0; j < K; ++j) {
      if (j < count) {
        E* e = ema[j];
        __builtin_assume(__isGlobal(e));  // per use: an array element's assumption is lost
        e[i] = from_op<E>(lerp_two_sided<Op>(to_op<Op>(e[i]), m, w[j], c[j], small[j]));
      }
    }
  };
  // Every chunk starts at the tensor's own alignment (kCudaChunk is a multiple of the pack), so
  // the host's head applies to each chunk: [0, head) one by one, then whole packs, then the tail
  // [head + packs * V, n) one by one. Without a head, the tail is the whole chunk.
  int64_t head = 0, packs = 0;
  if (entry.vector_head >= 0) {
    head = min(static_cast<int64_t>(entry.vector_head), n);
    packs = (n - head) / V;
    if (threadIdx.x < head) one(threadIdx.x);  // head < V <= 8 < kThreads
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
    for (int j = 0; j < K; ++j) {
      if (j >= count) break;
      E* ema_v = ema[j] + head;
      __builtin_assume(__isGlobal(ema_v));
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
            e[u].v[k] = from_op<E>(lerp_two_sided<Op>(to_op<Op>(e[u].v[k]), to_op<Op>(m[u].v[k]),
                                                      w[j], c[j], small[j]));
          }
          e[u].store(ema_v + p * V);
        }
      }
    }
  }
  for (int64_t i = head + packs * V + threadIdx.x; i < n; i += kThreads) one(i);
}

template <int K>
__global__ void __launch_bounds__(kThreads)
    update_kernel(const CudaUpdateEntry<K>* __restrict__ table, int num_entries,
                  const CudaDecay* __restrict__ decays) {
  __shared__ int entry_index;
  const int64_t chunk = blockIdx.x;
  if (threadIdx.x == 0) entry_index = find_entry(table, num_entries, chunk);
  __syncthreads();
  const CudaUpdateEntry<K> entry = table[entry_index];
  const int64_t local = chunk - entry.first_block;
  cuda_math::visit_update_type(entry.ema_dtype, [&](auto ema_tag) {
    using E = typename decltype(ema_tag)::type;
    cuda_math::visit_update_type(entry.model_dtype, [&](auto model_tag) {
      update_chunk<K, E, typename decltype(model_tag)::type>(entry, local, decays);
    });
  });
}

int64_t entries_bytes(int k, int64_t num_entries) {
  // Rounded up to 16 bytes so the decays that follow are aligned.
  const int64_t entry =
      k == 1 ? sizeof(CudaUpdateEntry<1>) : sizeof(CudaUpdateEntry<kCudaMaxProfiles>);
  return (num_entries * entry + 15) / 16 * 16;
}

}  // namespace

int64_t cuda_update_table_bytes(int k, int64_t num_entries, int64_t num_decays) {
  return (entries_bytes(k, num_entries) + num_decays * static_cast<int64_t>(sizeof(CudaDecay)) +
          15) /
         16 * 16;
}

template <int K>
cudaError_t launch_update_cuda(const CudaUpdateEntry<K>* entries, int64_t num_entries,
                               const CudaDecay* decays, int64_t num_decays, int64_t total_chunks,
                               void* device_table, cudaStream_t stream) {
  static_assert(K == 1 || K == kCudaMaxProfiles, "instantiated for update_ and update_multi_");
  if (num_entries == 0 || total_chunks == 0) return cudaSuccess;
  if (total_chunks > 0x7fffffffLL) return cudaErrorInvalidConfiguration;
  // Entries and decays as one run of 8-byte words: one upload (one fill launch per 32 KB).
  const int64_t bytes = cuda_update_table_bytes(K, num_entries, num_decays);
  std::vector<uint64_t> words(static_cast<size_t>(bytes / 8), 0);
  auto* blob = reinterpret_cast<std::byte*>(words.data());
  std::memcpy(blob, entries, static_cast<size_t>(num_entries) * sizeof(CudaUpdateEntry<K>));
  const int64_t decays_at = entries_bytes(K, num_entries);
  std::memcpy(blob + decays_at, decays, static_cast<size_t>(num_decays) * sizeof(CudaDecay));
  const cudaError_t err = upload_table(words.data(), static_cast<int64_t>(words.size()),
                                       static_cast<uint64_t*>(device_table), stream);
  if (err != cudaSuccess) return err;
  update_kernel<K><<<static_cast<unsigned>(total_chunks), kThreads, 0, stream>>>(
      static_cast<const CudaUpdateEntry<K>*>(device_table), static_cast<int>(num_entries),
      reinterpret_cast<const CudaDecay*>(static_cast<const std::byte*>(device_table) + decays_at));
  return cudaGetLastError();
}

template cudaError_t launch_update_cuda<1>(const CudaUpdateEntry<1>*, int64_t, const CudaDecay*,
                                           int64_t, int64_t, void*, cudaStream_t);
template cudaError_t launch_update_cuda<kCudaMaxProfiles>(const CudaUpdateEntry<kCudaMaxProfiles>*,
                                                          int64_t, const CudaDecay*, int64_t,
                                                          int64_t, void*, cudaStream_t);

}  // namespace fsdp_ema::kernels
