// Element types of the safetensors format: the enum and its accessors (dtype_table.h, which the
// C++17 CUDA kernels include alone), plus lookups by name.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "fsdp_ema/format/dtype_table.h"

namespace fsdp_ema::format {

// The dtype for an exact (case-sensitive) safetensors name, or nullopt.
std::optional<DType> parse_dtype(std::string_view name);
// The dtype a person typed: its safetensors name in any case ("bf16") or its Python name
// ("bfloat16"); nullopt for anything else.
std::optional<DType> parse_dtype_spelling(std::string_view text);

// Every dtype, in enum order.
std::span<const DType> all_dtypes();
// The names of every dtype, or of those that can play `role`, separated by `sep` ("F64 F32 ...").
std::string dtype_names(std::string_view sep = " ");
std::string dtype_names_with_role(DTypeRole role, std::string_view sep);

}  // namespace fsdp_ema::format
