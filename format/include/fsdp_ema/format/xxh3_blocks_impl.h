// Internal: XXH3-64 of a long input and of its blocks in one pass (TensorHasher), compiled once
// per instruction set by xxh3_ops_impl.h, after xxHash's header (whose secret and primes it uses).
//
// XXH3-64 (seed 0) of more than 240 bytes: eight 64-bit lanes accumulate the input's 64-byte
// stripes, the k-th stripe of each 1024-byte unit keyed by bytes [8k, 8k + 64) of the secret; the
// lanes are scrambled after every unit but the input's last. That last unit (1 to 1024 bytes)
// adds its full stripes but one ((rem - 1) / 64 of them) and then the input's last 64 bytes,
// keyed by kLastStripeKey; the lanes are merged with the length. A stripe adds the same amount
// to the lanes whatever they hold (swapped data plus a product of the keyed data's halves), so a
// unit's sum is computed once and added to the lanes of the whole input and to those of its block:
// a block starts at a multiple of 1024 bytes, so both see a unit with the same keys. Two hashes
// of every byte for about the work of one.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || defined(__AVX2__) || defined(__SSE2__)
#include <immintrin.h>
#endif

#if !defined(XXH_INLINE_ALL)
#error "include xxHash's header with XXH_INLINE_ALL first (xxh3_ops_impl.h does)"
#endif

namespace fsdp_ema::format::detail {
namespace {

constexpr size_t kStripeBytes = 64;
constexpr size_t kUnitStripes = 16;
constexpr size_t kUnitBytes = kUnitStripes * kStripeBytes;            // xxh3_ops.h's kXxh3UnitBytes
constexpr size_t kScrambleKey = sizeof(XXH3_kSecret) - kStripeBytes;  // 128
constexpr size_t kLastStripeKey = kScrambleKey - 7;
constexpr size_t kMergeKey = 11;
static_assert(sizeof(XXH3_kSecret) == 192);

inline uint64_t read_le64(const unsigned char* p) {
  uint64_t v;
  std::memcpy(&v, p, sizeof(v));
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
  v = __builtin_bswap64(v);
#endif
  return v;
}

// The eight lanes in registers: add a stripe, add another Lanes, scramble.
#if defined(__AVX512F__)
struct Lanes {
  __m512i v;
  static Lanes zero() { return {_mm512_setzero_si512()}; }
  static Lanes load(const uint64_t* a) { return {_mm512_loadu_si512(a)}; }
  void store(uint64_t* a) const { _mm512_storeu_si512(a, v); }
  void add(const Lanes& o) { v = _mm512_add_epi64(v, o.v); }
  void stripe(const unsigned char* p, const unsigned char* key) {
    const __m512i d = _mm512_loadu_si512(p);
    const __m512i k = _mm512_xor_si512(d, _mm512_loadu_si512(key));
    const __m512i prod = _mm512_mul_epu32(k, _mm512_srli_epi64(k, 32));
    v = _mm512_add_epi64(v, _mm512_add_epi64(_mm512_shuffle_epi32(d, _MM_PERM_BADC), prod));
  }
  void scramble(const unsigned char* key) {
    const __m512i prime = _mm512_set1_epi64(XXH_PRIME32_1);
    __m512i a =
        _mm512_xor_si512(_mm512_xor_si512(v, _mm512_srli_epi64(v, 47)), _mm512_loadu_si512(key));
    const __m512i lo = _mm512_mul_epu32(a, prime);
    const __m512i hi = _mm512_mul_epu32(_mm512_srli_epi64(a, 32), prime);
    v = _mm512_add_epi64(lo, _mm512_slli_epi64(hi, 32));
  }
};
#elif defined(__AVX2__) || defined(__SSE2__)
#if defined(__AVX2__)
using Reg = __m256i;
inline Reg reg_zero() { return _mm256_setzero_si256(); }
inline Reg reg_load(const void* p) { return _mm256_loadu_si256(static_cast<const Reg*>(p)); }
inline void reg_store(void* p, Reg r) { _mm256_storeu_si256(static_cast<Reg*>(p), r); }
inline Reg reg_add(Reg a, Reg b) { return _mm256_add_epi64(a, b); }
inline Reg reg_xor(Reg a, Reg b) { return _mm256_xor_si256(a, b); }
inline Reg reg_mul32(Reg a, Reg b) { return _mm256_mul_epu32(a, b); }
inline Reg reg_swap(Reg a) { return _mm256_shuffle_epi32(a, _MM_SHUFFLE(1, 0, 3, 2)); }
inline Reg reg_set1(uint64_t x) { return _mm256_set1_epi64x(static_cast<long long>(x)); }
#define FSDP_EMA_REG_SRLI(a, n) _mm256_srli_epi64(a, n)
#define FSDP_EMA_REG_SLLI(a, n) _mm256_slli_epi64(a, n)
#else
using Reg = __m128i;
inline Reg reg_zero() { return _mm_setzero_si128(); }
inline Reg reg_load(const void* p) { return _mm_loadu_si128(static_cast<const Reg*>(p)); }
inline void reg_store(void* p, Reg r) { _mm_storeu_si128(static_cast<Reg*>(p), r); }
inline Reg reg_add(Reg a, Reg b) { return _mm_add_epi64(a, b); }
inline Reg reg_xor(Reg a, Reg b) { return _mm_xor_si128(a, b); }
inline Reg reg_mul32(Reg a, Reg b) { return _mm_mul_epu32(a, b); }
inline Reg reg_swap(Reg a) { return _mm_shuffle_epi32(a, _MM_SHUFFLE(1, 0, 3, 2)); }
inline Reg reg_set1(uint64_t x) { return _mm_set1_epi64x(static_cast<long long>(x)); }
#define FSDP_EMA_REG_SRLI(a, n) _mm_srli_epi64(a, n)
#define FSDP_EMA_REG_SLLI(a, n) _mm_slli_epi64(a, n)
#endif
struct Lanes {
  static constexpr int kRegs = static_cast<int>(kStripeBytes / sizeof(Reg));
  Reg v[kRegs];
  static Lanes zero() {
    Lanes l;
    for (Reg& r : l.v) r = reg_zero();
    return l;
  }
  static Lanes load(const uint64_t* a) {
    Lanes l;
    for (int i = 0; i < kRegs; ++i) l.v[i] = reg_load(a + i * sizeof(Reg) / 8);
    return l;
  }
  void store(uint64_t* a) const {
    for (int i = 0; i < kRegs; ++i) reg_store(a + i * sizeof(Reg) / 8, v[i]);
  }
  void add(const Lanes& o) {
    for (int i = 0; i < kRegs; ++i) v[i] = reg_add(v[i], o.v[i]);
  }
  void stripe(const unsigned char* p, const unsigned char* key) {
    for (int i = 0; i < kRegs; ++i) {
      const Reg d = reg_load(p + i * sizeof(Reg));
      const Reg k = reg_xor(d, reg_load(key + i * sizeof(Reg)));
      const Reg prod = reg_mul32(k, FSDP_EMA_REG_SRLI(k, 32));
      v[i] = reg_add(v[i], reg_add(reg_swap(d), prod));
    }
  }
  void scramble(const unsigned char* key) {
    const Reg prime = reg_set1(XXH_PRIME32_1);
    for (int i = 0; i < kRegs; ++i) {
      const Reg a =
          reg_xor(reg_xor(v[i], FSDP_EMA_REG_SRLI(v[i], 47)), reg_load(key + i * sizeof(Reg)));
      const Reg lo = reg_mul32(a, prime);
      const Reg hi = reg_mul32(FSDP_EMA_REG_SRLI(a, 32), prime);
      v[i] = reg_add(lo, FSDP_EMA_REG_SLLI(hi, 32));
    }
  }
};
#undef FSDP_EMA_REG_SRLI
#undef FSDP_EMA_REG_SLLI
#else
struct Lanes {
  uint64_t v[8];
  static Lanes zero() { return Lanes{}; }
  static Lanes load(const uint64_t* a) {
    Lanes l;
    std::memcpy(l.v, a, sizeof(l.v));
    return l;
  }
  void store(uint64_t* a) const { std::memcpy(a, v, sizeof(v)); }
  void add(const Lanes& o) {
    for (int i = 0; i < 8; ++i) v[i] += o.v[i];
  }
  void stripe(const unsigned char* p, const unsigned char* key) {
    for (int i = 0; i < 8; ++i) {
      const uint64_t d = read_le64(p + 8 * i);
      const uint64_t k = d ^ read_le64(key + 8 * i);
      v[i ^ 1] += d;
      v[i] += (k & 0xFFFFFFFFu) * (k >> 32);
    }
  }
  void scramble(const unsigned char* key) {
    for (int i = 0; i < 8; ++i) {
      uint64_t a = v[i] ^ (v[i] >> 47) ^ read_le64(key + 8 * i);
      v[i] = a * XXH_PRIME32_1;
    }
  }
};
#endif

const unsigned char* secret() { return XXH3_kSecret; }

void lanes_init(uint64_t* lanes) {
  const uint64_t init[8] = {XXH_PRIME32_3, XXH_PRIME64_1, XXH_PRIME64_2, XXH_PRIME64_3,
                            XXH_PRIME64_4, XXH_PRIME32_2, XXH_PRIME64_5, XXH_PRIME32_1};
  std::memcpy(lanes, init, sizeof(init));
}

// The sum of the first `stripes` stripes of the unit at `p`.
inline Lanes unit_sum(const unsigned char* p, size_t stripes) {
  Lanes d = Lanes::zero();
  for (size_t s = 0; s < stripes; ++s) d.stripe(p + s * kStripeBytes, secret() + 8 * s);
  return d;
}

void lanes_units(uint64_t* whole, uint64_t* block, const void* data, size_t count, bool block_end) {
  Lanes w = Lanes::load(whole);
  Lanes b = Lanes::load(block);
  const auto* p = static_cast<const unsigned char*>(data);
  const unsigned char* last = p + (count - 1) * kUnitBytes;
  const size_t plain = block_end ? count - 1 : count;
  for (size_t u = 0; u < plain; ++u, p += kUnitBytes) {
    Lanes d = unit_sum(p, kUnitStripes);
    w.add(d);
    w.scramble(secret() + kScrambleKey);
    b.add(d);
    b.scramble(secret() + kScrambleKey);
  }
  if (block_end) {
    // The block's last unit: its 16th stripe is the block's last stripe (XXH3's own key for it),
    // and the block's lanes stay unscrambled, ready for the merge.
    const unsigned char* s16 = last + (kUnitStripes - 1) * kStripeBytes;
    Lanes d = unit_sum(last, kUnitStripes - 1);
    Lanes dw = d;
    dw.stripe(s16, secret() + 8 * (kUnitStripes - 1));
    w.add(dw);
    w.scramble(secret() + kScrambleKey);
    d.stripe(s16, secret() + kLastStripeKey);
    b.add(d);
  }
  w.store(whole);
  b.store(block);
}

void lanes_tail(uint64_t* lanes, const void* unit, size_t rem, const void* last_stripe) {
  const auto* p = static_cast<const unsigned char*>(unit);
  Lanes d = unit_sum(p, (rem - 1) / kStripeBytes);
  d.stripe(static_cast<const unsigned char*>(last_stripe), secret() + kLastStripeKey);
  d.add(Lanes::load(lanes));
  d.store(lanes);
}

uint64_t lanes_merge(const uint64_t* lanes, uint64_t nbytes) {
  const unsigned char* key = secret() + kMergeKey;
  uint64_t h = nbytes * XXH_PRIME64_1;
  for (int i = 0; i < 4; ++i) {
    const unsigned __int128 m =
        static_cast<unsigned __int128>(lanes[2 * i] ^ read_le64(key + 16 * i)) *
        (lanes[2 * i + 1] ^ read_le64(key + 16 * i + 8));
    h += static_cast<uint64_t>(m) ^ static_cast<uint64_t>(m >> 64);
  }
  h ^= h >> 37;  // XXH3's avalanche
  h *= 0x165667919E3779F9ull;
  return h ^ (h >> 32);
}

}  // namespace
}  // namespace fsdp_ema::format::detail
