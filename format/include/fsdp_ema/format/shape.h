// Shapes and boxes: overflow-checked element counts, printing, intersection.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "fsdp_ema/format/dtype.h"

namespace fsdp_ema::format {

// Sizes and offsets are int64_t like torch's; negative values are rejected wherever they enter.
using Shape = std::vector<int64_t>;

// "[4, 8]"; "[]" for a 0-dim shape.
std::string shape_to_string(std::span<const int64_t> shape);

// Appends the JSON array of the sizes: "[4,8]" (or "[4, 8]" with separator ", ").
void append_shape_json(std::string& out, std::span<const int64_t> shape,
                       std::string_view separator = ",");

// a + b and a * b, nullopt on overflow.
std::optional<uint64_t> checked_add(uint64_t a, uint64_t b);
std::optional<uint64_t> checked_mul(uint64_t a, uint64_t b);

// Product of the sizes (1 for a 0-dim shape), nullopt if a size is negative or the product of
// the non-zero sizes overflows int64_t (even when another size is 0: torch's strides would).
std::optional<uint64_t> numel(std::span<const int64_t> shape);

// numel(shape) * dtype_size(dtype), nullopt on a negative size or overflow of int64_t.
std::optional<uint64_t> nbytes(std::span<const int64_t> shape, DType dtype);

// A box inside an N-d tensor: [offsets[d], offsets[d] + shape[d]) in every dimension d.
struct Box {
  Shape offsets;
  Shape shape;
};

// The intersection of two boxes of the same rank, nullopt if it holds no element. Two 0-dim
// boxes intersect in the one element of a 0-dim tensor.
std::optional<Box> intersect(const Box& a, const Box& b);

}  // namespace fsdp_ema::format
