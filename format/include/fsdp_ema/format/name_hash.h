// Internal: the hash of every hash table whose keys come from a file (tensor names of a header or
// an index, JSON object keys, file names an index lists). XXH3-64 with a seed drawn at random once
// per process: std::hash<std::string_view> has a fixed seed and is invertible per 8-byte block, so
// a crafted file can give 300,000 names one hash and turn every insert into a walk of the whole
// chain (a 2.4 MB header took 12 s). With an unknown seed, no file can aim at a bucket.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace fsdp_ema::format::detail {

// XXH3-64 of the bytes with this process's seed.
uint64_t name_hash(std::string_view s);

// For std::unordered_{map,set} of std::string or std::string_view keys (heterogeneous lookup).
struct NameHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return static_cast<size_t>(name_hash(s)); }
  size_t operator()(const std::string& s) const { return operator()(std::string_view(s)); }
  size_t operator()(const char* s) const { return operator()(std::string_view(s)); }
};

}  // namespace fsdp_ema::format::detail
