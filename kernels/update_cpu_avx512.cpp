// AVX-512 (F, BW, VL, DQ) build of the CPU update kernel (see update_cpu_impl.h).
#include "kernels/update_cpu_impl.h"
