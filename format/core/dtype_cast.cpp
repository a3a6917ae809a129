#include "fsdp_ema/format/dtype_cast.h"

#include <bit>
#include <cmath>
#include <cstring>
#include <string>

#include "fsdp_ema/format/error.h"

namespace fsdp_ema::format {
namespace {

// Rounds a double to the binary format with `E` exponent bits and `M` stored mantissa bits
// (F32: 8/23, F16: 5/10, BF16: 8/7) and returns its bit pattern. Exact integer arithmetic on the
// double's significand, so there is a single rounding whatever the source.
template <int E, int M>
uint32_t encode(double x) {
  const auto bits = std::bit_cast<uint64_t>(x);
  const uint32_t sign = static_cast<uint32_t>(bits >> 63) << (E + M);
  const int dexp = static_cast<int>((bits >> 52) & 0x7ff);
  uint64_t mant = bits & ((uint64_t{1} << 52) - 1);
  constexpr uint32_t kExpAll = (uint32_t{1} << E) - 1;
  constexpr int kBias = (1 << (E - 1)) - 1;
  if (dexp == 0x7ff) {
    if (mant == 0) return sign | (kExpAll << M);  // infinity
    // NaN: keep the top payload bits, force the quiet bit so it cannot become infinity.
    const auto payload = static_cast<uint32_t>(mant >> (52 - M));
    return sign | (kExpAll << M) | payload | (uint32_t{1} << (M - 1));
  }
  if (dexp == 0 && mant == 0) return sign;  // signed zero
  // value = sig * 2^(e - 52) with sig < 2^53.
  int e;
  uint64_t sig;
  if (dexp == 0) {
    e = -1022;
    sig = mant;
    // Normalize so that the leading bit is bit 52 (e stays the unbiased exponent of bit 52).
    while ((sig & (uint64_t{1} << 52)) == 0) {
      sig <<= 1;
      --e;
    }
  } else {
    e = dexp - 1023;
    sig = mant | (uint64_t{1} << 52);
  }
  // Quantum exponent of the target at this magnitude: normal numbers keep M bits after the
  // leading one; below the smallest normal exponent the quantum is fixed (subnormals).
  constexpr int kMinExp = 1 - kBias;
  const int q_exp = (e >= kMinExp ? e : kMinExp) - M;
  const int shift = q_exp - (e - 52);  // low bits of sig to drop, >= 52 - M > 0
  uint64_t q;
  if (shift > 63) {
    q = 0;  // far below half the smallest subnormal
  } else {
    q = sig >> shift;
    const uint64_t rem = sig & ((uint64_t{1} << shift) - 1);
    const uint64_t half = uint64_t{1} << (shift - 1);
    if (rem > half || (rem == half && (q & 1))) ++q;
  }
  if (e < kMinExp) {
    // Subnormal range: q is the mantissa field; q == 2^M rounds up into the smallest normal,
    // whose bit pattern is exactly q as well.
    return sign | static_cast<uint32_t>(q);
  }
  int out_e = e;
  if (q == (uint64_t{1} << (M + 1))) {  // rounding carried into the next binade
    q >>= 1;
    ++out_e;
  }
  if (out_e + kBias >= static_cast<int>(kExpAll)) return sign | (kExpAll << M);  // overflow
  return sign | (static_cast<uint32_t>(out_e + kBias) << M) |
         static_cast<uint32_t>(q & ((uint64_t{1} << M) - 1));
}

template <int E, int M>
double decode(uint32_t bits) {
  constexpr uint32_t kExpAll = (uint32_t{1} << E) - 1;
  constexpr int kBias = (1 << (E - 1)) - 1;
  const bool neg = (bits >> (E + M)) & 1;
  const uint32_t exp = (bits >> M) & kExpAll;
  const uint32_t mant = bits & ((uint32_t{1} << M) - 1);
  double v;
  if (exp == kExpAll) {
    if (mant == 0) {
      v = INFINITY;
    } else {
      // Keep the payload in the top mantissa bits of a quiet double NaN.
      const uint64_t d =
          (uint64_t{0x7ff} << 52) | (uint64_t{1} << 51) | (static_cast<uint64_t>(mant) << (52 - M));
      v = std::bit_cast<double>(d);
    }
  } else if (exp == 0) {
    v = std::ldexp(static_cast<double>(mant), 1 - kBias - M);
  } else {
    v = std::ldexp(static_cast<double>(mant | (uint32_t{1} << M)),
                   static_cast<int>(exp) - kBias - M);
  }
  return neg ? -v : v;
}

double load(DType t, const std::byte* p) {
  switch (t) {
    case DType::kF64: {
      double v;
      std::memcpy(&v, p, 8);
      return v;
    }
    case DType::kF32: {
      float v;
      std::memcpy(&v, p, 4);
      return static_cast<double>(v);
    }
    case DType::kF16: {
      uint16_t b;
      std::memcpy(&b, p, 2);
      return decode<5, 10>(b);
    }
    case DType::kBF16: {
      uint16_t b;
      std::memcpy(&b, p, 2);
      return decode<8, 7>(b);
    }
    default:
      return 0;
  }
}

void store(DType t, double v, std::byte* p) {
  switch (t) {
    case DType::kF64:
      std::memcpy(p, &v, 8);
      break;
    case DType::kF32: {
      const auto b = encode<8, 23>(v);
      std::memcpy(p, &b, 4);
      break;
    }
    case DType::kF16: {
      const auto b = static_cast<uint16_t>(encode<5, 10>(v));
      std::memcpy(p, &b, 2);
      break;
    }
    case DType::kBF16: {
      const auto b = static_cast<uint16_t>(encode<8, 7>(v));
      std::memcpy(p, &b, 2);
      break;
    }
    default:
      break;
  }
}

// F32 -> BF16 on the float's bits. Both results are computed, then selected rather than
// branched on, so that cast_elements' loop over it vectorizes (an export casts hundreds of
// millions of elements).
inline uint16_t bf16_of_f32_bits(uint32_t bits) {
  // NaN: keep sign and payload, quiet.
  const uint32_t nan = (bits >> 16) | 0x0040;
  // Round to nearest even on the 16 dropped bits; a carry into the exponent is correct
  // (up to infinity).
  const uint32_t rounded = (bits + 0x7fff + ((bits >> 16) & 1)) >> 16;
  return static_cast<uint16_t>((bits & 0x7fffffff) > 0x7f800000 ? nan : rounded);
}

bool castable(DType t) { return has_role(t, kRoleCast); }

}  // namespace

bool can_cast(DType from, DType to) { return castable(from) && castable(to); }

void cast_elements(DType from, const void* src, DType to, void* dst, size_t count) {
  if (!can_cast(from, to)) {
    throw FormatError("cast from " + std::string(dtype_name(from)) + " to " +
                      std::string(dtype_name(to)) + " is not supported (" +
                      dtype_names_with_role(kRoleCast, "/") + " only)");
  }
  const auto* s = static_cast<const std::byte*>(src);
  auto* d = static_cast<std::byte*>(dst);
  if (from == to) {
    std::memcpy(d, s, count * dtype_size(from));
    return;
  }
  if (from == DType::kF32 && to == DType::kBF16) {
    for (size_t i = 0; i < count; ++i) {
      uint32_t bits;
      std::memcpy(&bits, s + 4 * i, 4);
      const uint16_t b = bf16_of_f32_bits(bits);
      std::memcpy(d + 2 * i, &b, 2);
    }
    return;
  }
  if (to == DType::kF64 || (to == DType::kF32 && from != DType::kF64)) {
    // Widening is exact.
    const size_t ss = dtype_size(from), ds = dtype_size(to);
    for (size_t i = 0; i < count; ++i) {
      const double v = load(from, s + ss * i);
      if (to == DType::kF64) {
        std::memcpy(d + ds * i, &v, 8);
      } else {
        const auto f = static_cast<float>(v);  // exact: v came from a narrower format
        std::memcpy(d + ds * i, &f, 4);
      }
    }
    return;
  }
  const size_t ss = dtype_size(from), ds = dtype_size(to);
  for (size_t i = 0; i < count; ++i) store(to, load(from, s + ss * i), d + ds * i);
}

}  // namespace fsdp_ema::format
