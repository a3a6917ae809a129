#include "fsdp_ema/format/names.h"

#include <algorithm>
#include <cstdio>

namespace fsdp_ema::format {
namespace {

bool is_digits(std::string_view s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

std::optional<int64_t> parse_index_digits(std::string_view s) {
  if (!is_digits(s) || s.size() > 9) return std::nullopt;
  int64_t v = 0;
  for (char c : s) v = v * 10 + (c - '0');
  return v;
}

}  // namespace

bool is_safetensors_file_name(std::string_view n) {
  return n.ends_with(kSafetensorsSuffix) && !n.starts_with(".");
}

std::string shard_file_name(int64_t rank, int64_t world_size) {
  char buf[96];
  std::snprintf(buf, sizeof(buf), "shard-%05lld-of-%05lld.safetensors",
                static_cast<long long>(rank), static_cast<long long>(world_size));
  return buf;
}

std::string alternate_shard_file_name(int64_t rank, int64_t world_size) {
  std::string name = shard_file_name(rank, world_size);
  name.insert(name.size() - kSafetensorsSuffix.size(), ".b");
  return name;
}

namespace {

// The rank and world-size digits of "shard-<digits>-of-<digits>[.b].safetensors", and whether it
// is the ".b" name.
struct ShardNameParts {
  std::string_view rank, world;
  bool alternate = false;
};

std::optional<ShardNameParts> shard_name_parts(std::string_view n) {
  constexpr std::string_view kPrefix = "shard-", kOf = "-of-";
  if (!n.starts_with(kPrefix) || !n.ends_with(kSafetensorsSuffix)) return std::nullopt;
  n.remove_prefix(kPrefix.size());
  n.remove_suffix(kSafetensorsSuffix.size());
  ShardNameParts out;
  if (n.ends_with(".b")) {
    n.remove_suffix(2);
    out.alternate = true;
  }
  const auto of = n.find(kOf);
  if (of == std::string_view::npos) return std::nullopt;
  out.rank = n.substr(0, of);
  out.world = n.substr(of + kOf.size());
  if (!is_digits(out.rank) || !is_digits(out.world)) return std::nullopt;
  return out;
}

}  // namespace

bool is_shard_file_name(std::string_view n) { return shard_name_parts(n).has_value(); }

std::optional<ShardFileName> parse_shard_file_name(std::string_view n) {
  const auto parts = shard_name_parts(n);
  if (!parts || parts->rank.size() > 18 || parts->world.size() > 18) return std::nullopt;
  ShardFileName out;
  out.alternate = parts->alternate;
  for (char c : parts->rank) out.rank = out.rank * 10 + (c - '0');
  for (char c : parts->world) out.world_size = out.world_size * 10 + (c - '0');
  return out;
}

std::string export_file_name(size_t k, size_t n) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "model-%05zu-of-%05zu.safetensors", k, n);
  return buf;
}

bool is_export_file_name(std::string_view n) {
  return n == kExportSingleFileName || n == kExportIndexFileName ||
         (n.starts_with("model-") && n.ends_with(kSafetensorsSuffix));
}

std::optional<DcpFileName> parse_dcp_file_name(std::string_view n) {
  if (!n.ends_with(kSafetensorsSuffix)) return std::nullopt;
  n.remove_suffix(kSafetensorsSuffix.size());
  DcpFileName out;
  if (n.starts_with("shard-")) {
    n.remove_prefix(6);
    const auto dash = n.find('-');
    if (dash == std::string_view::npos) return std::nullopt;
    auto s = parse_index_digits(n.substr(0, dash));
    if (!s) return std::nullopt;
    out.shard = *s;
    n.remove_prefix(dash + 1);
  }
  if (!n.starts_with("model-")) return std::nullopt;
  n.remove_prefix(6);
  const auto of = n.find("-of-");
  if (of == std::string_view::npos) return std::nullopt;
  auto m = parse_index_digits(n.substr(0, of));
  auto total = parse_index_digits(n.substr(of + 4));
  if (!m || !total || *m < 1 || *m > *total) return std::nullopt;
  out.model = *m;
  out.of = *total;
  return out;
}

std::string temporary_name_prefix(std::string_view name) {
  std::string out;
  out.reserve(name.size() + 6);
  out += '.';
  out += name;
  out += ".tmp-";
  return out;
}

long temporary_owner_pid(std::string_view temporary, std::string_view prefix) {
  if (!temporary.starts_with(prefix)) return 0;
  temporary.remove_prefix(prefix.size());
  long pid = 0;
  for (char c : temporary) {
    if (c < '0' || c > '9') break;
    if (pid > 1'000'000'000) return 0;  // no pid is this large
    pid = pid * 10 + (c - '0');
  }
  return pid;
}

}  // namespace fsdp_ema::format
