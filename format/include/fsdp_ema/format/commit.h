// Committing a checkpoint directory, and the file name each rank writes, so that an overwrite
// replaces a committed checkpoint atomically: the old one stays loadable until the new index lands.
//
// An overwrite writes every rank's file under a name the committed index does not reference (the
// plain shard_file_name, or alternate_shard_file_name when the index references the plain one),
// then the new index replaces the old one with one rename, then the old files are removed. We do
// not stage into a sibling directory and swap it in: renameat2(RENAME_EXCHANGE) of directories is
// missing on NFS, Lustre and most FUSE file systems (a fallback of two renames leaves a moment with
// no checkpoint at all), and a swapped directory changes identity under the other ranks: nodes
// holding its old handle (NFS caches them) would write into the wrong tree, and the flock
// directory lock would guard the wrong inode. File renames within one directory are atomic
// everywhere the commit itself (an index rename) already is, and every rank keeps writing to the
// same path.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_set>

#include "fsdp_ema/format/index.h"

namespace fsdp_ema::format {

// The piece files the committed index of `dir` references: empty without an index, or with one
// that does not parse (such a checkpoint is not loadable: there is nothing to keep whole). An
// index that exists but cannot be read throws.
std::unordered_set<std::string> committed_files(const std::string& dir);

// The name rank `rank` of `world_size` writes its shard file under in `dir`: shard_file_name, or
// alternate_shard_file_name when the committed index references the former.
std::string shard_file_name_to_write(const std::string& dir, int64_t rank, int64_t world_size);

// True for the names our writers give shard files: shard-<digits>-of-<digits>[.b].safetensors.
bool is_shard_file_name(std::string_view name);

// Commits `dir`: builds the index from the headers of every rank's file (the names
// shard_file_name_to_write chose; with none of those written, the committed files again: a
// re-commit), writes it atomically (replacing a committed one only with `overwrite`, else
// FormatError "checkpoint already committed"), then removes the shard files that the new index
// does not reference (the replaced checkpoint's, or those of an earlier save at another world
// size), so that DCP's reader, which reads every *.safetensors file, sees this checkpoint only.
// Some ranks' new files without the others' is an error naming the missing ones; the committed
// checkpoint is then left as it was.
CheckpointIndex commit_directory(const std::string& dir, int64_t world_size, bool overwrite,
                                 bool fsync);

}  // namespace fsdp_ema::format
