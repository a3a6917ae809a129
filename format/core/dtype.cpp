#include "fsdp_ema/format/dtype.h"

#include <algorithm>
#include <cctype>
#include <string>

namespace fsdp_ema::format {
namespace {

constexpr auto kAll = [] {
  std::array<DType, std::size(detail::kDTypeRows)> all{};
  for (size_t i = 0; i < all.size(); ++i) all[i] = detail::kDTypeRows[i].dtype;
  return all;
}();

// The enum values are the table's row indices.
static_assert([] {
  for (size_t i = 0; i < std::size(detail::kDTypeRows); ++i) {
    if (static_cast<size_t>(detail::kDTypeRows[i].dtype) != i) return false;
  }
  return true;
}());

}  // namespace

std::optional<DType> parse_dtype(std::string_view name) {
  for (const detail::DTypeRow& r : detail::kDTypeRows) {
    if (r.name == name) return r.dtype;
  }
  return std::nullopt;
}

std::optional<DType> parse_dtype_spelling(std::string_view text) {
  std::string upper(text);
  std::transform(upper.begin(), upper.end(), upper.begin(),
                 [](unsigned char c) { return static_cast<char>(std::toupper(c)); });
  for (const detail::DTypeRow& r : detail::kDTypeRows) {
    if (r.name == upper || r.python == text) return r.dtype;
  }
  return std::nullopt;
}

std::span<const DType> all_dtypes() { return kAll; }

std::string dtype_names(std::string_view sep) {
  std::string out;
  for (const detail::DTypeRow& r : detail::kDTypeRows) (out += out.empty() ? "" : sep) += r.name;
  return out;
}

std::string dtype_names_with_role(DTypeRole role, std::string_view sep) {
  std::string out;
  for (const detail::DTypeRow& r : detail::kDTypeRows) {
    if ((r.roles & role) != 0) (out += out.empty() ? "" : sep) += r.name;
  }
  return out;
}

}  // namespace fsdp_ema::format
