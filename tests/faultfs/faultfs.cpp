// Test-only fault injection for file writes and mappings, loaded with LD_PRELOAD:
// - once the process has written FSDP_EMA_FAULT_ENOSPC_AFTER bytes through write/pwrite (to
//   descriptors above stderr), every further write fails with ENOSPC, as on a full disk;
// - with FSDP_EMA_FAULT_TRUNCATE_ON_MMAP=N, a *.safetensors file is truncated to N bytes right
//   after each mmap of it succeeds, as if another process truncated it between a zero-copy load's
//   mapping and its verification (the pages past N then raise SIGBUS when touched).
// The variables are read at every call, so a test can arm them inside a running process.
#include <dlfcn.h>
#include <sys/mman.h>
#include <sys/types.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string>

namespace {

std::atomic<long long> g_written{0};

// True when this write must fail: the budget is set and would be exceeded.
bool out_of_space(int fd, size_t n) {
  if (fd <= 2) return false;
  const char* limit = std::getenv("FSDP_EMA_FAULT_ENOSPC_AFTER");
  if (limit == nullptr || *limit == '\0') return false;
  const long long before = g_written.fetch_add(static_cast<long long>(n));
  return before + static_cast<long long>(n) > std::atoll(limit);
}

template <typename Fn>
Fn real(const char* name) {
  return reinterpret_cast<Fn>(dlsym(RTLD_NEXT, name));
}

// After a mapping of `fd` was made: the truncation FSDP_EMA_FAULT_TRUNCATE_ON_MMAP asks for.
void truncate_if_armed(void* mapped, int fd) {
  const char* to = std::getenv("FSDP_EMA_FAULT_TRUNCATE_ON_MMAP");
  if (mapped == MAP_FAILED || fd <= 2 || to == nullptr || *to == '\0') return;
  char path[4096];
  const std::string link = "/proc/self/fd/" + std::to_string(fd);
  const ssize_t n = readlink(link.c_str(), path, sizeof(path) - 1);
  if (n <= 0) return;
  path[n] = '\0';
  constexpr const char* kSuffix = ".safetensors";
  const size_t k = std::strlen(kSuffix);
  if (static_cast<size_t>(n) < k || std::strcmp(path + n - k, kSuffix) != 0) return;
  (void)truncate(path, static_cast<off_t>(std::atoll(to)));
}

}  // namespace

extern "C" {

ssize_t write(int fd, const void* buf, size_t n) {
  static const auto fn = real<ssize_t (*)(int, const void*, size_t)>("write");
  if (out_of_space(fd, n)) {
    errno = ENOSPC;
    return -1;
  }
  return fn(fd, buf, n);
}

ssize_t pwrite(int fd, const void* buf, size_t n, off_t off) {
  static const auto fn = real<ssize_t (*)(int, const void*, size_t, off_t)>("pwrite");
  if (out_of_space(fd, n)) {
    errno = ENOSPC;
    return -1;
  }
  return fn(fd, buf, n, off);
}

ssize_t pwrite64(int fd, const void* buf, size_t n, off_t off) {
  static const auto fn = real<ssize_t (*)(int, const void*, size_t, off_t)>("pwrite64");
  if (out_of_space(fd, n)) {
    errno = ENOSPC;
    return -1;
  }
  return fn(fd, buf, n, off);
}

void* mmap(void* addr, size_t length, int prot, int flags, int fd, off_t offset) {
  static const auto fn = real<void* (*)(void*, size_t, int, int, int, off_t)>("mmap");
  void* p = fn(addr, length, prot, flags, fd, offset);
  truncate_if_armed(p, fd);
  return p;
}

void* mmap64(void* addr, size_t length, int prot, int flags, int fd, off_t offset) {
  static const auto fn = real<void* (*)(void*, size_t, int, int, int, off_t)>("mmap64");
  void* p = fn(addr, length, prot, flags, fd, offset);
  truncate_if_armed(p, fd);
  return p;
}

}  // extern "C"
