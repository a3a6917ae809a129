// Test-only fault injection for file writes, loaded with LD_PRELOAD: once the process has written
// FSDP_EMA_FAULT_ENOSPC_AFTER bytes through write/pwrite (to descriptors above stderr), every
// further write fails with ENOSPC, as on a full disk. The variable is read at every call, so a
// test can arm it inside a running process.
#include <dlfcn.h>
#include <sys/types.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>

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

}  // extern "C"
