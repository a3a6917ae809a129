// XXH3 for the baseline instruction set (SSE2 on x86-64, NEON on arm64).
#define FSDP_EMA_XXH3_OPS_NAME kXxh3Default
#include "fsdp_ema/format/xxh3_ops_impl.h"
