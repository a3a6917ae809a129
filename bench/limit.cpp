// Memory-bandwidth ceiling for the EMA update: ema[i] += w * (model[i] - ema[i]) over one
// contiguous buffer with a plain OpenMP loop (no dispatcher, no tensor list, no validation).
// bench_update.py loads this with ctypes and times it interleaved with the other rows, on buffers
// torch allocated, so every row sees the same machine state.
#include <cstdint>
#include <cstring>

namespace {

inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

}  // namespace

extern "C" {

void fsdp_ema_limit_f32(float* ema, const float* model, int64_t n, float w) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) ema[i] += w * (model[i] - ema[i]);
}

void fsdp_ema_limit_bf16(float* ema, const uint16_t* model, int64_t n, float w) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) ema[i] += w * (bf16_to_float(model[i]) - ema[i]);
}

}  // extern "C"
