#include "format/index.h"

#include <limits.h>
#include <stdlib.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <memory>
#include <numeric>
#include <set>
#include <unordered_map>

#include "format/checksum.h"
#include "format/error.h"
#include "format/file_util.h"
#include "format/json_strict.h"
#include "format/shard_file.h"
#include "format/shard_writer.h"

namespace fsdp_ema::format {
namespace {

using detail::Json;
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

void append_shape_json(std::string& out, std::span<const int64_t> s) {
  out += '[';
  for (size_t i = 0; i < s.size(); ++i) {
    if (i > 0) out += ", ";
    out += std::to_string(s[i]);
  }
  out += ']';
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
  std::set<std::string_view> files;
  for (const IndexTensor& t : index.tensors) {
    for (const IndexPiece& p : t.pieces) files.insert(p.file);
  }
  for (std::string_view f : files) resolve_piece_path(dir, f);
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
  if (!name.ends_with(".safetensors")) bad("does not end in .safetensors");
}

void check_coverage(const IndexTensor& t, const std::string& where) {
  const std::string ctx = tensor_ctx(where, t.name);
  const size_t ndim = t.shape.size();
  auto total = numel(t.shape);
  if (!total || !nbytes(t.shape, t.dtype)) {
    throw FormatError(ctx + ": global shape " + shape_to_string(t.shape) + " of " +
                      std::string(dtype_name(t.dtype)) + " overflows a 64-bit byte count");
  }
  uint64_t covered = 0;
  std::vector<size_t> nonempty;
  for (size_t i = 0; i < t.pieces.size(); ++i) {
    const IndexPiece& p = t.pieces[i];
    if (p.offsets.size() != ndim || p.shape.size() != ndim) {
      throw FormatError(ctx + ": " + piece_desc(p) + " does not have " + std::to_string(ndim) +
                        " dimensions like global shape " + shape_to_string(t.shape));
    }
    for (size_t d = 0; d < ndim; ++d) {
      if (p.offsets[d] < 0 || p.shape[d] < 0 || p.offsets[d] > t.shape[d] ||
          p.shape[d] > t.shape[d] - p.offsets[d]) {
        throw FormatError(ctx + ": " + piece_desc(p) + " lies outside global shape " +
                          shape_to_string(t.shape) + " in dimension " + std::to_string(d));
      }
    }
    const uint64_t n = *numel(p.shape);  // inside the global shape, so no overflow
    if (n > 0) nonempty.push_back(i);
    auto sum = checked_add(covered, n);
    if (!sum) throw FormatError(ctx + ": pieces overlap (element counts overflow)");
    covered = *sum;
  }

  if (ndim == 0) {
    if (nonempty.size() > 1) {
      throw FormatError(ctx + ": pieces overlap: " + piece_desc(t.pieces[nonempty[0]]) + " and " +
                        piece_desc(t.pieces[nonempty[1]]) + " both hold the 0-dim tensor");
    }
  } else {
    // Sweep along the dimension with the most distinct offsets: pieces are compared only with
    // those whose extent in that dimension overlaps, which for the usual 1-d or 2-d splits is
    // a handful.
    size_t sweep = 0;
    size_t best = 0;
    for (size_t d = 0; d < ndim; ++d) {
      std::set<int64_t> distinct;
      for (size_t i : nonempty) distinct.insert(t.pieces[i].offsets[d]);
      if (distinct.size() > best) {
        best = distinct.size();
        sweep = d;
      }
    }
    std::sort(nonempty.begin(), nonempty.end(), [&](size_t a, size_t b) {
      return t.pieces[a].offsets[sweep] < t.pieces[b].offsets[sweep];
    });
    for (size_t a = 0; a < nonempty.size(); ++a) {
      const IndexPiece& pa = t.pieces[nonempty[a]];
      const int64_t end = pa.offsets[sweep] + pa.shape[sweep];
      for (size_t b = a + 1; b < nonempty.size(); ++b) {
        const IndexPiece& pb = t.pieces[nonempty[b]];
        if (pb.offsets[sweep] >= end) break;
        if (intersect(Box{pa.offsets, pa.shape}, Box{pb.offsets, pb.shape})) {
          throw FormatError(ctx + ": pieces overlap: " + piece_desc(pa) + " and " + piece_desc(pb));
        }
      }
    }
  }
  if (covered != *total) {
    throw FormatError(ctx + ": pieces cover " + std::to_string(covered) + " of " +
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
  for (size_t i = 0; i < index.tensors.size(); ++i) {
    const IndexTensor& t = index.tensors[i];
    const std::string ctx = tensor_ctx(where, t.name);
    if (t.name.empty()) throw FormatError(where + ": a tensor has an empty name");
    if (i > 0 && !(index.tensors[i - 1].name < t.name)) {
      throw FormatError(ctx + ": tensors must be unique and sorted by name");
    }
    if (t.pieces.empty()) throw FormatError(ctx + ": has no pieces");
    for (const IndexPiece& p : t.pieces) {
      check_piece_file_name(p.file, ctx);
      if (require_checksums && !p.checksum) {
        throw FormatError(ctx + ": " + piece_desc(p) + " has no checksum");
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
  std::map<std::string, IndexTensor> by_name;
  std::map<std::string, Shape> global_of;
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
      const std::string ctx = where + ": " + s.file + ": tensor " + json_quote(ti.name);
      if (!ti.checksum) throw FormatError(ctx + ": has no checksum");
      auto [it, inserted] = by_name.try_emplace(ti.name);
      IndexTensor& t = it->second;
      if (inserted) {
        t.name = ti.name;
        t.dtype = ti.dtype;
        t.shape = ti.global_shape;
      } else if (t.dtype != ti.dtype) {
        throw FormatError(ctx + ": dtype " + std::string(dtype_name(ti.dtype)) + " but " +
                          t.pieces.front().file + " has " + std::string(dtype_name(t.dtype)));
      } else if (t.shape != ti.global_shape) {
        throw FormatError(ctx + ": global shape " + shape_to_string(ti.global_shape) + " but " +
                          t.pieces.front().file + " has " + shape_to_string(t.shape));
      }
      t.pieces.push_back(IndexPiece{s.file, ti.offsets, ti.shape, ti.checksum});
    }
  }
  CheckpointIndex index;
  index.world_size = world_size;
  index.metadata = std::move(metadata);
  index.tensors.reserve(by_name.size());
  for (auto& [name, t] : by_name) {
    std::sort(t.pieces.begin(), t.pieces.end(), offsets_less);
    index.tensors.push_back(std::move(t));
  }
  validate_index(index, where);
  return index;
}

CheckpointIndex build_index_from_dir(const std::string& dir, int64_t world_size,
                                     std::map<std::string, std::string> metadata) {
  if (world_size < 1) throw FormatError(dir + ": world_size must be at least 1");
  std::vector<std::string> names;
  names.reserve(static_cast<size_t>(world_size));
  for (int64_t r = 0; r < world_size; ++r) names.push_back(shard_file_name(r, world_size));
  return build_index_from_files(dir, names, world_size, std::move(metadata));
}

CheckpointIndex build_index_from_files(const std::string& dir,
                                       std::span<const std::string> file_names, int64_t world_size,
                                       std::map<std::string, std::string> metadata) {
  if (world_size < 1) throw FormatError(dir + ": world_size must be at least 1");
  if (file_names.size() != static_cast<size_t>(world_size)) {
    throw FormatError(dir + ": " + std::to_string(file_names.size()) + " shard file names for " +
                      std::to_string(world_size) + " ranks");
  }
  std::vector<ShardDescription> shards;
  shards.reserve(static_cast<size_t>(world_size));
  for (int64_t r = 0; r < world_size; ++r) {
    const std::string& name = file_names[static_cast<size_t>(r)];
    const std::string path = detail::join_path(dir, name);
    if (!detail::path_exists(path)) {
      throw FormatError(dir + ": missing shard file " + name + " (rank " + std::to_string(r) +
                        " of " + std::to_string(world_size) + " did not finish writing)");
    }
    ShardFile f = ShardFile::open(path, /*verify_checksums=*/false);
    const ShardHeader& h = f.header();
    if (!h.fsdp_ema || h.rank != r || h.world_size != world_size) {
      throw FormatError(path + ": not the fsdp_ema shard file of rank " + std::to_string(r) +
                        " of " + std::to_string(world_size) + " (metadata says rank " +
                        (h.rank ? std::to_string(*h.rank) : "?") + " of " +
                        (h.world_size ? std::to_string(*h.world_size) : "?") + ")");
    }
    ShardDescription d;
    d.file = name;
    d.rank = r;
    d.world_size = world_size;
    d.file_bytes = f.file_bytes();
    d.tensors = h.tensors;
    shards.push_back(std::move(d));
  }
  return build_index(shards, world_size, std::move(metadata));
}

std::string index_to_json(const CheckpointIndex& index) {
  std::string out;
  out += "{\n  \"format\": \"fsdp_ema\",\n  \"format_version\": ";
  out += std::to_string(index.format_version);
  out += ",\n  \"world_size\": ";
  out += std::to_string(index.world_size);
  out += ",\n  \"metadata\": {";
  bool first = true;
  for (const auto& [k, v] : index.metadata) {
    out += first ? "\n    " : ",\n    ";
    first = false;
    out += json_quote(k) + ": " + json_quote(v);
  }
  out += first ? "},\n" : "\n  },\n";
  out += "  \"tensors\": {";
  first = true;
  for (const IndexTensor& t : index.tensors) {
    out += first ? "\n    " : ",\n    ";
    first = false;
    out += json_quote(t.name);
    out += ": {\"dtype\": \"";
    out += dtype_name(t.dtype);
    out += "\", \"shape\": ";
    append_shape_json(out, t.shape);
    out += ", \"pieces\": [";
    for (size_t i = 0; i < t.pieces.size(); ++i) {
      const IndexPiece& p = t.pieces[i];
      out += i == 0 ? "\n      {\"file\": " : ",\n      {\"file\": ";
      out += json_quote(p.file);
      out += ", \"offsets\": ";
      append_shape_json(out, p.offsets);
      out += ", \"shape\": ";
      append_shape_json(out, p.shape);
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

CheckpointIndex parse_index_json(std::string_view text, const std::string& where) {
  const Json root = detail::parse_json_strict(text, where);
  if (!root.is_object()) {
    throw FormatError(where + ": index is a JSON " + detail::json_type_name(root) +
                      ", expected an object");
  }
  auto field = [&](const Json& obj, const char* key, const std::string& ctx) -> const Json& {
    auto it = obj.find(key);
    if (it == obj.end()) throw FormatError(ctx + ": missing \"" + key + "\"");
    return *it;
  };
  const Json& fmt = field(root, "format", where);
  if (!fmt.is_string() || fmt.get_ref<const std::string&>() != kIndexFormatName) {
    throw FormatError(where + ": \"format\" is " +
                      fmt.dump(-1, ' ', false, Json::error_handler_t::replace) +
                      ", expected \"fsdp_ema\"");
  }
  CheckpointIndex index;
  auto version = detail::as_nonneg_int(field(root, "format_version", where));
  if (!version) throw FormatError(where + ": \"format_version\" must be a non-negative integer");
  index.format_version = *version;
  if (index.format_version != kIndexFormatVersion) {
    throw FormatError(where + ": unsupported format_version " + std::to_string(*version) +
                      " (this build reads " + std::to_string(kIndexFormatVersion) + ")");
  }
  auto world = detail::as_nonneg_int(field(root, "world_size", where));
  if (!world || *world < 1) throw FormatError(where + ": \"world_size\" must be an integer >= 1");
  index.world_size = *world;

  if (auto it = root.find("metadata"); it != root.end()) {
    if (!it->is_object()) throw FormatError(where + ": \"metadata\" must be an object of strings");
    for (const auto& [k, v] : it->items()) {
      if (!v.is_string()) {
        throw FormatError(where + ": metadata entry " + json_quote(k) + " must be a string");
      }
      index.metadata.emplace(k, v.get<std::string>());
    }
  }

  const Json& tensors = field(root, "tensors", where);
  if (!tensors.is_object()) throw FormatError(where + ": \"tensors\" must be an object");
  index.tensors.reserve(tensors.size());
  for (const auto& [name, tj] : tensors.items()) {  // std::map order: sorted by name
    const std::string ctx = tensor_ctx(where, name);
    if (!tj.is_object()) throw FormatError(ctx + ": entry must be an object");
    IndexTensor t;
    t.name = name;
    const Json& dt = field(tj, "dtype", ctx);
    std::optional<DType> dtype;
    if (dt.is_string()) dtype = parse_dtype(dt.get_ref<const std::string&>());
    if (!dtype) {
      throw FormatError(ctx + ": unknown dtype " +
                        dt.dump(-1, ' ', false, Json::error_handler_t::replace));
    }
    t.dtype = *dtype;
    auto shape = detail::as_shape(field(tj, "shape", ctx));
    if (!shape) throw FormatError(ctx + ": \"shape\" must be an array of non-negative integers");
    t.shape = std::move(*shape);
    const Json& pieces = field(tj, "pieces", ctx);
    if (!pieces.is_array()) throw FormatError(ctx + ": \"pieces\" must be an array");
    for (const Json& pj : pieces) {
      if (!pj.is_object()) throw FormatError(ctx + ": every piece must be an object");
      IndexPiece p;
      const Json& file = field(pj, "file", ctx + ": piece");
      if (!file.is_string()) throw FormatError(ctx + ": piece \"file\" must be a string");
      p.file = file.get<std::string>();
      check_piece_file_name(p.file, ctx);
      auto offsets = detail::as_shape(field(pj, "offsets", ctx + ": piece in " + p.file));
      auto pshape = detail::as_shape(field(pj, "shape", ctx + ": piece in " + p.file));
      if (!offsets || !pshape) {
        throw FormatError(ctx + ": piece in " + p.file +
                          ": \"offsets\" and \"shape\" must be arrays of non-negative integers");
      }
      p.offsets = std::move(*offsets);
      p.shape = std::move(*pshape);
      const Json& sum = field(pj, "checksum", ctx + ": piece in " + p.file);
      if (sum.is_string()) p.checksum = parse_checksum(sum.get_ref<const std::string&>());
      if (!p.checksum) {
        throw FormatError(ctx + ": piece in " + p.file + ": checksum " +
                          sum.dump(-1, ' ', false, Json::error_handler_t::replace) +
                          " is not \"xxh3-64:<16 lowercase hex digits>\"");
      }
      t.pieces.push_back(std::move(p));
    }
    std::sort(t.pieces.begin(), t.pieces.end(), offsets_less);
    index.tensors.push_back(std::move(t));
  }
  validate_index(index, where);
  return index;
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
  if (!detail::is_directory(dir)) {
    throw FormatError(dir + ": not a directory (a checkpoint is a directory)");
  }
  const std::string path = detail::join_path(dir, kIndexFileName);
  if (!detail::path_exists(path)) {
    throw FormatError(dir +
                      ": incomplete checkpoint: fsdp_ema.index.json missing (the index is "
                      "written last, after every rank's shard file is durable)");
  }
  CheckpointIndex index = parse_index_json(detail::read_small_file(path, kMaxIndexBytes), path);
  resolve_all_pieces(dir, index);
  return index;
}

}  // namespace fsdp_ema::format
