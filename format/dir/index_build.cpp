// Building an index: from the descriptions of shard files (build_index), and from the headers of
// the files of every rank in a directory (build_index_from_files), as the commit does.
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "fsdp_ema/format/error.h"
#include "fsdp_ema/format/file_util.h"
#include "fsdp_ema/format/index.h"
#include "fsdp_ema/format/json_strict.h"
#include "fsdp_ema/format/name_index.h"
#include "fsdp_ema/format/parallel.h"
#include "fsdp_ema/format/recent_shards.h"
#include "fsdp_ema/format/shard_file.h"
#include "index_impl.h"

namespace fsdp_ema::format {

using detail::json_quote;

CheckpointIndex build_index(std::span<const ShardDescription> shards, int64_t world_size,
                            std::map<std::string, std::string> metadata) {
  const std::string where = "build_index";
  if (world_size < 1) throw FormatError(where + ": world_size must be at least 1");
  std::set<std::string> files;
  std::set<int64_t> ranks;
  std::vector<IndexTensor> tensors;
  detail::NameIndex by_name;  // views of the names in `shards`, which outlive it
  for (const ShardDescription& s : shards) {
    check_piece_file_name(s.file, where);
    if (!files.insert(s.file).second) throw FormatError(where + ": file " + s.file + " twice");
    if (s.world_size != world_size) {
      throw FormatError(where + ": " + s.file + " was written for world size " +
                        std::to_string(s.world_size) + ", not " + std::to_string(world_size));
    }
    if (s.rank < 0 || s.rank >= world_size || !ranks.insert(s.rank).second) {
      throw FormatError(where + ": " + s.file + " has rank " + std::to_string(s.rank) +
                        ", out of range or repeated");
    }
    for (const TensorInfo& ti : s.tensors) {
      auto ctx = [&] { return where + ": " + s.file + ": tensor " + json_quote(ti.name); };
      if (!ti.checksum) throw FormatError(ctx() + ": has no checksum");
      const auto known = by_name.insert(ti.name, tensors.size());
      const bool inserted = !known;
      if (inserted) tensors.emplace_back();
      IndexTensor& t = tensors[known.value_or(tensors.size() - 1)];
      if (inserted) {
        t.name = ti.name;
        t.dtype = ti.dtype;
        t.shape = ti.global_shape;
      } else if (t.dtype != ti.dtype) {
        throw FormatError(ctx() + ": dtype " + std::string(dtype_name(ti.dtype)) + " but " +
                          t.pieces.front().file + " has " + std::string(dtype_name(t.dtype)));
      } else if (t.shape != ti.global_shape) {
        throw FormatError(ctx() + ": global shape " + shape_to_string(ti.global_shape) + " but " +
                          t.pieces.front().file + " has " + shape_to_string(t.shape));
      }
      t.pieces.push_back(IndexPiece{s.file, ti.offsets, ti.shape, ti.checksum});
    }
  }
  CheckpointIndex index;
  index.world_size = world_size;
  index.metadata = std::move(metadata);
  // Usually sorted already (one piece per tensor and rank; shard files list names in order):
  // checking first costs n comparisons where sorting costs n log n.
  for (IndexTensor& t : tensors) {
    if (!std::is_sorted(t.pieces.begin(), t.pieces.end(), offsets_less)) {
      std::sort(t.pieces.begin(), t.pieces.end(), offsets_less);
    }
  }
  auto by_name_less = [](const IndexTensor& a, const IndexTensor& b) { return a.name < b.name; };
  if (!std::is_sorted(tensors.begin(), tensors.end(), by_name_less)) {
    std::sort(tensors.begin(), tensors.end(), by_name_less);
  }
  index.tensors = std::move(tensors);
  validate_index(index, where);
  return index;
}

CheckpointIndex build_index_from_files(const std::string& dir,
                                       std::span<const std::string> file_names, int64_t world_size,
                                       std::map<std::string, std::string> metadata) {
  check_path(dir, "checkpoint directory");
  if (world_size < 1) throw FormatError(dir + ": world_size must be at least 1");
  if (file_names.size() != static_cast<size_t>(world_size)) {
    throw FormatError(dir + ": " + std::to_string(file_names.size()) + " shard file names for " +
                      std::to_string(world_size) + " ranks");
  }
  for (int64_t r = 0; r < world_size; ++r) {
    const std::string& name = file_names[static_cast<size_t>(r)];
    if (name.empty()) continue;  // a rank with no file (see the header)
    if (!detail::path_exists(detail::join_path(dir, name))) {
      throw FormatError(dir + ": missing shard file " + name + " (rank " + std::to_string(r) +
                        " of " + std::to_string(world_size) + " did not finish writing)");
    }
  }
  // One header per rank, parsed on the machine's cores (a file this process has just written is
  // described from memory instead: fsdp_ema/format/recent_shards.h). Errors in rank order.
  std::vector<ShardDescription> shards(static_cast<size_t>(world_size));
  const auto errors = detail::run_jobs(shards.size(), [&](size_t r) {
    const std::string& name = file_names[r];
    if (name.empty()) return;
    const std::string path = detail::join_path(dir, name);
    ShardDescription& d = shards[r];
    if (auto known = detail::take_written_shard(path);
        known && known->rank == static_cast<int64_t>(r) && known->world_size == world_size) {
      d = std::move(*known);
      d.file = name;
      return;
    }
    d = describe_shard_file(path, static_cast<int64_t>(r), world_size);
    d.file = name;
  });
  detail::rethrow_first(errors);
  std::erase_if(shards, [](const ShardDescription& d) { return d.file.empty(); });
  return build_index(shards, world_size, std::move(metadata));
}

}  // namespace fsdp_ema::format
