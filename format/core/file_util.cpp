#include "fsdp_ema/format/file_util.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>
#include <random>
#include <utility>

#include "fsdp_ema/format/error.h"
#include "fsdp_ema/format/names.h"
#include "fsdp_ema/format/paths.h"

namespace fsdp_ema::format::detail {

std::string errno_text(int err) {
  char buf[256];
  // GNU strerror_r returns the message pointer (which may or may not be buf).
  const char* msg = strerror_r(err, buf, sizeof(buf));
  return msg;
}

UniqueFd& UniqueFd::operator=(UniqueFd&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = o.release();
  }
  return *this;
}

UniqueFd::~UniqueFd() {
  if (fd_ >= 0) ::close(fd_);
}

int UniqueFd::release() { return std::exchange(fd_, -1); }

void UniqueFd::close_or_throw(const std::string& path) {
  const int fd = release();
  if (fd >= 0 && ::close(fd) != 0) {
    throw FormatError(path + ": close failed: " + errno_text(errno));
  }
}

UniqueFd open_read_only(const std::string& path) {
  // O_NONBLOCK: opening a FIFO must not hang (fd_size then refuses anything but a regular file).
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) throw FormatError(path + ": cannot open: " + errno_text(errno));
  return UniqueFd(fd);
}

UniqueFd create_exclusive(const std::string& path) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) throw FormatError(path + ": cannot create: " + errno_text(errno));
  return UniqueFd(fd);
}

uint64_t fd_size(int fd, const std::string& path) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) throw FormatError(path + ": fstat failed: " + errno_text(errno));
  if (!S_ISREG(st.st_mode)) throw FormatError(path + ": not a regular file");
  return static_cast<uint64_t>(st.st_size);
}

namespace {
FileIdentity identity_of(const struct stat& st) {
  return {static_cast<uint64_t>(st.st_dev),
          static_cast<uint64_t>(st.st_ino),
          static_cast<uint64_t>(st.st_size),
          static_cast<int64_t>(st.st_mtim.tv_sec) * 1'000'000'000 + st.st_mtim.tv_nsec,
          static_cast<int64_t>(st.st_ctim.tv_sec) * 1'000'000'000 + st.st_ctim.tv_nsec,
          static_cast<uint64_t>(st.st_nlink)};
}
}  // namespace

bool unchanged_since(const FileIdentity& now, const FileIdentity& then) {
  return now.device == then.device && now.inode == then.inode && now.size == then.size &&
         now.mtime_ns == then.mtime_ns && (now.ctime_ns == then.ctime_ns || now.links == 0);
}

FileIdentity file_identity(int fd, const std::string& path) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) throw FormatError(path + ": fstat failed: " + errno_text(errno));
  if (!S_ISREG(st.st_mode)) throw FormatError(path + ": not a regular file");
  return identity_of(st);
}

std::optional<FileIdentity> path_identity(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return std::nullopt;
  return identity_of(st);
}

void pwrite_all(int fd, const void* data, size_t size, uint64_t offset, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    // Linux transfers at most 0x7ffff000 bytes per call.
    const size_t n = std::min<size_t>(size, size_t{1} << 30);
    const ssize_t w = ::pwrite(fd, p, n, static_cast<off_t>(offset));
    if (w < 0) {
      if (errno == EINTR) continue;
      throw FormatError(path + ": write of " + std::to_string(n) + " bytes at offset " +
                        std::to_string(offset) + " failed: " + errno_text(errno));
    }
    if (w == 0)
      throw FormatError(path + ": write made no progress at offset " + std::to_string(offset));
    p += w;
    size -= static_cast<size_t>(w);
    offset += static_cast<uint64_t>(w);
  }
}

void pread_all(int fd, void* data, size_t size, uint64_t offset, const std::string& path) {
  char* p = static_cast<char*>(data);
  while (size > 0) {
    const size_t n = std::min<size_t>(size, size_t{1} << 30);
    const ssize_t r = ::pread(fd, p, n, static_cast<off_t>(offset));
    if (r < 0) {
      if (errno == EINTR) continue;
      throw FormatError(path + ": read of " + std::to_string(n) + " bytes at offset " +
                        std::to_string(offset) + " failed: " + errno_text(errno));
    }
    if (r == 0) {
      throw FormatError(path + ": unexpected end of file at offset " + std::to_string(offset) +
                        " (" + std::to_string(size) + " more bytes expected): truncated?");
    }
    p += r;
    size -= static_cast<size_t>(r);
    offset += static_cast<uint64_t>(r);
  }
}

void fsync_fd(int fd, const std::string& path) {
  while (::fsync(fd) != 0) {
    if (errno == EINTR) continue;
    throw FormatError(path + ": fsync failed: " + errno_text(errno));
  }
}

void fsync_directory(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) throw FormatError(dir + ": cannot open directory to fsync it: " + errno_text(errno));
  UniqueFd owner(fd);
  while (::fsync(fd) != 0) {
    if (errno == EINTR) continue;
    // Some file systems refuse fsync on directories; the rename itself is then what we get.
    if (errno == EINVAL || errno == EROFS) return;
    throw FormatError(dir + ": directory fsync failed: " + errno_text(errno));
  }
}

void start_writeback(int fd, uint64_t offset, uint64_t size) {
#if defined(__linux__)
  (void)::sync_file_range(fd, static_cast<off_t>(offset), static_cast<off_t>(size),
                          SYNC_FILE_RANGE_WRITE);
#else
  (void)fd;
  (void)offset;
  (void)size;
#endif
}

std::string temp_path_for(const std::string& final_path) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::random_device rd;
  uint64_t r = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  std::string suffix(16, '0');
  for (char& c : suffix) {
    c = kHex[r & 0xf];
    r >>= 4;
  }
  return join_path(parent_dir(final_path), temporary_name_prefix(base_name(final_path)) +
                                               std::to_string(::getpid()) + "-" + suffix);
}

bool temporary_is_orphaned(std::string_view name, std::string_view prefix) {
  const long pid = temporary_owner_pid(name, prefix);
  return pid > 0 && ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH;
}

void rename_replace(const std::string& from, const std::string& to) {
  if (::rename(from.c_str(), to.c_str()) != 0) {
    throw FormatError(to + ": cannot rename " + from + " into place: " + errno_text(errno));
  }
}

bool rename_no_replace(const std::string& from, const std::string& to) {
#if defined(__linux__) && defined(RENAME_NOREPLACE)
  if (::renameat2(AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str(), RENAME_NOREPLACE) == 0) {
    return true;
  }
  if (errno == EEXIST) return false;
  if (errno != EINVAL && errno != ENOSYS && errno != ENOTSUP) {
    throw FormatError(to + ": cannot rename " + from + " into place: " + errno_text(errno));
  }
#endif
  // link(2) fails with EEXIST atomically, where hard links exist.
  if (::link(from.c_str(), to.c_str()) == 0) {
    ::unlink(from.c_str());
    return true;
  }
  if (errno == EEXIST) return false;
  if (errno != EPERM && errno != ENOTSUP && errno != EXDEV) {
    throw FormatError(to + ": cannot link " + from + " into place: " + errno_text(errno));
  }
  // Last resort on file systems with neither: check, then rename (not atomic).
  if (path_exists(to)) return false;
  rename_replace(from, to);
  return true;
}

bool write_file_atomically(const std::string& final_path, std::string_view content, bool fsync,
                           bool replace) {
  const std::string tmp = temp_path_for(final_path);
  UniqueFd fd = create_exclusive(tmp);
  try {
    pwrite_all(fd.get(), content.data(), content.size(), 0, tmp);
    if (fsync) fsync_fd(fd.get(), tmp);
    fd.close_or_throw(tmp);
    if (replace) {
      rename_replace(tmp, final_path);
    } else if (!rename_no_replace(tmp, final_path)) {
      remove_quietly(tmp);
      return false;
    }
  } catch (...) {
    remove_quietly(tmp);
    throw;
  }
  if (fsync) fsync_directory(parent_dir(final_path));
  return true;
}

std::string read_small_file(const std::string& path, uint64_t max_bytes) {
  UniqueFd fd = open_read_only(path);
  const uint64_t size = fd_size(fd.get(), path);
  if (size > max_bytes) {
    throw FormatError(path + ": file is " + std::to_string(size) + " bytes, more than the " +
                      std::to_string(max_bytes) + "-byte limit");
  }
  std::string out(size, '\0');
  pread_all(fd.get(), out.data(), out.size(), 0, path);
  return out;
}

std::string make_directories(const std::string& dir) {
  if (dir.empty()) throw FormatError("directory: the path is empty");
  check_path(dir, "directory");
  std::string created;
  for (size_t pos = dir.find('/', 1);; pos = dir.find('/', pos + 1)) {
    const std::string part = pos == std::string::npos ? dir : dir.substr(0, pos);
    if (!part.empty()) {
      if (::mkdir(part.c_str(), 0755) == 0) {
        if (created.empty()) created = part;
      } else if (errno != EEXIST) {
        const int err = errno;
        remove_created_directories(part, created);
        throw FormatError(part + ": cannot create the directory: " + errno_text(err));
      }
    }
    if (pos == std::string::npos) break;
  }
  if (!is_directory(dir)) throw FormatError(dir + ": not a directory");
  return created;
}

void remove_created_directories(const std::string& dir, const std::string& created) noexcept {
  if (created.empty()) return;
  std::string d = dir;
  while (d.size() > 1 && d.back() == '/') d.pop_back();
  // dir, then its parents, up to and including `created`, each only while empty (rmdir).
  for (; d.size() >= created.size(); d = parent_dir(d)) {
    if (::rmdir(d.c_str()) != 0 || d == created) return;
  }
}

bool path_exists(const std::string& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0;
}

bool is_directory(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

void remove_quietly(const std::string& path) noexcept { (void)::unlink(path.c_str()); }

std::vector<std::string> list_dir(const std::string& dir) {
  std::unique_ptr<DIR, int (*)(DIR*)> d(::opendir(dir.c_str()), &::closedir);
  if (!d) throw FormatError(dir + ": cannot list directory: " + errno_text(errno));
  std::vector<std::string> names;
  while (const dirent* e = ::readdir(d.get())) {
    const std::string_view n = e->d_name;
    if (n != "." && n != "..") names.emplace_back(n);
  }
  std::sort(names.begin(), names.end());
  return names;
}

MappedFile::MappedFile(int fd, uint64_t size, const std::string& path) : size_(size) {
  if (size == 0) return;
  // Private and writable: torch-side callers hand out zero-copy tensors over the mapping, and a
  // write to one must neither fault nor reach the file (copy-on-write keeps it in this process).
  void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
  if (p == MAP_FAILED) throw FormatError(path + ": mmap failed: " + errno_text(errno));
  data_ = static_cast<const std::byte*>(p);
}

MappedFile::MappedFile(MappedFile&& o) noexcept
    : data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)) {}

MappedFile& MappedFile::operator=(MappedFile&& o) noexcept {
  if (this != &o) {
    if (data_ != nullptr) ::munmap(const_cast<std::byte*>(data_), size_);
    data_ = std::exchange(o.data_, nullptr);
    size_ = std::exchange(o.size_, 0);
  }
  return *this;
}

MappedFile::~MappedFile() {
  if (data_ != nullptr) ::munmap(const_cast<std::byte*>(data_), size_);
}

}  // namespace fsdp_ema::format::detail
