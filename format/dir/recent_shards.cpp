#include "fsdp_ema/format/recent_shards.h"

#include <deque>
#include <mutex>
#include <utility>

#include "fsdp_ema/format/checksum.h"
#include "fsdp_ema/format/error.h"
#include "fsdp_ema/format/file_util.h"
#include "fsdp_ema/format/safetensors_header.h"

namespace fsdp_ema::format::detail {
namespace {

struct Entry {
  std::string path;
  FileIdentity identity;
  uint64_t header_checksum = 0;
  ShardDescription description;
};

// Whether the safetensors header at `path` (length prefix included) hashes to `expected`.
bool header_matches(const std::string& path, uint64_t expected) {
  try {
    UniqueFd fd = open_read_only(path);
    std::byte first8[8] = {};
    pread_all(fd.get(), first8, 8, 0, path);
    uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint64_t>(first8[i]);
    if (n > kMaxHeaderBytes) return false;
    std::string bytes(8 + n, '\0');
    pread_all(fd.get(), bytes.data(), bytes.size(), 0, path);
    return checksum_of(bytes.data(), bytes.size()) == expected;
  } catch (const FormatError&) {
    return false;
  }
}

std::mutex& mutex() {
  static std::mutex m;
  return m;
}

std::deque<Entry>& entries() {
  static auto* e = new std::deque<Entry>();  // leaked: used until static teardown
  return *e;
}

}  // namespace

void remember_written_shard(const std::string& path, ShardDescription d, uint64_t header_checksum) {
  const auto identity = path_identity(path);
  std::lock_guard lock(mutex());
  auto& e = entries();
  std::erase_if(e, [&](const Entry& x) { return x.path == path; });
  if (!identity) return;
  if (e.size() >= kRecentShardsKept) e.pop_front();
  e.push_back(Entry{path, *identity, header_checksum, std::move(d)});
}

std::optional<ShardDescription> take_written_shard(const std::string& path) {
  std::optional<Entry> found;
  {
    std::lock_guard lock(mutex());
    auto& e = entries();
    for (auto it = e.begin(); it != e.end(); ++it) {
      if (it->path != path) continue;
      found = std::move(*it);
      e.erase(it);
      break;
    }
  }
  if (!found) return std::nullopt;
  const auto identity = path_identity(path);
  if (!identity || *identity != found->identity || !header_matches(path, found->header_checksum)) {
    return std::nullopt;
  }
  return std::move(found->description);
}

}  // namespace fsdp_ema::format::detail
