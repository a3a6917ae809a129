// The index file in a checkpoint directory: its JSON text (index_to_json), written atomically
// (write_index, the commit marker) and read back (read_index), and the piece files it names
// resolved inside the directory (resolve_piece_path).
#include <limits.h>
#include <stdlib.h>
#include <sys/stat.h>

#include <cerrno>
#include <memory>
#include <set>
#include <string>
#include <string_view>

#include "fsdp_ema/format/checksum.h"
#include "fsdp_ema/format/error.h"
#include "fsdp_ema/format/file_util.h"
#include "fsdp_ema/format/index.h"
#include "fsdp_ema/format/json_strict.h"
#include "fsdp_ema/format/names.h"
#include "fsdp_ema/format/paths.h"

namespace fsdp_ema::format {
namespace {

std::string real_path(const std::string& path) {
  std::unique_ptr<char, decltype(&::free)> p(::realpath(path.c_str(), nullptr), &::free);
  if (!p) {
    throw FormatError(path + ": cannot resolve: " + detail::errno_text(errno));
  }
  return p.get();
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

}  // namespace

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
