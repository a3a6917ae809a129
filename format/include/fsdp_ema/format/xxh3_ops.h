// Internal: XXH3 entry points compiled once per instruction set (checksum.cpp picks one).
#pragma once

#include <cstddef>
#include <cstdint>

namespace fsdp_ema::format::detail {

struct Xxh3Ops {
  uint64_t (*oneshot)(const void* data, size_t size);
  uint64_t (*seeded)(const void* data, size_t size, uint64_t seed);
  void* (*create)();
  void (*destroy)(void* state);
  void (*reset)(void* state);
  void (*update)(void* state, const void* data, size_t size);
  uint64_t (*digest)(const void* state);
};

extern const Xxh3Ops kXxh3Default;
#if defined(FSDP_EMA_FORMAT_HAVE_AVX2)
extern const Xxh3Ops kXxh3Avx2;
#endif

}  // namespace fsdp_ema::format::detail
