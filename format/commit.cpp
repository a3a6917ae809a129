#include "fsdp_ema/format/commit.h"

#include <algorithm>
#include <string_view>
#include <vector>

#include "fsdp_ema/format/error.h"
#include "fsdp_ema/format/file_util.h"
#include "fsdp_ema/format/shard_writer.h"

namespace fsdp_ema::format {
namespace {

bool is_digits(std::string_view s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

}  // namespace

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

std::unordered_set<std::string> committed_files(const std::string& dir) {
  const std::string path = detail::join_path(dir, kIndexFileName);
  if (!detail::path_exists(path)) return {};
  const std::string text = detail::read_small_file(path, kMaxIndexBytes);
  CheckpointIndex index;
  try {
    index = parse_index_json(text, path);
  } catch (const FormatError&) {
    return {};
  }
  std::unordered_set<std::string> out;
  for (const IndexTensor& t : index.tensors) {
    for (const IndexPiece& p : t.pieces) out.insert(p.file);
  }
  return out;
}

std::string shard_file_name_to_write(const std::string& dir, int64_t rank, int64_t world_size) {
  std::string plain = shard_file_name(rank, world_size);
  if (committed_files(dir).contains(plain)) return alternate_shard_file_name(rank, world_size);
  return plain;
}

CheckpointIndex commit_directory(const std::string& dir, int64_t world_size, bool overwrite,
                                 bool fsync) {
  if (world_size < 1) throw FormatError(dir + ": world_size must be at least 1");
  const std::string index_path = detail::join_path(dir, kIndexFileName);
  if (!overwrite && detail::path_exists(index_path)) {
    throw FormatError(index_path +
                      ": checkpoint already committed (the index exists; pass overwrite=true to "
                      "replace it)");
  }
  const std::unordered_set<std::string> old_files = committed_files(dir);
  std::vector<std::string> names;
  std::vector<std::string> fresh_names;  // what save_shard wrote for each rank
  size_t written = 0;
  for (int64_t r = 0; r < world_size; ++r) {
    std::string plain = shard_file_name(r, world_size);
    std::string alternate = alternate_shard_file_name(r, world_size);
    const bool plain_committed = old_files.contains(plain);
    fresh_names.push_back(plain_committed ? alternate : plain);
    std::string& committed = plain_committed ? plain : alternate;
    if (detail::path_exists(detail::join_path(dir, fresh_names.back()))) {
      names.push_back(fresh_names.back());
      ++written;
    } else {
      // Not written: a re-commit of the committed file, or (not committed) a missing file that
      // build_index_from_files reports.
      names.push_back(old_files.contains(committed) ? committed : fresh_names.back());
    }
  }
  if (written > 0) {
    // A partial overwrite must not mix new files with the old checkpoint's.
    for (size_t r = 0; r < names.size(); ++r) {
      if (names[r] == fresh_names[r]) continue;
      throw FormatError(dir + ": missing shard file " + fresh_names[r] + " (rank " +
                        std::to_string(r) + " of " + std::to_string(world_size) +
                        " did not finish writing while " + std::to_string(written) +
                        " rank(s) did); the committed checkpoint is left as it was");
    }
  }
  const CheckpointIndex index = build_index_from_files(dir, names, world_size);
  write_index(dir, index, overwrite, fsync);

  // The new index is durable: files it does not reference belong to nothing loadable now.
  std::unordered_set<std::string> keep(names.begin(), names.end());
  bool removed = false;
  for (const std::string& n : detail::list_dir(dir)) {
    if (is_shard_file_name(n) && !keep.contains(n)) {
      detail::remove_quietly(detail::join_path(dir, n));
      removed = true;
    }
  }
  if (removed && fsync) {
    try {
      detail::fsync_directory(dir);
    } catch (const FormatError&) {
      // The commit is durable already; a removal that does not persist leaves a stray file that
      // the next commit removes again.
    }
  }
  return index;
}

}  // namespace fsdp_ema::format
