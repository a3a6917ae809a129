#include "fsdp_ema/format/shape.h"

#include <algorithm>
#include <charconv>
#include <limits>

namespace fsdp_ema::format {

std::string shape_to_string(std::span<const int64_t> shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i > 0) out += ", ";
    out += std::to_string(shape[i]);
  }
  out += "]";
  return out;
}

void append_shape_json(std::string& out, std::span<const int64_t> shape,
                       std::string_view separator) {
  out += '[';
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i > 0) out += separator;
    char buf[24];
    const auto [end, ec] = std::to_chars(buf, buf + sizeof(buf), shape[i]);
    out.append(buf, end);
  }
  out += ']';
}

std::optional<uint64_t> checked_add(uint64_t a, uint64_t b) {
  uint64_t r = 0;
  if (__builtin_add_overflow(a, b, &r)) return std::nullopt;
  return r;
}

std::optional<uint64_t> checked_mul(uint64_t a, uint64_t b) {
  uint64_t r = 0;
  if (__builtin_mul_overflow(a, b, &r)) return std::nullopt;
  return r;
}

std::optional<uint64_t> numel(std::span<const int64_t> shape) {
  // The product runs over max(size, 1), as torch's contiguous strides do: a zero-element shape
  // such as [0, 2^62, 2^62] still has strides that overflow, and is refused here rather than by
  // torch's stride computation after a file was accepted.
  constexpr auto kMax = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
  uint64_t n = 1;
  bool zero = false;
  for (int64_t s : shape) {
    if (s < 0) return std::nullopt;
    if (s == 0) {
      zero = true;
      continue;
    }
    auto m = checked_mul(n, static_cast<uint64_t>(s));
    if (!m || *m > kMax) return std::nullopt;
    n = *m;
  }
  return zero ? 0 : n;
}

std::optional<uint64_t> nbytes(std::span<const int64_t> shape, DType dtype) {
  constexpr auto kMax = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
  auto n = numel(shape);
  if (!n) return std::nullopt;
  auto b = checked_mul(*n, dtype_size(dtype));
  if (!b || *b > kMax) return std::nullopt;
  return b;
}

std::optional<Box> intersect(const Box& a, const Box& b) {
  const size_t ndim = a.shape.size();
  Box r;
  r.offsets.resize(ndim);
  r.shape.resize(ndim);
  for (size_t d = 0; d < ndim; ++d) {
    // Boxes come from validated headers and indices: offset + size fits in int64_t.
    const int64_t lo = std::max(a.offsets[d], b.offsets[d]);
    const int64_t hi = std::min(a.offsets[d] + a.shape[d], b.offsets[d] + b.shape[d]);
    if (hi <= lo) return std::nullopt;
    r.offsets[d] = lo;
    r.shape[d] = hi - lo;
  }
  return r;
}

}  // namespace fsdp_ema::format
