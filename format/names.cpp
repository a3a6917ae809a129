#include "fsdp_ema/format/names.h"

#include <algorithm>
#include <cstdio>

namespace fsdp_ema::format {
namespace {

bool is_digits(std::string_view s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

}  // namespace

std::string shard_file_name(int64_t rank, int64_t world_size) {
  char buf[96];
  std::snprintf(buf, sizeof(buf), "shard-%05lld-of-%05lld.safetensors",
                static_cast<long long>(rank), static_cast<long long>(world_size));
  return buf;
}

std::string alternate_shard_file_name(int64_t rank, int64_t world_size) {
  std::string name = shard_file_name(rank, world_size);
  name.insert(name.size() - std::string_view(".safetensors").size(), ".b");
  return name;
}

bool is_shard_file_name(std::string_view n) {
  constexpr std::string_view kPrefix = "shard-", kSuffix = ".safetensors", kOf = "-of-";
  if (!n.starts_with(kPrefix) || !n.ends_with(kSuffix)) return false;
  n.remove_prefix(kPrefix.size());
  n.remove_suffix(kSuffix.size());
  if (n.ends_with(".b")) n.remove_suffix(2);
  const auto of = n.find(kOf);
  return of != std::string_view::npos && is_digits(n.substr(0, of)) &&
         is_digits(n.substr(of + kOf.size()));
}

std::string export_file_name(size_t k, size_t n) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "model-%05zu-of-%05zu.safetensors", k, n);
  return buf;
}

bool is_export_file_name(std::string_view n) {
  return n == kExportSingleFileName || n == kExportIndexFileName ||
         (n.starts_with("model-") && n.ends_with(".safetensors"));
}

}  // namespace fsdp_ema::format
