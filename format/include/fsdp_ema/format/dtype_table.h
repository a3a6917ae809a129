// The one table of element types. Every map between our dtype enum, safetensors' names, torch's
// ScalarType and Python names, every per-dtype switch of the update kernels, and what Python
// learns of dtypes (torch.ops.fsdp_ema.dtypes) is generated from it: a second map anywhere is a
// bug (scripts/lint.sh looks for one). Dependency-free, so format/ (torch-free), the CUDA kernels
// (no ATen) and the ops (torch) all include it; a column naming a torch or CUDA entity is only
// expanded where that entity exists.
//
// X(id, name, size, floating, torch, python, roles, cpu_type, cuda_type):
//   id         the format::DType enumerator (its order is the enum's; never written to disk)
//   name       the safetensors name ("F32"); its lower case is the CLI's --dtype spelling
//   size       bytes per element
//   floating   a floating-point type
//   torch      the c10::ScalarType enumerator (Float)
//   python     the attribute of the torch module (torch.float32)
//   roles      the parts it may play (kRoleEma | kRoleModel | kRoleCast; every one is storable)
//   cpu_type   the update kernels' element type on the CPU (void: not an update dtype)
//   cuda_type  the same on CUDA
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace fsdp_ema::format {

enum DTypeRole : uint8_t {
  kRoleEma = 1,    // an EMA tensor's dtype (update_, ShardedEMA(dtype=))
  kRoleModel = 2,  // a model tensor the update reads
  kRoleCast = 4,   // a target of the export casts (--dtype, ShardedEMA.export(dtype=))
};

}  // namespace fsdp_ema::format

// clang-format off
#define FSDP_EMA_DTYPES(X)                                                                    \
  X(kF64,    "F64",     8, true,  Double,         "float64",       kRoleEma | kRoleModel | kRoleCast, double,        double)          \
  X(kF32,    "F32",     4, true,  Float,          "float32",       kRoleEma | kRoleModel | kRoleCast, float,         float)           \
  X(kF16,    "F16",     2, true,  Half,           "float16",       kRoleEma | kRoleModel | kRoleCast, c10::Half,     __half)          \
  X(kBF16,   "BF16",    2, true,  BFloat16,       "bfloat16",      kRoleEma | kRoleModel | kRoleCast, c10::BFloat16, __nv_bfloat16)   \
  X(kI64,    "I64",     8, false, Long,           "int64",         0,                                 void,          void)            \
  X(kI32,    "I32",     4, false, Int,            "int32",         0,                                 void,          void)            \
  X(kI16,    "I16",     2, false, Short,          "int16",         0,                                 void,          void)            \
  X(kI8,     "I8",      1, false, Char,           "int8",          0,                                 void,          void)            \
  X(kU8,     "U8",      1, false, Byte,           "uint8",         0,                                 void,          void)            \
  X(kBool,   "BOOL",    1, false, Bool,           "bool",          0,                                 void,          void)            \
  X(kF8E4M3, "F8_E4M3", 1, true,  Float8_e4m3fn,  "float8_e4m3fn", 0,                                 void,          void)            \
  X(kF8E5M2, "F8_E5M2", 1, true,  Float8_e5m2,    "float8_e5m2",   0,                                 void,          void)
// clang-format on

namespace fsdp_ema::format {

// The safetensors dtypes this format reads and writes, under their safetensors names ("F64",
// "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL", "F8_E4M3", "F8_E5M2"). Any
// other name in a file is an error (never guessed, unlike DCP's reader).
enum class DType : uint8_t {
#define FSDP_EMA_X(id, ...) id,
  FSDP_EMA_DTYPES(FSDP_EMA_X)
#undef FSDP_EMA_X
};

namespace detail {
struct DTypeRow {
  DType dtype;
  std::string_view name;
  size_t size;
  bool floating;
  std::string_view python;
  uint8_t roles;
};
inline constexpr DTypeRow kDTypeRows[] = {
#define FSDP_EMA_X(id, name, size, floating, torch, python, roles, cpu, cuda) \
  {DType::id, name, size, floating, python, static_cast<uint8_t>(roles)},
    FSDP_EMA_DTYPES(FSDP_EMA_X)
#undef FSDP_EMA_X
};
constexpr const DTypeRow& row(DType d) { return kDTypeRows[static_cast<size_t>(d)]; }
}  // namespace detail

// The safetensors name, e.g. "BF16".
constexpr std::string_view dtype_name(DType d) { return detail::row(d).name; }
// Bytes per element.
constexpr size_t dtype_size(DType d) { return detail::row(d).size; }
// F64, F32, F16, BF16, F8_E4M3, F8_E5M2.
constexpr bool is_floating(DType d) { return detail::row(d).floating; }
// The attribute of Python's torch module ("bfloat16").
constexpr std::string_view python_dtype_name(DType d) { return detail::row(d).python; }
// Whether the dtype may play `role` (dtype_table.h).
constexpr bool has_role(DType d, DTypeRole role) { return (detail::row(d).roles & role) != 0; }

}  // namespace fsdp_ema::format
