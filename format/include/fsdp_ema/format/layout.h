// The on-disk rules of a checkpoint directory, in one place: the directory lock, stale-temporary
// cleanup, preparing a directory for a save (what an overwrite replaces), the save of one rank's
// file, the commit, sidecar files, and listing / removing whole checkpoints under a root. The
// file names themselves are in names.h. The torch ops (ops/save/, ops/checkpoint/), the fsdp-ema
// command line and, through the ops, the Python front all go through these functions; none of them
// creates, renames or removes checkpoint files on its own.
//
// Overwrites: every rank's file goes under a name the committed index does not reference (the
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
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <unordered_set>
#include <vector>

#include "fsdp_ema/format/index.h"
#include "fsdp_ema/format/name_hash.h"
#include "fsdp_ema/format/names.h"
#include "fsdp_ema/format/shard_writer.h"

namespace fsdp_ema::format {

// An advisory lock on a checkpoint directory (flock on the directory itself, so no file is
// created). Writers of shard files and readers (the command line) hold it shared, so ranks on one
// node still write in parallel; the commit and the removal of a checkpoint hold it exclusively.
// So a commit never runs while a shard file is being renamed in or a reader is reading, and once
// committed, no later shard file can replace one that the index describes. flock is coherent
// within a node; across nodes on a shared file system, ranks are ordered by the collectives of the
// Python front (every rank's file is written before rank 0 commits). Blocks until granted.
class DirectoryLock {
 public:
  enum class Mode { kShared, kExclusive };
  DirectoryLock(const std::string& dir, Mode mode);
  ~DirectoryLock();
  DirectoryLock(const DirectoryLock&) = delete;
  DirectoryLock& operator=(const DirectoryLock&) = delete;

 private:
  int fd_ = -1;
};

// True when `dir` holds the index (the commit marker).
bool is_committed(const std::string& dir);

// Removes the temporaries of `file` (".<file>.tmp-<pid>-<random>", see file_util.h) whose writing
// process no longer exists: what a crash during an earlier save left behind. Temporaries of live
// writers are kept. Only `file` is looked at, so other ranks writing the same directory at the same
// time are never touched.
void remove_stale_temporaries(const std::string& dir, std::string_view file);

// Every rank's first step of a save: creates `dir` (and its parents) if missing; returns whether it
// holds a committed checkpoint already (which save_shard_to_dir and the commit then refuse unless
// told to overwrite it). Changes nothing else: what an overwrite replaces is decided by
// shard_file_name_to_write and the commit.
bool prepare_checkpoint_dir(const std::string& dir);

// The piece files the committed index of `dir` references: empty without an index, or with one
// that does not parse (such a checkpoint is not loadable: there is nothing to keep whole). An
// index that exists but cannot be read throws.
std::unordered_set<std::string, detail::NameHash, std::equal_to<>> committed_files(
    const std::string& dir);

// The name rank `rank` of `world_size` writes its shard file under in `dir`: shard_file_name, or
// alternate_shard_file_name when the committed index references the former.
std::string shard_file_name_to_write(const std::string& dir, int64_t rank, int64_t world_size);

// One rank's save into `dir` (created with its parents if missing, and removed again when the save
// fails): under the shared directory lock, refuses a committed `dir` unless `overwrite`, removes
// this rank's stale temporaries, and writes its file (write_shard_file) under
// shard_file_name_to_write. Returns the file's size in bytes.
uint64_t save_shard_to_dir(const std::string& dir, std::vector<TensorToWrite> tensors,
                           const WriteOptions& options, bool overwrite);

// Commits `dir` under the exclusive directory lock: builds the index from the headers of every
// rank's file (the names shard_file_name_to_write chose; with none of those written, the committed
// files again: a re-commit), writes it atomically (replacing a committed one only with
// `overwrite`, else FormatError "checkpoint already committed"), then removes the shard files that
// the new index does not reference (the replaced checkpoint's, those of an earlier save at
// another world size, and the files of ranks that had no tensor to write), so that DCP's reader,
// which reads every *.safetensors file, sees this checkpoint only and `fsdp-ema verify --strict`
// passes. Some ranks' new files without the others' is an error naming the missing ones;
// the committed checkpoint is then left as it was. `metadata` goes into the index's "metadata"
// object (free-form strings: what a saver records beside its tensors, e.g. an EMA's step).
CheckpointIndex commit_directory(const std::string& dir, int64_t world_size, bool overwrite,
                                 bool fsync, std::map<std::string, std::string> metadata = {});

// Writes a small file `name` beside the shard files (temporary, fsync, rename), e.g. the readable
// copy of a training state's JSON. The commit neither reads nor removes it. `name` must be a plain
// file name that is none of the layout's own (no shard file, index or hidden name).
void write_sidecar(const std::string& dir, std::string_view name, std::string_view content,
                   bool fsync);

// The committed checkpoint directories directly inside `root` (not hidden, holding a regular
// index), in name order; none when `root` is no directory. With follow_links, a symbolic link to a
// directory counts as one; without, links are skipped.
std::vector<std::string> committed_checkpoints(const std::string& root, bool follow_links);

// Removes the checkpoint directory `dir` (a real directory, never followed through a link) with
// everything in it, under its exclusive lock: the index first, then the files named in `first`
// (plain names directly in `dir`: the commit markers of other writers of the folder, such as a
// trainer's state file), made durable before anything else goes, so an interrupted removal leaves
// an incomplete checkpoint, never a committed one with missing files; then the rest, where every
// directory inside loses its own index first (a checkpoint nested in `dir` is never left committed
// with missing files either). Every removal goes through directory file descriptors opened without
// following links, so nothing outside `dir` is ever changed.
void remove_checkpoint(const std::string& dir, const std::vector<std::string>& first = {});

}  // namespace fsdp_ema::format
