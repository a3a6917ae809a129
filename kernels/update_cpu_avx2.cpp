// AVX2 + FMA + F16C build of the CPU update kernel (see update_cpu_impl.h).
#include "kernels/update_cpu_impl.h"
