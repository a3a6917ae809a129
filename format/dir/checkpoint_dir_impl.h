// The insides of CheckpointDir (fsdp_ema/format/checkpoint_dir.h), shared by its three sources:
// checkpoint_dir.cpp (open, the accessors and reads), checkpoint_dir_ours.cpp (our layout: the
// index and the shard files it names) and checkpoint_dir_dcp.cpp (DCP's HuggingFace layout: an
// index synthesized from the files). Private to format/dir/.
#pragma once

#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "fsdp_ema/format/checkpoint_dir.h"
#include "fsdp_ema/format/error.h"
#include "fsdp_ema/format/json_strict.h"
#include "fsdp_ema/format/names.h"
#include "fsdp_ema/format/read_exec.h"

namespace fsdp_ema::format {

// The data files among a directory's names, in their order.
inline std::vector<std::string> safetensors_files(const std::vector<std::string>& names) {
  std::vector<std::string> out;
  for (const std::string& n : names) {
    if (is_safetensors_file_name(n)) out.push_back(n);
  }
  return out;
}

struct CheckpointDir::Impl {
  std::string path;
  CheckpointLayout layout = CheckpointLayout::kFsdpEma;
  CheckpointIndex index;
  std::vector<std::string> file_names;  // sorted
  std::vector<ShardFile> files;         // parallel to file_names
  // Per tensor (index order) and piece: the file and its header entry (while opening).
  struct PieceRef {
    size_t file;
    const TensorInfo* info;
  };
  std::vector<std::vector<PieceRef>> pieces;
  // What the read pipeline plans on: every tensor's pieces in one array, tensor i's from
  // piece_begin[i] to piece_begin[i + 1].
  std::vector<StoredPiece> stored;
  std::vector<size_t> piece_begin;
  std::map<std::string, size_t> file_slot;  // file name -> index in files (while opening)

  // open(), one layout each (checkpoint_dir_ours.cpp, checkpoint_dir_dcp.cpp): fill index, files
  // and pieces, or throw.
  void open_fsdp_ema(const std::vector<std::string>& names);
  void open_dcp_huggingface(const std::vector<std::string>& names);
  // The steps of open_fsdp_ema: the index and the shard files it names, parsed side by side; each
  // file's header against the index (ours, its world size); every piece of the index against its
  // file's header entry, each entry of a file listed exactly once.
  void open_index_and_files(const std::vector<std::string>& names);
  void check_file_headers() const;
  void match_pieces();
  // The steps of open_dcp_huggingface: the index synthesized from the files' pieces, as DCP's
  // reader places them.
  void synthesize_index(const std::vector<std::string>& files);

  // Opens shard file `name` once (its header parsed, no checksum read); its index in `files`.
  size_t open_file(const std::string& name) {
    auto [it, inserted] = file_slot.try_emplace(name, files.size());
    if (inserted) {
      file_names.push_back(name);
      files.push_back(ShardFile::open(resolve_piece_path(path, name), /*verify_checksums=*/false));
    }
    return it->second;
  }

  size_t tensor_index(std::string_view name) const {
    const IndexTensor* t = index.find(name);
    if (t == nullptr) {
      throw FormatError(path + ": no tensor " + detail::json_quote(name) + " in this checkpoint");
    }
    return static_cast<size_t>(t - index.tensors.data());
  }

  // The pipeline's arrays, once the pieces are known.
  void finish_open() {
    size_t n = 0;
    for (const auto& p : pieces) n += p.size();
    stored.reserve(n);
    piece_begin.reserve(pieces.size() + 1);
    for (size_t ti = 0; ti < pieces.size(); ++ti) {
      piece_begin.push_back(stored.size());
      const IndexTensor& t = index.tensors[ti];
      for (size_t pi = 0; pi < pieces[ti].size(); ++pi) {
        stored.push_back({&files[pieces[ti][pi].file], pieces[ti][pi].info, t.pieces[pi].offsets});
      }
    }
    piece_begin.push_back(stored.size());
    pieces.clear();
    pieces.shrink_to_fit();
    file_slot.clear();
  }

  StoredTensor stored_tensor(size_t ti) const {
    const IndexTensor& t = index.tensors[ti];
    return {t.name, t.dtype, t.shape,
            std::span(stored).subspan(piece_begin[ti], piece_begin[ti + 1] - piece_begin[ti])};
  }

  // Plans the requests and runs them into host memory on `threads` threads.
  void read(std::span<const ReadRequest> requests, std::span<std::byte* const> dst,
            std::span<const uint64_t> dst_bytes, bool verify, size_t threads,
            std::shared_ptr<ReadSession> session = {}) const {
    const ReadPlan plan = plan_reads(requests, dst_bytes, path, {verify, std::move(session)});
    execute_reads(plan, dst, {threads, nullptr});
  }
  void read_one(const ReadRequest& request, void* dst, size_t dst_bytes, bool verify,
                size_t threads, std::shared_ptr<ReadSession> session = {}) const {
    std::byte* d = static_cast<std::byte*>(dst);
    const uint64_t bytes = dst_bytes;
    if (dst == nullptr && dst_bytes > 0) throw FormatError(path + ": destination is null");
    read(std::span(&request, 1), std::span(&d, 1), std::span(&bytes, 1), verify, threads,
         std::move(session));
  }
};

}  // namespace fsdp_ema::format
