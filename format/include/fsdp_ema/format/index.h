// The checkpoint index "fsdp_ema.index.json": every tensor's dtype, global shape and pieces. It is
// written last, atomically, and is the commit marker of a checkpoint directory. Its sources, by
// what they do (format/dir/): index_check.cpp (what a valid index is: file names, coverage,
// validate_index; find), index_build.cpp (build_index, build_index_from_files), index_parse.cpp
// (parse_index_json) and index_file.cpp (index_to_json, write_index, read_index,
// resolve_piece_path).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "fsdp_ema/format/dtype.h"
#include "fsdp_ema/format/names.h"
#include "fsdp_ema/format/shape.h"
#include "fsdp_ema/format/tensor_info.h"

namespace fsdp_ema::format {

inline constexpr std::string_view kIndexFormatName = "fsdp_ema";
inline constexpr int64_t kIndexFormatVersion = 1;
// read_index refuses larger index files.
inline constexpr uint64_t kMaxIndexBytes = uint64_t{1} << 30;

// One stored box of a tensor: the local shard one rank wrote.
struct IndexPiece {
  std::string file;                  // plain file name inside the checkpoint directory
  Shape offsets;                     // global offset of the piece's first element
  Shape shape;                       // the piece's (local) shape
  std::optional<uint64_t> checksum;  // XXH3-64 of its bytes; always present in our indices
};

struct IndexTensor {
  std::string name;
  DType dtype = DType::kF32;
  Shape shape;                     // global shape
  std::vector<IndexPiece> pieces;  // sorted by offsets; together they cover `shape` exactly once
};

struct CheckpointIndex {
  int64_t format_version = kIndexFormatVersion;
  int64_t world_size = 1;
  std::vector<IndexTensor> tensors;             // sorted by name
  std::map<std::string, std::string> metadata;  // free-form user data

  // nullptr if absent (binary search: tensors are sorted by name).
  const IndexTensor* find(std::string_view name) const;
};

// Throws unless `name` is a plain file name: non-empty, valid UTF-8, no '/', '\\' or NUL, not
// starting with '.' (which excludes "." and ".." and our temporaries), ending in ".safetensors".
void check_piece_file_name(std::string_view name, const std::string& where);

// Throws unless the pieces of `tensor` lie inside its global shape and cover it exactly once
// (element counts add up to numel, and no two pieces intersect). The message names the tensor,
// the offending pieces and their files.
void check_coverage(const IndexTensor& tensor, const std::string& where);

// Structure of a whole index: known format version, world size >= 1, unique sorted names, at
// least one piece per tensor, one offset and size per dimension, plain file names, coverage, and
// (with require_checksums) a checksum on every piece.
void validate_index(const CheckpointIndex& index, const std::string& where,
                    bool require_checksums = true);

// The index of the given shard files (one per rank; each with our metadata): pieces grouped by
// tensor, dtype and global shape agreeing across ranks, then validate_index.
CheckpointIndex build_index(std::span<const ShardDescription> shards, int64_t world_size,
                            std::map<std::string, std::string> metadata = {});

// Reads the headers (not the data) of the file of every rank r in `dir`, named file_names[r]
// (shard_file_name, or an overwrite's alternate name), and builds their index. A missing rank's
// file is an error; an empty name: rank r contributes no file (its file held no tensor and an
// earlier commit removed it).
CheckpointIndex build_index_from_files(const std::string& dir,
                                       std::span<const std::string> file_names, int64_t world_size,
                                       std::map<std::string, std::string> metadata = {});

// JSON text of an index, and back (parse_index_json also validates; `where` names the source).
std::string index_to_json(const CheckpointIndex& index);
CheckpointIndex parse_index_json(std::string_view text, const std::string& where);

// Validates `index`, checks that every piece file exists inside `dir` (after resolving symbolic
// links), and writes <dir>/fsdp_ema.index.json atomically (temporary, fsync, rename, directory
// fsync). If the index already exists and !overwrite: FormatError "checkpoint already committed".
void write_index(const std::string& dir, const CheckpointIndex& index, bool overwrite = false,
                 bool fsync = true);

// Reads and validates <dir>/fsdp_ema.index.json; every piece file must resolve to a regular file
// inside `dir`. A directory without the index: FormatError "incomplete checkpoint:
// fsdp_ema.index.json missing".
CheckpointIndex read_index(const std::string& dir);

// The real path of piece file `name` in `dir`, after checking that it is a plain name and that
// it resolves (symbolic links followed) to an existing regular file inside `dir`.
std::string resolve_piece_path(const std::string& dir, std::string_view name);

}  // namespace fsdp_ema::format
