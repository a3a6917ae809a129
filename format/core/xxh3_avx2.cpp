// XXH3 compiled with -mavx2 (see format/CMakeLists.txt); used only when the CPU has AVX2.
#define FSDP_EMA_XXH3_OPS_NAME kXxh3Avx2
#include "fsdp_ema/format/xxh3_ops_impl.h"
