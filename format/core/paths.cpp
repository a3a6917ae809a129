#include "fsdp_ema/format/paths.h"

#include <limits.h>
#include <stdlib.h>
#include <sys/stat.h>

#include <cstdio>
#include <memory>

#include "fsdp_ema/format/error.h"

namespace fsdp_ema::format {

std::string printable_path(std::string_view path) {
  std::string out;
  out.reserve(path.size());
  for (const char c : path) {
    const auto u = static_cast<unsigned char>(c);
    if (u < 0x20 || u == 0x7f) {
      char buf[5];
      std::snprintf(buf, sizeof buf, "\\x%02x", u);
      out += buf;
    } else {
      out += c;
    }
  }
  return out;
}

void check_path(std::string_view path, std::string_view what) {
  const size_t nul = path.find('\0');
  if (nul == std::string_view::npos) return;
  throw FormatError(std::string(what) + ": path '" + printable_path(path) +
                    "' holds a NUL byte at offset " + std::to_string(nul) +
                    "; the operating system would use only the part before it");
}

namespace {

bool same_file(const struct stat& a, const struct stat& b) {
  return a.st_dev == b.st_dev && a.st_ino == b.st_ino;
}

// The real path of `path`, or of its nearest ancestor that exists (a path not created yet).
std::string real_existing_ancestor(std::string path) {
  for (;;) {
    std::unique_ptr<char, decltype(&::free)> r(::realpath(path.c_str(), nullptr), &::free);
    if (r) return r.get();
    const std::string parent = detail::parent_dir(path);
    if (parent == path || path.empty()) return "/";
    path = parent;
  }
}

}  // namespace

namespace detail {

std::string parent_dir(const std::string& path) {
  const auto slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

std::string base_name(const std::string& path) {
  const auto slash = path.find_last_of('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

std::string join_path(const std::string& dir, std::string_view name) {
  if (dir.empty()) return std::string(name);
  if (dir.back() == '/') return dir + std::string(name);
  return dir + "/" + std::string(name);
}

}  // namespace detail

bool same_or_inside(const std::string& path, const std::string& dir) {
  check_path(path, "same_or_inside");
  check_path(dir, "same_or_inside");
  struct stat target {};
  if (::stat(dir.c_str(), &target) != 0) return false;
  std::string p = real_existing_ancestor(path);
  // A real path has no symlink, "." or ".." left: its string prefixes are its ancestors.
  for (;;) {
    struct stat st {};
    if (::stat(p.c_str(), &st) == 0 && same_file(st, target)) return true;
    if (p == "/") return false;
    const size_t slash = p.find_last_of('/');
    p = slash == 0 ? "/" : p.substr(0, slash);
  }
}

}  // namespace fsdp_ema::format
