// What the index's sources share (fsdp_ema/format/index.h is implemented by four: index_check.cpp,
// index_build.cpp, index_parse.cpp and index_file.cpp): how a message names a tensor, and the
// order of a tensor's pieces. Private to format/dir/.
#pragma once

#include <string>

#include "fsdp_ema/format/index.h"
#include "fsdp_ema/format/json_strict.h"

namespace fsdp_ema::format {

inline std::string tensor_ctx(const std::string& where, const std::string& name) {
  return where + ": tensor " + detail::json_quote(name);
}

// The order of IndexTensor::pieces: by offsets (then shape and file, for a total order).
inline bool offsets_less(const IndexPiece& a, const IndexPiece& b) {
  if (a.offsets != b.offsets) return a.offsets < b.offsets;
  if (a.shape != b.shape) return a.shape < b.shape;
  return a.file < b.file;
}

}  // namespace fsdp_ema::format
