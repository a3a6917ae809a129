#include "fsdp_ema/format/index.h"

#include <limits.h>
#include <stdlib.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <memory>
#include <numeric>
#include <set>
#include <unordered_map>

#include "fsdp_ema/format/checksum.h"
#include "fsdp_ema/format/error.h"
#include "fsdp_ema/format/file_util.h"
#include "fsdp_ema/format/json_strict.h"
#include "fsdp_ema/format/name_index.h"
#include "fsdp_ema/format/names.h"
#include "fsdp_ema/format/parallel.h"
#include "fsdp_ema/format/paths.h"
#include "fsdp_ema/format/recent_shards.h"
#include "fsdp_ema/format/shard_file.h"
#include "fsdp_ema/format/shard_writer.h"

namespace fsdp_ema::format {
namespace {

using detail::json_quote;

std::string tensor_ctx(const std::string& where, const std::string& name) {
  return where + ": tensor " + json_quote(name);
}

std::string piece_desc(const IndexPiece& p) {
  return "piece in " + p.file + " at offsets " + shape_to_string(p.offsets) + " with shape " +
         shape_to_string(p.shape);
}

bool offsets_less(const IndexPiece& a, const IndexPiece& b) {
  if (a.offsets != b.offsets) return a.offsets < b.offsets;
  if (a.shape != b.shape) return a.shape < b.shape;
  return a.file < b.file;
}

std::string real_path(const std::string& path) {
  std::unique_ptr<char, decltype(&::free)> p(::realpath(path.c_str(), nullptr), &::free);
  if (!p) {
    throw FormatError(path + ": cannot resolve: " + detail::errno_text(errno));
  }
  return p.get();
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

// resolve_piece_path once per distinct file.
void resolve_all_pieces(const std::string& dir, const CheckpointIndex& index) {
  // Pieces name a handful of files (one per rank), in long runs: skip a run's repeats before
  // the set lookup.
  std::set<std::string_view> files;
  std::string_view last;
  for (const IndexTensor& t : index.tensors) {
    for (const IndexPiece& p : t.pieces) {
      if (p.file != last) files.insert(last = p.file);
    }
  }
  for (std::string_view f : files) resolve_piece_path(dir, f);
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

CheckpointIndex build_index(std::span<const ShardDescription> shards, int64_t world_size,
                            std::map<std::string, std::string> metadata) {
  const std::string where = "build_index";
  if (world_size < 1) throw FormatError(where + ": world_size must be at least 1");
  std::set<std::string> files;
  std::set<int64_t> ranks;
  std::vector<IndexTensor> tensors;
  detail::NameIndex by_name;  // views of the names in `shards`, which outlive it
  for (const ShardDescription& s : shards) {
    check_piece_file_name(s.file, where);
    if (!files.insert(s.file).second) throw FormatError(where + ": file " + s.file + " twice");
    if (s.world_size != world_size) {
      throw FormatError(where + ": " + s.file + " was written for world size " +
                        std::to_string(s.world_size) + ", not " + std::to_string(world_size));
    }
    if (s.rank < 0 || s.rank >= world_size || !ranks.insert(s.rank).second) {
      throw FormatError(where + ": " + s.file + " has rank " + std::to_string(s.rank) +
                        ", out of range or repeated");
    }
    for (const TensorInfo& ti : s.tensors) {
      auto ctx = [&] { return where + ": " + s.file + ": tensor " + json_quote(ti.name); };
      if (!ti.checksum) throw FormatError(ctx() + ": has no checksum");
      const auto known = by_name.insert(ti.name, tensors.size());
      const bool inserted = !known;
      if (inserted) tensors.emplace_back();
      IndexTensor& t = tensors[known.value_or(tensors.size() - 1)];
      if (inserted) {
        t.name = ti.name;
        t.dtype = ti.dtype;
        t.shape = ti.global_shape;
      } else if (t.dtype != ti.dtype) {
        throw FormatError(ctx() + ": dtype " + std::string(dtype_name(ti.dtype)) + " but " +
                          t.pieces.front().file + " has " + std::string(dtype_name(t.dtype)));
      } else if (t.shape != ti.global_shape) {
        throw FormatError(ctx() + ": global shape " + shape_to_string(ti.global_shape) + " but " +
                          t.pieces.front().file + " has " + shape_to_string(t.shape));
      }
      t.pieces.push_back(IndexPiece{s.file, ti.offsets, ti.shape, ti.checksum});
    }
  }
  CheckpointIndex index;
  index.world_size = world_size;
  index.metadata = std::move(metadata);
  // Usually sorted already (one piece per tensor and rank; shard files list names in order):
  // checking first costs n comparisons where sorting costs n log n.
  for (IndexTensor& t : tensors) {
    if (!std::is_sorted(t.pieces.begin(), t.pieces.end(), offsets_less)) {
      std::sort(t.pieces.begin(), t.pieces.end(), offsets_less);
    }
  }
  auto by_name_less = [](const IndexTensor& a, const IndexTensor& b) { return a.name < b.name; };
  if (!std::is_sorted(tensors.begin(), tensors.end(), by_name_less)) {
    std::sort(tensors.begin(), tensors.end(), by_name_less);
  }
  index.tensors = std::move(tensors);
  validate_index(index, where);
  return index;
}

CheckpointIndex build_index_from_files(const std::string& dir,
                                       std::span<const std::string> file_names, int64_t world_size,
                                       std::map<std::string, std::string> metadata) {
  check_path(dir, "checkpoint directory");
  if (world_size < 1) throw FormatError(dir + ": world_size must be at least 1");
  if (file_names.size() != static_cast<size_t>(world_size)) {
    throw FormatError(dir + ": " + std::to_string(file_names.size()) + " shard file names for " +
                      std::to_string(world_size) + " ranks");
  }
  for (int64_t r = 0; r < world_size; ++r) {
    const std::string& name = file_names[static_cast<size_t>(r)];
    if (name.empty()) continue;  // a rank with no file (see the header)
    if (!detail::path_exists(detail::join_path(dir, name))) {
      throw FormatError(dir + ": missing shard file " + name + " (rank " + std::to_string(r) +
                        " of " + std::to_string(world_size) + " did not finish writing)");
    }
  }
  // One header per rank, parsed on the machine's cores (a file this process has just written is
  // described from memory instead: fsdp_ema/format/recent_shards.h). Errors in rank order.
  std::vector<ShardDescription> shards(static_cast<size_t>(world_size));
  const auto errors = detail::run_jobs(shards.size(), [&](size_t r) {
    const std::string& name = file_names[r];
    if (name.empty()) return;
    const std::string path = detail::join_path(dir, name);
    ShardDescription& d = shards[r];
    if (auto known = detail::take_written_shard(path);
        known && known->rank == static_cast<int64_t>(r) && known->world_size == world_size) {
      d = std::move(*known);
      d.file = name;
      return;
    }
    d = describe_shard_file(path, static_cast<int64_t>(r), world_size);
    d.file = name;
  });
  detail::rethrow_first(errors);
  std::erase_if(shards, [](const ShardDescription& d) { return d.file.empty(); });
  return build_index(shards, world_size, std::move(metadata));
}

std::string index_to_json(const CheckpointIndex& index) {
  // Appended in place into one reserved string: an index of 100,000+ tensors is tens of MB.
  size_t estimate = 256;
  for (const auto& [k, v] : index.metadata) estimate += k.size() + v.size() + 16;
  for (const IndexTensor& t : index.tensors) {
    estimate += t.name.size() + 64 + 24 * t.shape.size();
    for (const IndexPiece& p : t.pieces) estimate += p.file.size() + 96 + 48 * p.shape.size();
  }
  std::string out;
  out.reserve(estimate);
  out += "{\n  \"format\": \"fsdp_ema\",\n  \"format_version\": ";
  out += std::to_string(index.format_version);
  out += ",\n  \"world_size\": ";
  out += std::to_string(index.world_size);
  out += ",\n  \"metadata\": {";
  bool first = true;
  for (const auto& [k, v] : index.metadata) {
    out += first ? "\n    " : ",\n    ";
    first = false;
    detail::append_json_quoted(out, k);
    out += ": ";
    detail::append_json_quoted(out, v);
  }
  out += first ? "},\n" : "\n  },\n";
  out += "  \"tensors\": {";
  first = true;
  for (const IndexTensor& t : index.tensors) {
    out += first ? "\n    " : ",\n    ";
    first = false;
    detail::append_json_quoted(out, t.name);
    out += ": {\"dtype\": \"";
    out += dtype_name(t.dtype);
    out += "\", \"shape\": ";
    append_shape_json(out, t.shape, ", ");
    out += ", \"pieces\": [";
    for (size_t i = 0; i < t.pieces.size(); ++i) {
      const IndexPiece& p = t.pieces[i];
      out += i == 0 ? "\n      {\"file\": " : ",\n      {\"file\": ";
      detail::append_json_quoted(out, p.file);
      out += ", \"offsets\": ";
      append_shape_json(out, p.offsets, ", ");
      out += ", \"shape\": ";
      append_shape_json(out, p.shape, ", ");
      if (p.checksum) {
        out += ", \"checksum\": \"";
        out += format_checksum(*p.checksum);
        out += '"';
      }
      out += '}';
    }
    out += "]}";
  }
  out += first ? "}\n}\n" : "\n  }\n}\n";
  return out;
}

namespace {

using detail::JsonReader;

// A string field's value, or the raw text of whatever else stands there (for messages).
struct StringOrRaw {
  std::optional<std::string> value;
  std::string raw;
};

StringOrRaw read_string_or_raw(JsonReader& r) {
  StringOrRaw out;
  if (r.peek() == JsonReader::Kind::kString) {
    out.value = r.read_string();
    out.raw = json_quote(*out.value);
  } else {
    out.raw = std::string(r.skip_value());
  }
  return out;
}

// `ctx` names the tensor in messages; `checked_file` is the last file name that passed
// check_piece_file_name (pieces name a handful of files, one per rank).
template <typename Ctx>
IndexPiece parse_piece(JsonReader& r, const Ctx& ctx, std::string& checked_file) {
  if (r.peek() != JsonReader::Kind::kObject)
    throw FormatError(ctx() + ": every piece must be an object");
  std::optional<StringOrRaw> file, checksum;
  std::optional<std::optional<Shape>> offsets, shape;
  r.begin_object();
  std::string key;
  while (r.next_key(key)) {
    if (key == "file") {
      file = read_string_or_raw(r);
    } else if (key == "offsets") {
      offsets = r.read_shape();
    } else if (key == "shape") {
      shape = r.read_shape();
    } else if (key == "checksum") {
      checksum = read_string_or_raw(r);
    } else {
      r.skip_value();
    }
  }
  if (!file) throw FormatError(ctx() + ": piece: missing \"file\"");
  if (!file->value) throw FormatError(ctx() + ": piece \"file\" must be a string");
  IndexPiece p;
  p.file = std::move(*file->value);
  if (p.file != checked_file) {
    check_piece_file_name(p.file, ctx());
    checked_file = p.file;
  }
  auto pctx = [&] { return ctx() + ": piece in " + p.file; };
  if (!offsets) throw FormatError(pctx() + ": missing \"offsets\"");
  if (!shape) throw FormatError(pctx() + ": missing \"shape\"");
  if (!*offsets || !*shape) {
    throw FormatError(pctx() +
                      ": \"offsets\" and \"shape\" must be arrays of non-negative integers");
  }
  p.offsets = std::move(**offsets);
  p.shape = std::move(**shape);
  if (!checksum) throw FormatError(pctx() + ": missing \"checksum\"");
  if (checksum->value) p.checksum = parse_checksum(*checksum->value);
  if (!p.checksum) {
    throw FormatError(pctx() + ": checksum " + checksum->raw + " is not " + checksum_form_text());
  }
  return p;
}

IndexTensor parse_tensor(JsonReader& r, const std::string& where, std::string name,
                         std::string& checked_file) {
  auto ctx = [&] { return tensor_ctx(where, name); };
  if (r.peek() != JsonReader::Kind::kObject) throw FormatError(ctx() + ": entry must be an object");
  IndexTensor t;
  std::optional<StringOrRaw> dtype;
  std::optional<std::optional<Shape>> shape;
  bool has_pieces = false;
  r.begin_object();
  std::string key;
  while (r.next_key(key)) {
    if (key == "dtype") {
      dtype = read_string_or_raw(r);
    } else if (key == "shape") {
      shape = r.read_shape();
    } else if (key == "pieces") {
      has_pieces = true;
      if (r.peek() != JsonReader::Kind::kArray)
        throw FormatError(ctx() + ": \"pieces\" must be an array");
      r.begin_array();
      while (r.next_element()) t.pieces.push_back(parse_piece(r, ctx, checked_file));
    } else {
      r.skip_value();
    }
  }
  if (!dtype) throw FormatError(ctx() + ": missing \"dtype\"");
  std::optional<DType> dt;
  if (dtype->value) dt = parse_dtype(*dtype->value);
  if (!dt) throw FormatError(ctx() + ": unknown dtype " + dtype->raw);
  t.dtype = *dt;
  if (!shape) throw FormatError(ctx() + ": missing \"shape\"");
  if (!*shape) throw FormatError(ctx() + ": \"shape\" must be an array of non-negative integers");
  t.shape = std::move(**shape);
  if (!has_pieces) throw FormatError(ctx() + ": missing \"pieces\"");
  std::sort(t.pieces.begin(), t.pieces.end(), offsets_less);
  t.name = std::move(name);
  return t;
}

void parse_tensors(JsonReader& r, const std::string& where, CheckpointIndex& index) {
  if (r.peek() != JsonReader::Kind::kObject)
    throw FormatError(where + ": \"tensors\" must be an object");
  r.begin_object(/*caller_checks_keys=*/true);
  std::string name;
  std::string checked_file;
  while (r.next_key(name)) index.tensors.push_back(parse_tensor(r, where, name, checked_file));
  // Sorted by name, as validate_index wants (our writer already sorts); a repeat is then adjacent.
  auto by_name = [](const IndexTensor& a, const IndexTensor& b) { return a.name < b.name; };
  if (!std::is_sorted(index.tensors.begin(), index.tensors.end(), by_name)) {
    std::stable_sort(index.tensors.begin(), index.tensors.end(), by_name);
  }
  for (size_t i = 1; i < index.tensors.size(); ++i) {
    if (index.tensors[i].name == index.tensors[i - 1].name) r.duplicate_key(index.tensors[i].name);
  }
}

CheckpointIndex parse_index_object(std::string_view text, const std::string& where) {
  JsonReader r(text, where);
  if (const auto kind = r.peek(); kind != JsonReader::Kind::kObject) {
    throw FormatError(where + ": index is a JSON " + JsonReader::kind_name(kind) +
                      ", expected an object");
  }
  CheckpointIndex index;
  std::optional<StringOrRaw> fmt;
  std::optional<std::optional<int64_t>> version, world;
  bool has_tensors = false;
  std::string_view deferred_tensors;  // "tensors" met before the format was known
  // The format and its version are checked before any tensor is interpreted (a later version
  // may lay tensors out differently). Our writer puts them first; otherwise the tensors' text is
  // set aside and read after the loop.
  auto check_format = [&] {
    if (!fmt) throw FormatError(where + ": missing \"format\"");
    if (!fmt->value || *fmt->value != kIndexFormatName) {
      throw FormatError(where + ": \"format\" is " + fmt->raw + ", expected \"fsdp_ema\"");
    }
    if (!version) throw FormatError(where + ": missing \"format_version\"");
    if (!*version) throw FormatError(where + ": \"format_version\" must be a non-negative integer");
    index.format_version = **version;
    if (index.format_version != kIndexFormatVersion) {
      throw FormatError(where + ": unsupported format_version " + std::to_string(**version) +
                        " (this build reads " + std::to_string(kIndexFormatVersion) + ")");
    }
  };
  auto read_int = [&]() -> std::optional<int64_t> {
    if (r.peek() == JsonReader::Kind::kNumber) return r.read_nonneg_int();
    r.skip_value();
    return std::nullopt;
  };
  r.begin_object();
  std::string key;
  while (r.next_key(key)) {
    if (key == "format") {
      fmt = read_string_or_raw(r);
    } else if (key == "format_version") {
      version = read_int();
    } else if (key == "world_size") {
      world = read_int();
    } else if (key == "metadata") {
      if (r.peek() != JsonReader::Kind::kObject) {
        throw FormatError(where + ": \"metadata\" must be an object of strings");
      }
      r.begin_object();
      std::string k;
      while (r.next_key(k)) {
        if (r.peek() != JsonReader::Kind::kString) {
          throw FormatError(where + ": metadata entry " + json_quote(k) + " must be a string");
        }
        index.metadata.emplace(k, r.read_string());
      }
    } else if (key == "tensors") {
      has_tensors = true;
      if (fmt && version) {
        check_format();
        parse_tensors(r, where, index);
      } else {
        deferred_tensors = r.skip_value();
      }
    } else {
      r.skip_value();
    }
  }
  r.expect_end();
  check_format();
  if (!world) throw FormatError(where + ": missing \"world_size\"");
  if (!*world || **world < 1) throw FormatError(where + ": \"world_size\" must be an integer >= 1");
  index.world_size = **world;
  if (!has_tensors) throw FormatError(where + ": missing \"tensors\"");
  if (!deferred_tensors.empty()) {
    JsonReader tr(deferred_tensors, where);
    parse_tensors(tr, where, index);
  }
  validate_index(index, where);
  return index;
}

}  // namespace

CheckpointIndex parse_index_json(std::string_view text, const std::string& where) {
  return detail::interpret_json(text, where, [&] { return parse_index_object(text, where); });
}

std::string resolve_piece_path(const std::string& dir, std::string_view name) {
  check_piece_file_name(name, dir);
  const std::string real_dir = real_path(dir);
  const std::string path = detail::join_path(dir, name);
  if (!detail::path_exists(path)) {
    throw FormatError(path + ": piece file missing (listed in the index but not in the directory)");
  }
  const std::string real = real_path(path);
  const std::string prefix = real_dir == "/" ? real_dir : real_dir + "/";
  if (!real.starts_with(prefix) || real.find('/', prefix.size()) != std::string::npos) {
    throw FormatError(path + ": resolves to " + real + ", outside the checkpoint directory " +
                      real_dir);
  }
  struct stat st {};
  if (::stat(real.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) {
    throw FormatError(path + ": not a regular file");
  }
  return real;
}

void write_index(const std::string& dir, const CheckpointIndex& index, bool overwrite, bool fsync) {
  check_path(dir, "checkpoint directory");
  const std::string path = detail::join_path(dir, kIndexFileName);
  validate_index(index, path);
  resolve_all_pieces(dir, index);
  auto committed = [&] {
    return FormatError(path +
                       ": checkpoint already committed (the index exists; pass "
                       "overwrite=true to replace it)");
  };
  if (!overwrite && detail::path_exists(path)) throw committed();
  if (!detail::write_file_atomically(path, index_to_json(index), fsync, overwrite)) {
    throw committed();
  }
}

CheckpointIndex read_index(const std::string& dir) {
  check_path(dir, "checkpoint directory");
  if (!detail::is_directory(dir)) {
    throw FormatError(dir + ": not a directory (a checkpoint is a directory)");
  }
  const std::string path = detail::join_path(dir, kIndexFileName);
  struct stat st {};
  if (::lstat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode)) {
    throw FormatError(path + ": not a regular file (" +
                      (S_ISLNK(st.st_mode) ? std::string("a symbolic link") : "a special file") +
                      "): the commit marker must be the file the writer renamed into place");
  }
  if (!detail::path_exists(path)) {
    throw FormatError(dir + ": incomplete checkpoint: " + std::string(kIndexFileName) +
                      " missing (the index is written last, after every rank's shard file is "
                      "durable)");
  }
  CheckpointIndex index = parse_index_json(detail::read_small_file(path, kMaxIndexBytes), path);
  resolve_all_pieces(dir, index);
  return index;
}

}  // namespace fsdp_ema::format
