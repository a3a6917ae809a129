// Internal: POSIX file helpers with FormatError messages (fds, pread/pwrite loops, fsync, atomic
// replacement, read-only mappings).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "fsdp_ema/format/paths.h"  // parent_dir, base_name, join_path

namespace fsdp_ema::format::detail {

std::string errno_text(int err);

// Owns a file descriptor.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(UniqueFd&& o) noexcept : fd_(o.release()) {}
  UniqueFd& operator=(UniqueFd&& o) noexcept;
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd();
  int get() const { return fd_; }
  int release();
  // close(2), throwing on error (a failed close can mean lost writes on NFS).
  void close_or_throw(const std::string& path);

 private:
  int fd_ = -1;
};

UniqueFd open_read_only(const std::string& path);
// O_CREAT | O_EXCL | O_WRONLY, mode 0644 (before umask).
UniqueFd create_exclusive(const std::string& path);
uint64_t fd_size(int fd, const std::string& path);

// What a reader checks to know that a file it reopens (or holds open) is the one whose header it
// validated: the same inode, size, modification time and status-change time. An early refusal,
// not a proof: write(2) changes the ctime, which no user can set back, but a write through a
// shared mapping whose page is already dirty moves neither time stamp. What a load returns is
// proven by hashing it in the pass that read it (fsdp_ema/format/read_exec.h).
struct FileIdentity {
  uint64_t device = 0;
  uint64_t inode = 0;
  uint64_t size = 0;
  int64_t mtime_ns = 0;
  int64_t ctime_ns = 0;
  uint64_t links = 0;  // 0 once the file is unlinked (its open descriptors still read it)
  bool operator==(const FileIdentity&) const = default;
};
// Whether the file described by `now` (its descriptor's fstat) still holds what `then` saw: the
// same inode, size, mtime and ctime; a file unlinked since (links 0: an overwrite's commit
// removed it, which moves the ctime but not the bytes an open descriptor reads) keeps its data.
bool unchanged_since(const FileIdentity& now, const FileIdentity& then);
// fstat of an open regular file (throws for anything else).
FileIdentity file_identity(int fd, const std::string& path);
// stat of a path (links followed); nullopt when it does not exist or is not a regular file.
std::optional<FileIdentity> path_identity(const std::string& path);

void pwrite_all(int fd, const void* data, size_t size, uint64_t offset, const std::string& path);
// Throws "unexpected end of file" when the file is shorter than offset + size.
void pread_all(int fd, void* data, size_t size, uint64_t offset, const std::string& path);

void fsync_fd(int fd, const std::string& path);
void fsync_directory(const std::string& dir);
// Starts write-back of a range without waiting (sync_file_range), so that a final fsync has
// little left to do. Errors are ignored: the fsync reports them.
void start_writeback(int fd, uint64_t offset, uint64_t size);

// "<dir>/.<name>.tmp-<pid>-<16 hex random>": a hidden sibling that never ends in ".safetensors",
// so DCP's reader (which lists *.safetensors) never picks it up.
std::string temp_path_for(const std::string& final_path);
// True when `name` is a temporary starting with `prefix` (names.h's temporary_name_prefix) whose
// writing process no longer exists: what a crash or a kill mid-write left behind.
bool temporary_is_orphaned(std::string_view name, std::string_view prefix);

// rename(2), throwing on error.
void rename_replace(const std::string& from, const std::string& to);
// Renames only if `to` does not exist, atomically where the file system allows it
// (renameat2 RENAME_NOREPLACE, else link + unlink). Returns false if `to` exists.
bool rename_no_replace(const std::string& from, const std::string& to);

// Writes `content` to `final_path` through a temporary + fsync + rename + directory fsync.
// With replace = false, returns false (and writes nothing) if final_path exists.
bool write_file_atomically(const std::string& final_path, std::string_view content, bool fsync,
                           bool replace);

// Reads a whole (small) file; throws if it is larger than max_bytes.
std::string read_small_file(const std::string& path, uint64_t max_bytes);

// mkdir -p: every missing component of `dir`, 0755 before the umask (a path with a NUL byte is
// refused first). Returns the topmost directory it created ("" when `dir` existed), for
// remove_created_directories; throws FormatError when a component cannot be made or `dir` is no
// directory.
std::string make_directories(const std::string& dir);
// Removes `dir` and its parents up to `created` (a directory make_directories created, "" for
// none), each only while it is empty: what a failed save or export created, and nothing else.
void remove_created_directories(const std::string& dir, const std::string& created) noexcept;

bool path_exists(const std::string& path);
bool is_directory(const std::string& path);

// Removes a file if it exists, ignoring errors (cleanup paths).
void remove_quietly(const std::string& path) noexcept;

// The entries of a directory (not "." and ".."), sorted.
std::vector<std::string> list_dir(const std::string& dir);

// A private copy-on-write mapping of a whole file (nothing for an empty file): readers hand out
// zero-copy tensors over it, and a write to one stays in this process, never in the file.
class MappedFile {
 public:
  MappedFile() = default;
  MappedFile(int fd, uint64_t size, const std::string& path);
  MappedFile(MappedFile&& o) noexcept;
  MappedFile& operator=(MappedFile&& o) noexcept;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile();
  const std::byte* data() const { return data_; }
  uint64_t size() const { return size_; }

 private:
  const std::byte* data_ = nullptr;
  uint64_t size_ = 0;
};

}  // namespace fsdp_ema::format::detail
