// The one bridge between torch and the torch-free format/ library: the dtype maps both ways
// (generated from the one dtype table, fsdp_ema/format/dtype_table.h) and the translation of
// format::FormatError into c10::Error (RuntimeError in Python) with the caller's name in front.
// Every op and the C++ reader use these; nothing else maps dtypes or catches FormatError.
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>

#include <optional>
#include <string>
#include <utility>

#include "fsdp_ema/format/dtype.h"
#include "fsdp_ema/format/error.h"

namespace fsdp_ema::ops {

// The safetensors dtype of a torch dtype; nullopt for one safetensors (as format/ writes it)
// cannot store.
std::optional<format::DType> format_dtype_of(at::ScalarType t);
// Same, raising "<what> has dtype X, which safetensors cannot store" for one it cannot.
format::DType to_format_dtype(at::ScalarType t, const std::string& what);
at::ScalarType to_scalar_type(format::DType d);
// Whether a torch dtype may play `role` (fsdp_ema/format/dtype_table.h): the update kernels' EMA
// and model dtypes, the export casts.
bool has_role(at::ScalarType t, format::DTypeRole role);
// "Double, Float, Half or BFloat16": the torch dtypes that may play `role`, for messages.
std::string torch_dtypes_with_role(format::DTypeRole role);

// The (rank, world_size) pair an op addresses: world_size >= 1, rank in [0, world_size).
// `op` prefixes the message (e.g. "fsdp_ema::load_tensors: ").
void check_rank(const char* op, int64_t rank, int64_t world_size);

// Runs f, rethrowing a FormatError as c10::Error with `where` ("fsdp_ema::save_shard: ") in front.
template <typename F>
auto translate_errors(const char* where, F&& f) -> decltype(f()) {
  try {
    return std::forward<F>(f)();
  } catch (const format::FormatError& e) {
    TORCH_CHECK(false, where, e.what());
  }
}

}  // namespace fsdp_ema::ops
