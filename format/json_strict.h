// Internal: JSON parsing that refuses what nlohmann accepts silently (duplicate keys, absurd
// nesting), and typed accessors with error messages. Only .cpp files include this header, so
// nlohmann_json stays a private dependency of fsdp_ema_format.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>

#include "format/shape.h"

namespace fsdp_ema::format::detail {

using Json = nlohmann::json;

// Parses `text` as one JSON value. Throws FormatError("<what>: ...") for invalid JSON or UTF-8,
// a key repeated in one object (nlohmann would keep the last one; a second "w" entry could hide
// the first), or nesting deeper than max_depth.
Json parse_json_strict(std::string_view text, const std::string& what, int max_depth = 16);

// A JSON integer in [0, INT64_MAX]; nullopt for negative numbers, floats and other types.
std::optional<int64_t> as_nonneg_int(const Json& j);

// An array of integers in [0, INT64_MAX]; nullopt otherwise.
std::optional<Shape> as_shape(const Json& j);

// The JSON type's name for messages ("string", "array", ...).
std::string json_type_name(const Json& j);

// `s` as a quoted JSON string literal (escaped), e.g. for building JSON text by hand.
std::string json_quote(std::string_view s);

// Whether `s` is valid UTF-8 (JSON strings must be).
bool is_valid_utf8(std::string_view s);

}  // namespace fsdp_ema::format::detail
