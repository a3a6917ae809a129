// Internal: the body of one per-ISA XXH3 translation unit. Define FSDP_EMA_XXH3_OPS_NAME to the
// Xxh3Ops object to define, then include this file once. xxhash is compiled inline (all of its
// symbols static), so the per-ISA copies never clash and libxxhash is not needed at run time.
#define XXH_INLINE_ALL
#include <xxhash.h>

#include <new>

#include "fsdp_ema/format/xxh3_blocks_impl.h"
#include "fsdp_ema/format/xxh3_ops.h"

static_assert(fsdp_ema::format::detail::kUnitBytes == fsdp_ema::format::detail::kXxh3UnitBytes);

namespace fsdp_ema::format::detail {
namespace {

uint64_t oneshot(const void* data, size_t size) { return XXH3_64bits(data, size); }

uint64_t seeded(const void* data, size_t size, uint64_t seed) {
  return XXH3_64bits_withSeed(data, size, seed);
}

void* create() {
  XXH3_state_t* s = XXH3_createState();
  if (s == nullptr) throw std::bad_alloc();
  XXH3_64bits_reset(s);
  return s;
}

void destroy(void* state) { XXH3_freeState(static_cast<XXH3_state_t*>(state)); }

void reset(void* state) { XXH3_64bits_reset(static_cast<XXH3_state_t*>(state)); }

void update(void* state, const void* data, size_t size) {
  XXH3_64bits_update(static_cast<XXH3_state_t*>(state), data, size);
}

uint64_t digest(const void* state) {
  return XXH3_64bits_digest(static_cast<const XXH3_state_t*>(state));
}

}  // namespace

extern const Xxh3Ops FSDP_EMA_XXH3_OPS_NAME = {oneshot,     seeded,     create,     destroy,
                                               reset,       update,     digest,     lanes_init,
                                               lanes_units, lanes_tail, lanes_merge};

}  // namespace fsdp_ema::format::detail
