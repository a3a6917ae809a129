#pragma once

// Descriptions of the shard files this process wrote, so that a commit in the same process (a
// single-process save, and rank 0's own file in a sharded one) builds the index without parsing
// the header it has just written: at 100,000+ tensors that parse is a large part of a save.
// A description is used only while the file is the one written: the same identity (device,
// inode, size, modification time) and the same header bytes (hashed: one read of the header,
// no parse). A file replaced or rewritten since is parsed as usual.

#include <optional>
#include <string>

#include "fsdp_ema/format/tensor_info.h"

namespace fsdp_ema::format::detail {

// At most this many descriptions are kept (the oldest go first): one per shard file of a
// save in flight, released by the commit that uses it.
inline constexpr size_t kRecentShardsKept = 8;

// Records `d`, the description of the shard file just written at `path`, whose first
// 8 + header-length bytes hash (checksum_of) to `header_checksum`.
void remember_written_shard(const std::string& path, ShardDescription d, uint64_t header_checksum);

// The description recorded for `path`, removed from the record, if the file there is still the
// one written; nullopt otherwise.
std::optional<ShardDescription> take_written_shard(const std::string& path);

}  // namespace fsdp_ema::format::detail
