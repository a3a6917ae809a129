// Internal: XXH3 entry points compiled once per instruction set (checksum.cpp picks one).
#pragma once

#include <cstddef>
#include <cstdint>

namespace fsdp_ema::format::detail {

// XXH3's unit with the default secret: 16 stripes of 64 bytes (xxh3_blocks_impl.h).
inline constexpr size_t kXxh3UnitBytes = 1024;

struct Xxh3Ops {
  uint64_t (*oneshot)(const void* data, size_t size);
  uint64_t (*seeded)(const void* data, size_t size, uint64_t seed);
  void* (*create)();
  void (*destroy)(void* state);
  void (*reset)(void* state);
  void (*update)(void* state, const void* data, size_t size);
  uint64_t (*digest)(const void* state);

  // One pass for XXH3-64 of an input longer than 240 bytes and of its blocks (TensorHasher; the
  // rule in xxh3_blocks_impl.h). Lanes are 8 uint64_t.
  // The lanes of a fresh hash.
  void (*lanes_init)(uint64_t* lanes);
  // `count` (> 0) whole units at `data`, none of them the input's last, into the whole input's
  // lanes and their block's; with `block_end` the last of them is its block's last unit, after
  // which the block's lanes are ready for lanes_merge.
  void (*lanes_units)(uint64_t* whole, uint64_t* block, const void* data, size_t count,
                      bool block_end);
  // The input's last unit, `rem` bytes in [1, kXxh3UnitBytes] at `unit`, into `lanes`;
  // `last_stripe`: the input's last 64 bytes.
  void (*lanes_tail)(uint64_t* lanes, const void* unit, size_t rem, const void* last_stripe);
  // The hash of `nbytes` (> 240) bytes from its lanes.
  uint64_t (*lanes_merge)(const uint64_t* lanes, uint64_t nbytes);
};

extern const Xxh3Ops kXxh3Default;
#if defined(FSDP_EMA_FORMAT_HAVE_AVX2)
extern const Xxh3Ops kXxh3Avx2;
#endif

}  // namespace fsdp_ema::format::detail
