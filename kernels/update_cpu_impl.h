// The CPU update kernel body, compiled once per instruction set (CPU_CAPABILITY names it, as in
// ATen) by update_cpu_default.cpp and update_cpu_avx2.cpp.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <type_traits>

#include "kernels/update_cpu.h"

#ifndef FSDP_EMA_CPU_KERNEL_NAME
#error "FSDP_EMA_CPU_KERNEL_NAME must name the per-instruction-set entry point"
#endif

namespace fsdp_ema::kernels {
inline namespace CPU_CAPABILITY {

using at::vec::Vectorized;
using FVec = Vectorized<float>;
// Elements per step: two float vectors, i.e. one full reduced-precision vector.
constexpr int64_t kStep = 2 * FVec::size();

template <typename T>
inline void load2(const T* p, FVec& a, FVec& b) {
  if constexpr (std::is_same_v<T, float>) {
    a = FVec::loadu(p);
    b = FVec::loadu(p + FVec::size());
  } else {
    at::vec::load_to_float<T>(p, a, b);
  }
}

template <typename T>
inline void store2(T* p, const FVec& a, const FVec& b) {
  if constexpr (std::is_same_v<T, float>) {
    a.store(p);
    b.store(p + FVec::size());
  } else {
    at::vec::convert_from_float<T>(a, b).store(p);
  }
}

}  // namespace CPU_CAPABILITY

// The vector loop's a * b + c: one fused multiply-add (lerp_two_sided, update_types.h).
template <>
struct LerpMath<CPU_CAPABILITY::FVec> {
  static inline CPU_CAPABILITY::FVec mul_add(const CPU_CAPABILITY::FVec& a,
                                             const CPU_CAPABILITY::FVec& b,
                                             const CPU_CAPABILITY::FVec& c) {
    return at::vec::fmadd(a, b, c);
  }
};

inline namespace CPU_CAPABILITY {

// lerp_two_sided on vectors, its side fixed per loop (the weight is one for the whole range).
template <bool kFromEma>
inline FVec lerp_vec(const FVec& e, const FVec& m, const FVec& w, const FVec& one_minus_w) {
  return lerp_two_sided<FVec>(e, m, w, one_minus_w, kFromEma);
}

template <bool kFromEma, typename E, typename M>
void lerp_float_range(E* __restrict e, const M* __restrict m, int64_t n, float w) {
  const FVec wv(w);
  const FVec cv(1.0f - w);
  int64_t i = 0;
  for (; i + kStep <= n; i += kStep) {
    FVec e0, e1, m0, m1;
    load2(e + i, e0, e1);
    load2(m + i, m0, m1);
    store2(e + i, lerp_vec<kFromEma>(e0, m0, wv, cv), lerp_vec<kFromEma>(e1, m1, wv, cv));
  }
  if (i < n) {
    // Tail through the same vector code on padded copies, so every element rounds alike.
    E et[kStep] = {};
    M mt[kStep] = {};
    const int64_t rest = n - i;
    std::copy(e + i, e + n, et);
    std::copy(m + i, m + n, mt);
    FVec e0, e1, m0, m1;
    load2(et, e0, e1);
    load2(mt, m0, m1);
    store2(et, lerp_vec<kFromEma>(e0, m0, wv, cv), lerp_vec<kFromEma>(e1, m1, wv, cv));
    std::copy(et, et + rest, e + i);
  }
}

// Any pair touching fp64: scalar loop, math in double when the EMA is fp64, else in float.
template <typename Op, typename E, typename M>
void lerp_scalar_range(E* __restrict e, const M* __restrict m, int64_t n, Op w) {
  const Op c = Op(1) - w;
  const bool from_ema = lerp_from_ema(w);
  for (int64_t i = 0; i < n; ++i) {
    e[i] = static_cast<E>(
        lerp_two_sided<Op>(static_cast<Op>(e[i]), static_cast<Op>(m[i]), w, c, from_ema));
  }
}

template <typename E, typename M>
void update_typed(void* ema, const void* model, int64_t begin, int64_t end, double decay) {
  E* e = static_cast<E*>(ema) + begin;
  const M* m = static_cast<const M*>(model) + begin;
  const int64_t n = end - begin;
  if constexpr (std::is_same_v<E, double>) {
    lerp_scalar_range<double>(e, m, n, ema_weight<double>(decay));
  } else if constexpr (std::is_same_v<M, double>) {
    lerp_scalar_range<float>(e, m, n, ema_weight<float>(decay));
  } else {
    const float w = ema_weight<float>(decay);
    if (lerp_from_ema(w)) {
      lerp_float_range<true>(e, m, n, w);
    } else {
      lerp_float_range<false>(e, m, n, w);
    }
  }
}

// Calls f(TypeTag<T>{}) with T the CPU element type of update dtype d (the dtype table's cpu_type
// column); nothing for a dtype the update does not take (the ops refuse it first).
template <typename F>
inline void visit_update_type(format::DType d, F&& f) {
  switch (d) {
#define FSDP_EMA_X(id, name, size, floating, torch, python, roles, cpu_type, cuda_type) \
  case format::DType::id:                                                               \
    if constexpr (!std::is_void_v<cpu_type>) f(TypeTag<cpu_type>{});                    \
    return;
    FSDP_EMA_DTYPES(FSDP_EMA_X)
#undef FSDP_EMA_X
  }
}

}  // namespace CPU_CAPABILITY

void FSDP_EMA_CPU_KERNEL_NAME(const UpdatePair& p, int64_t begin, int64_t end, double decay) {
  visit_update_type(p.ema_dtype, [&](auto ema_tag) {
    visit_update_type(p.model_dtype, [&](auto model_tag) {
      update_typed<typename decltype(ema_tag)::type, typename decltype(model_tag)::type>(
          p.ema, p.model, begin, end, decay);
    });
  });
}

}  // namespace fsdp_ema::kernels
