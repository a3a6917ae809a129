#include "fsdp_ema/format/layout.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <optional>
#include <string_view>
#include <unordered_set>
#include <vector>

#include "fsdp_ema/format/error.h"
#include "fsdp_ema/format/file_util.h"
#include "fsdp_ema/format/name_hash.h"
#include "fsdp_ema/format/names.h"
#include "fsdp_ema/format/paths.h"
#include "fsdp_ema/format/shard_writer.h"

namespace fsdp_ema::format {
namespace {

std::string errno_message(const std::string& what, const std::string& path, int err) {
  return path + ": " + what + ": " + detail::errno_text(err);
}

// Owns an open DIR stream.
struct DirStream {
  DIR* d = nullptr;
  ~DirStream() {
    if (d != nullptr) ::closedir(d);
  }
};

// Removes everything inside the directory open as `fd` (which this call takes over), descending
// into subdirectories through descriptors opened with O_NOFOLLOW.
void remove_contents(int fd, const std::string& path) {
  DirStream stream{::fdopendir(fd)};
  if (stream.d == nullptr) {
    const int err = errno;
    ::close(fd);
    throw FormatError(errno_message("cannot list the directory", path, err));
  }
  std::vector<std::string> names;
  while (const dirent* e = ::readdir(stream.d)) {
    const std::string_view n = e->d_name;
    if (n != "." && n != "..") names.emplace_back(n);
  }
  for (const std::string& n : names) {
    struct stat st {};
    if (::fstatat(fd, n.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) {
      if (errno == ENOENT) continue;
      throw FormatError(errno_message("cannot stat", detail::join_path(path, n), errno));
    }
    if (S_ISDIR(st.st_mode)) {
      const int child = ::openat(fd, n.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
      if (child < 0)
        throw FormatError(errno_message("cannot open", detail::join_path(path, n), errno));
      // A checkpoint nested here stops being committed before any of its files goes.
      if (::unlinkat(child, std::string(kIndexFileName).c_str(), 0) == 0) ::fsync(child);
      remove_contents(child, detail::join_path(path, n));
      if (::unlinkat(fd, n.c_str(), AT_REMOVEDIR) != 0 && errno != ENOENT) {
        throw FormatError(errno_message("cannot remove", detail::join_path(path, n), errno));
      }
    } else if (::unlinkat(fd, n.c_str(), 0) != 0 && errno != ENOENT) {
      throw FormatError(errno_message("cannot remove", detail::join_path(path, n), errno));
    }
  }
}

}  // namespace

DirectoryLock::DirectoryLock(const std::string& dir, Mode mode) {
  check_path(dir, "checkpoint directory");
  fd_ = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd_ < 0) {
    throw FormatError("directory '" + dir + "' cannot be opened: " + detail::errno_text(errno));
  }
  while (::flock(fd_, mode == Mode::kExclusive ? LOCK_EX : LOCK_SH) != 0) {
    if (errno == EINTR) continue;
    const int err = errno;
    ::close(fd_);
    throw FormatError("directory '" + dir + "' cannot be locked: " + detail::errno_text(err));
  }
}

DirectoryLock::~DirectoryLock() {
  ::flock(fd_, LOCK_UN);
  ::close(fd_);
}

bool is_committed(const std::string& dir) {
  check_path(dir, "checkpoint directory");
  return detail::path_exists(detail::join_path(dir, kIndexFileName));
}

void remove_stale_temporaries(const std::string& dir, std::string_view file) {
  const std::string prefix = temporary_name_prefix(file);
  for (const std::string& name : detail::list_dir(dir)) {
    if (detail::temporary_is_orphaned(name, prefix)) {
      detail::remove_quietly(detail::join_path(dir, name));
    }
  }
}

bool prepare_checkpoint_dir(const std::string& dir) {
  detail::make_directories(dir);
  return is_committed(dir);
}

uint64_t save_shard_to_dir(const std::string& dir, std::vector<TensorToWrite> tensors,
                           const WriteOptions& options, bool overwrite) {
  // A save that fails leaves no directory it created (the writer removes its temporary first).
  const std::string created = detail::make_directories(dir);
  try {
    const DirectoryLock lock(dir, DirectoryLock::Mode::kShared);
    if (!overwrite && is_committed(dir)) {
      throw FormatError("directory '" + dir + "' is already committed (" +
                        std::string(kIndexFileName) +
                        " exists); save into a fresh directory, or pass overwrite=True to "
                        "replace it");
    }
    // An overwrite writes under a name the committed index does not reference: the old
    // checkpoint stays whole until the commit replaces its index.
    const std::string file = shard_file_name_to_write(dir, options.rank, options.world_size);
    remove_stale_temporaries(dir, file);
    return write_shard_file(detail::join_path(dir, file), std::move(tensors), options);
  } catch (...) {
    detail::remove_created_directories(dir, created);
    throw;
  }
}

void write_sidecar(const std::string& dir, std::string_view name, std::string_view content,
                   bool fsync) {
  check_path(dir, "checkpoint directory");
  if (name.empty() || name.find('/') != std::string_view::npos || name.starts_with(".") ||
      name.find('\0') != std::string_view::npos) {
    throw FormatError(dir + ": sidecar name '" + std::string(name) +
                      "' must be a plain, non-hidden file name");
  }
  if (name == kIndexFileName || is_safetensors_file_name(name)) {
    throw FormatError(dir + ": sidecar name '" + std::string(name) +
                      "' is a name of the checkpoint layout itself (index or shard file)");
  }
  detail::make_directories(dir);
  detail::write_file_atomically(detail::join_path(dir, name), content, fsync, /*replace=*/true);
}

std::vector<std::string> committed_checkpoints(const std::string& root, bool follow_links) {
  check_path(root, "checkpoint root");
  std::vector<std::string> out;
  if (!detail::is_directory(root)) return out;
  for (const std::string& name : detail::list_dir(root)) {
    if (name.starts_with(".")) continue;
    const std::string path = detail::join_path(root, name);
    struct stat st {};
    const int rc = follow_links ? ::stat(path.c_str(), &st) : ::lstat(path.c_str(), &st);
    if (rc != 0 || !S_ISDIR(st.st_mode)) continue;
    const std::string index = detail::join_path(path, kIndexFileName);
    if ((follow_links ? ::stat(index.c_str(), &st) : ::lstat(index.c_str(), &st)) != 0 ||
        !S_ISREG(st.st_mode)) {
      continue;
    }
    out.push_back(name);
  }
  std::sort(out.begin(), out.end());
  return out;
}

void remove_checkpoint(const std::string& dir, const std::vector<std::string>& first) {
  check_path(dir, "checkpoint directory");
  for (const std::string& n : first) {
    if (n.empty() || n == "." || n == ".." || n.find('/') != std::string::npos ||
        n.find('\0') != std::string::npos) {
      throw FormatError(dir + ": first must name plain files in the directory, got \"" + n + "\"");
    }
  }
  std::string trimmed = dir;
  while (trimmed.size() > 1 && trimmed.back() == '/') trimmed.pop_back();
  const std::string parent = detail::parent_dir(trimmed), name = detail::base_name(trimmed);
  if (name.empty() || name == "." || name == "..") {
    throw FormatError(dir + ": not a checkpoint directory that can be removed");
  }
  detail::UniqueFd parent_fd(::open(parent.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (parent_fd.get() < 0) throw FormatError(errno_message("cannot open", parent, errno));
  // O_NOFOLLOW: a link (to a checkpoint elsewhere, say) is refused, never followed.
  const int fd =
      ::openat(parent_fd.get(), name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) throw FormatError(errno_message("cannot open the checkpoint directory", dir, errno));
  {
    // The lock is on the inode just opened, so it guards exactly what is removed.
    detail::UniqueFd lock_fd(::dup(fd));
    while (lock_fd.get() >= 0 && ::flock(lock_fd.get(), LOCK_EX) != 0 && errno == EINTR) {
    }
    std::vector<std::string> markers{std::string(kIndexFileName)};
    markers.insert(markers.end(), first.begin(), first.end());
    for (const std::string& marker : markers) {
      if (::unlinkat(fd, marker.c_str(), 0) != 0 && errno != ENOENT) {
        const int err = errno;
        ::close(fd);
        throw FormatError(
            errno_message("cannot remove the commit marker", detail::join_path(dir, marker), err));
      }
    }
    ::fsync(fd);  // the markers are gone for good before the data: never committed-but-partial
    remove_contents(fd, dir);
  }
  if (::unlinkat(parent_fd.get(), name.c_str(), AT_REMOVEDIR) != 0) {
    throw FormatError(errno_message("cannot remove the directory", dir, errno));
  }
}

namespace {

// The committed index of `dir`: none without one, or with one that does not parse.
std::optional<CheckpointIndex> committed_index(const std::string& dir) {
  const std::string path = detail::join_path(dir, kIndexFileName);
  if (!detail::path_exists(path)) return std::nullopt;
  const std::string text = detail::read_small_file(path, kMaxIndexBytes);
  try {
    return parse_index_json(text, path);
  } catch (const FormatError&) {
    return std::nullopt;
  }
}

std::optional<int64_t> committed_world_size(const std::string& dir) {
  const std::optional<CheckpointIndex> index = committed_index(dir);
  if (!index) return std::nullopt;
  return index->world_size;
}

}  // namespace

std::unordered_set<std::string, detail::NameHash, std::equal_to<>> committed_files(
    const std::string& dir) {
  const std::optional<CheckpointIndex> index = committed_index(dir);
  std::unordered_set<std::string, detail::NameHash, std::equal_to<>> out;
  if (!index) return out;
  for (const IndexTensor& t : index->tensors) {
    for (const IndexPiece& p : t.pieces) out.insert(p.file);
  }
  return out;
}

std::string shard_file_name_to_write(const std::string& dir, int64_t rank, int64_t world_size) {
  std::string plain = shard_file_name(rank, world_size);
  if (committed_files(dir).contains(plain)) return alternate_shard_file_name(rank, world_size);
  return plain;
}

namespace {

// Once the new index is durable: files it does not reference belong to nothing loadable now, a
// rank's file that holds no tensor included (a rank with nothing to write still writes one for
// the commit; left behind, every reader that lists the directory would count it as stray).
void remove_unreferenced(const std::string& dir, const CheckpointIndex& index,
                         const std::vector<std::string>& listing, bool fsync) {
  std::unordered_set<std::string, detail::NameHash, std::equal_to<>> keep;
  for (const IndexTensor& t : index.tensors) {
    for (const IndexPiece& p : t.pieces) keep.insert(p.file);
  }
  bool removed = false;
  for (const std::string& n : listing) {
    if (is_shard_file_name(n) && !keep.contains(n)) {
      detail::remove_quietly(detail::join_path(dir, n));
      removed = true;
    }
  }
  if (removed && fsync) {
    try {
      detail::fsync_directory(dir);
    } catch (const FormatError&) {
      // The commit is durable already; a removal that does not persist leaves a stray file that
      // the next commit removes again.
    }
  }
}

}  // namespace

CheckpointIndex commit_directory(const std::string& dir, int64_t world_size, bool overwrite,
                                 bool fsync, std::map<std::string, std::string> metadata) {
  check_path(dir, "checkpoint directory");
  if (world_size < 1) throw FormatError(dir + ": world_size must be at least 1");
  const DirectoryLock lock(dir, DirectoryLock::Mode::kExclusive);
  const std::string index_path = detail::join_path(dir, kIndexFileName);
  if (!overwrite && detail::path_exists(index_path)) {
    throw FormatError(index_path +
                      ": checkpoint already committed (the index exists; pass overwrite=true to "
                      "replace it)");
  }
  const auto old_files = committed_files(dir);
  // A rank with no piece in the committed index wrote a file with no tensor, which that commit
  // removed: a re-commit at the same world size takes it as empty again.
  const bool recommit_same_world =
      !old_files.empty() && committed_world_size(dir) == std::optional<int64_t>(world_size);
  // Every rank needs a file (plain or ".b") of this world size, unless a re-commit at the
  // committed world size (whose index bounds it) takes a removed empty rank as empty: refused
  // before any per-rank work when the listing cannot hold them (a world_size of 10**6 costs one
  // listing, not 10**6 names and stats).
  const std::vector<std::string> listing = detail::list_dir(dir);
  std::unordered_set<std::string_view, detail::NameHash, std::equal_to<>> listed;
  std::unordered_set<int64_t> ranks_present;
  for (const std::string& n : listing) {
    listed.insert(n);
    const auto parsed = parse_shard_file_name(n);
    if (parsed && parsed->world_size == world_size && parsed->rank < world_size) {
      ranks_present.insert(parsed->rank);
    }
  }
  if (!recommit_same_world && static_cast<int64_t>(ranks_present.size()) < world_size) {
    int64_t missing = 0;
    while (ranks_present.contains(missing)) ++missing;
    throw FormatError(dir + ": missing shard file " + shard_file_name(missing, world_size) +
                      " (rank " + std::to_string(missing) + " of " + std::to_string(world_size) +
                      " did not finish writing); files of " + std::to_string(ranks_present.size()) +
                      " of the " + std::to_string(world_size) + " ranks are present");
  }
  std::vector<std::string> names;
  std::vector<std::string> fresh_names;  // what save_shard wrote for each rank
  size_t written = 0;
  for (int64_t r = 0; r < world_size; ++r) {
    std::string plain = shard_file_name(r, world_size);
    std::string alternate = alternate_shard_file_name(r, world_size);
    const bool plain_committed = old_files.contains(plain);
    fresh_names.push_back(plain_committed ? alternate : plain);
    std::string& committed = plain_committed ? plain : alternate;
    if (listed.contains(fresh_names.back())) {
      names.push_back(fresh_names.back());
      ++written;
    } else if (old_files.contains(committed)) {
      names.push_back(committed);  // not written: a re-commit of the committed file
    } else if (recommit_same_world) {
      names.emplace_back();  // an empty rank of the committed checkpoint (see above)
    } else {
      names.push_back(fresh_names.back());  // missing: build_index_from_files reports it
    }
  }
  if (written > 0) {
    // A partial overwrite must not mix new files with the old checkpoint's.
    for (size_t r = 0; r < names.size(); ++r) {
      if (names[r] == fresh_names[r]) continue;
      throw FormatError(dir + ": missing shard file " + fresh_names[r] + " (rank " +
                        std::to_string(r) + " of " + std::to_string(world_size) +
                        " did not finish writing while " + std::to_string(written) +
                        " rank(s) did); the committed checkpoint is left as it was");
    }
  }
  const CheckpointIndex index = build_index_from_files(dir, names, world_size, std::move(metadata));
  write_index(dir, index, overwrite, fsync);

  remove_unreferenced(dir, index, listing, fsync);
  return index;
}

}  // namespace fsdp_ema::format
