// The rules for the paths every entry point of format/ is given (directories, files, export and
// post-hoc targets): one place for what a path may hold and for "is this the same directory".
#pragma once

#include <string>
#include <string_view>

namespace fsdp_ema::format {

// Throws FormatError "<what>: path '<path>' holds a NUL byte at offset k; ..." for a path with
// an embedded NUL, which every POSIX call would silently cut there (load_shard("a\0.bin") read
// "a"; a save created the directory before the NUL). `what` names the argument or the call.
void check_path(std::string_view path, std::string_view what);

// The path (or name) with NUL and other control bytes written as \xNN, for messages: a raw NUL
// cuts a C string, and so the message of the exception that carries it.
std::string printable_path(std::string_view path);

// Whether `path` is the directory `dir` or lies inside it, after symlinks, ".", ".." and repeated
// slashes: the real path of `path` (of its nearest existing ancestor when it does not exist yet)
// and each of its ancestors are compared with `dir` by device and inode, so "<root>/s002/",
// "./s002", "s002/." and a symlink to s002 are all s002. False when `dir` does not exist.
bool same_or_inside(const std::string& path, const std::string& dir);

namespace detail {

// Plain string work, no file-system call.
std::string parent_dir(const std::string& path);  // "." for a bare name
std::string base_name(const std::string& path);
std::string join_path(const std::string& dir, std::string_view name);

}  // namespace detail

}  // namespace fsdp_ema::format
