// What a valid index is: plain piece file names, pieces that cover each tensor exactly once, the
// whole index's structure (fsdp_ema/format/index.h), and the lookup its sorted names allow.
#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "fsdp_ema/format/error.h"
#include "fsdp_ema/format/index.h"
#include "fsdp_ema/format/json_strict.h"
#include "fsdp_ema/format/names.h"
#include "index_impl.h"

namespace fsdp_ema::format {
namespace {

using detail::json_quote;

std::string piece_desc(const IndexPiece& p) {
  return "piece in " + p.file + " at offsets " + shape_to_string(p.offsets) + " with shape " +
         shape_to_string(p.shape);
}

// For messages: when every piece spans the full extent of dims >= 1, the first dim-0 rows that
// no piece covers; otherwise empty.
std::string uncovered_rows(const IndexTensor& t) {
  if (t.shape.empty()) return {};
  std::vector<std::pair<int64_t, int64_t>> rows;
  for (const IndexPiece& p : t.pieces) {
    for (size_t d = 1; d < t.shape.size(); ++d) {
      if (p.offsets[d] != 0 || p.shape[d] != t.shape[d]) return {};
    }
    if (p.shape[0] > 0) rows.emplace_back(p.offsets[0], p.offsets[0] + p.shape[0]);
  }
  std::sort(rows.begin(), rows.end());
  int64_t next = 0;
  for (const auto& [b, e] : rows) {
    if (b > next) break;
    next = std::max(next, e);
  }
  if (next >= t.shape[0]) return {};
  int64_t end = t.shape[0];
  for (const auto& [b, e] : rows) {
    if (b >= next) {
      end = b;
      break;
    }
  }
  return ": rows [" + std::to_string(next) + ", " + std::to_string(end) + ") are not covered";
}

// Throws when two of the non-empty pieces overlap, in O(P log P + cells). Each dimension is cut at
// every piece boundary, and every piece paints the cells of that grid it covers: a cell painted
// twice is an overlap. Real layouts (dim-0 chunks, TP x FSDP grids, bricks of uneven chunks) have
// at most a few cells per piece; a layout needing more than kCellsPerPiece per piece is only what
// a crafted index holds, and is refused rather than checked pair by pair (quadratic).
constexpr uint64_t kCellsPerPiece = 64;

void check_disjoint(const IndexTensor& t, const std::vector<size_t>& nonempty,
                    const std::string& ctx) {
  const size_t ndim = t.shape.size();
  std::vector<std::vector<int64_t>> cuts(ndim);
  for (size_t d = 0; d < ndim; ++d) {
    auto& c = cuts[d];
    c.reserve(2 * nonempty.size() + 2);
    c.push_back(0);
    c.push_back(t.shape[d]);
    for (size_t i : nonempty) {
      c.push_back(t.pieces[i].offsets[d]);
      c.push_back(t.pieces[i].offsets[d] + t.pieces[i].shape[d]);
    }
    std::sort(c.begin(), c.end());
    c.erase(std::unique(c.begin(), c.end()), c.end());
  }
  const uint64_t limit = kCellsPerPiece * (nonempty.size() + 1);
  std::vector<uint64_t> stride(ndim);
  uint64_t cells = 1;
  for (size_t d = ndim; d-- > 0;) {
    stride[d] = cells;
    const uint64_t k = cuts[d].size() - 1;  // >= 1: the pieces are non-empty
    if (cells > limit / k) {
      throw FormatError(ctx + ": " + std::to_string(nonempty.size()) +
                        " pieces form an irregular layout (more than " + std::to_string(limit) +
                        " grid cells): refused, writers cut tensors into grid-aligned pieces");
    }
    cells *= k;
  }
  // owner[cell] = 1 + index of the piece that covers it, 0 while uncovered.
  std::vector<uint32_t> owner(cells, 0);
  std::vector<uint64_t> lo(ndim), hi(ndim), at(ndim);
  auto cell_of = [&](size_t d, int64_t v) {
    return static_cast<uint64_t>(std::lower_bound(cuts[d].begin(), cuts[d].end(), v) -
                                 cuts[d].begin());
  };
  for (size_t i : nonempty) {
    const IndexPiece& p = t.pieces[i];
    for (size_t d = 0; d < ndim; ++d) {
      lo[d] = cell_of(d, p.offsets[d]);
      hi[d] = cell_of(d, p.offsets[d] + p.shape[d]);
    }
    at = lo;
    while (true) {
      uint64_t cell = 0;
      for (size_t d = 0; d < ndim; ++d) cell += at[d] * stride[d];
      if (owner[cell] != 0) {
        throw FormatError(ctx + ": pieces overlap: " + piece_desc(t.pieces[owner[cell] - 1]) +
                          " and " + piece_desc(p));
      }
      owner[cell] = static_cast<uint32_t>(i + 1);
      size_t d = ndim;
      while (d-- > 0 && ++at[d] == hi[d]) at[d] = lo[d];
      if (d == static_cast<size_t>(-1)) break;
    }
  }
}

}  // namespace

const IndexTensor* CheckpointIndex::find(std::string_view name) const {
  auto it = std::lower_bound(tensors.begin(), tensors.end(), name,
                             [](const IndexTensor& t, std::string_view n) { return t.name < n; });
  return (it != tensors.end() && it->name == name) ? &*it : nullptr;
}

void check_piece_file_name(std::string_view name, const std::string& where) {
  auto bad = [&](const std::string& why) {
    throw FormatError(where + ": piece file name " + json_quote(name) + " " + why);
  };
  if (name.empty()) bad("is empty");
  if (name.find('/') != std::string_view::npos) bad("contains '/': must be a plain file name");
  if (name.find('\\') != std::string_view::npos) bad("contains '\\': must be a plain file name");
  if (name.find('\0') != std::string_view::npos) bad("contains a NUL character");
  if (name.front() == '.') bad("starts with '.' (\".\", \"..\" and hidden files are refused)");
  if (!detail::is_valid_utf8(name)) bad("is not valid UTF-8");
  if (!name.ends_with(kSafetensorsSuffix))
    bad("does not end in " + std::string(kSafetensorsSuffix));
}

void check_coverage(const IndexTensor& t, const std::string& where) {
  const auto ctx = [&] { return tensor_ctx(where, t.name); };  // built on error only
  const size_t ndim = t.shape.size();
  auto total = numel(t.shape);
  if (!total || !nbytes(t.shape, t.dtype)) {
    throw FormatError(ctx() + ": global shape " + shape_to_string(t.shape) + " of " +
                      std::string(dtype_name(t.dtype)) + " overflows a 64-bit byte count");
  }
  uint64_t covered = 0;
  std::vector<size_t> nonempty;
  for (size_t i = 0; i < t.pieces.size(); ++i) {
    const IndexPiece& p = t.pieces[i];
    if (p.offsets.size() != ndim || p.shape.size() != ndim) {
      throw FormatError(ctx() + ": " + piece_desc(p) + " does not have " + std::to_string(ndim) +
                        " dimensions like global shape " + shape_to_string(t.shape));
    }
    for (size_t d = 0; d < ndim; ++d) {
      if (p.offsets[d] < 0 || p.shape[d] < 0 || p.offsets[d] > t.shape[d] ||
          p.shape[d] > t.shape[d] - p.offsets[d]) {
        throw FormatError(ctx() + ": " + piece_desc(p) + " lies outside global shape " +
                          shape_to_string(t.shape) + " in dimension " + std::to_string(d));
      }
    }
    const uint64_t n = *numel(p.shape);  // inside the global shape, so no overflow
    if (n > 0) nonempty.push_back(i);
    auto sum = checked_add(covered, n);
    if (!sum) throw FormatError(ctx() + ": pieces overlap (element counts overflow)");
    covered = *sum;
  }

  if (ndim == 0) {
    if (nonempty.size() > 1) {
      throw FormatError(ctx() + ": pieces overlap: " + piece_desc(t.pieces[nonempty[0]]) + " and " +
                        piece_desc(t.pieces[nonempty[1]]) + " both hold the 0-dim tensor");
    }
  } else if (!nonempty.empty()) {
    check_disjoint(t, nonempty, ctx());
  }
  if (covered != *total) {
    throw FormatError(ctx() + ": pieces cover " + std::to_string(covered) + " of " +
                      std::to_string(*total) + " elements of global shape " +
                      shape_to_string(t.shape) + ": missing piece or gap" + uncovered_rows(t));
  }
}

void validate_index(const CheckpointIndex& index, const std::string& where,
                    bool require_checksums) {
  if (index.format_version != kIndexFormatVersion) {
    throw FormatError(where + ": unsupported format_version " +
                      std::to_string(index.format_version) + " (this build reads " +
                      std::to_string(kIndexFormatVersion) + ")");
  }
  if (index.world_size < 1) {
    throw FormatError(where + ": world_size " + std::to_string(index.world_size) +
                      " must be at least 1");
  }
  std::string_view last_checked_file;
  for (size_t i = 0; i < index.tensors.size(); ++i) {
    const IndexTensor& t = index.tensors[i];
    const auto ctx = [&] { return tensor_ctx(where, t.name); };  // built on error only
    if (t.name.empty()) throw FormatError(where + ": a tensor has an empty name");
    if (i > 0 && !(index.tensors[i - 1].name < t.name)) {
      throw FormatError(ctx() + ": tensors must be unique and sorted by name");
    }
    if (t.pieces.empty()) throw FormatError(ctx() + ": has no pieces");
    for (const IndexPiece& p : t.pieces) {
      // Pieces name a handful of files (one per rank): check each name once per run of it.
      if (p.file != last_checked_file) {
        check_piece_file_name(p.file, ctx());
        last_checked_file = p.file;
      }
      if (require_checksums && !p.checksum) {
        throw FormatError(ctx() + ": " + piece_desc(p) + " has no checksum");
      }
    }
    check_coverage(t, where);
  }
}

}  // namespace fsdp_ema::format
