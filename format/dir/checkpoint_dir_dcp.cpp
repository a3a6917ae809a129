// CheckpointDir::open for a directory without our index: DCP's HuggingFace writer's files (or a
// plain Hugging Face directory), the index synthesized from every file's pieces as DCP's reader
// places them.
#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "checkpoint_dir_impl.h"
#include "fsdp_ema/format/index.h"

namespace fsdp_ema::format {
namespace {

using detail::json_quote;

// A directory of DCP HuggingFace files records no world size and no global shapes (its reader
// infers each shape from the pieces present), so a lost file can shrink tensors silently. What
// the names do record is checked: "model-<M>-of-<N>" files must all be there (1..N, one N), and
// the "shard-<S>" numbers of a distributed save (rank + 1; every rank writes one) must run
// 1..K without a hole. A lost *last* rank file is the one loss nothing in DCP's output shows.
void check_dcp_file_set(const std::string& dir, const std::vector<std::string>& files) {
  std::set<int64_t> shards;
  std::map<int64_t, std::set<int64_t>> models_of;  // N -> M seen (unsharded names only)
  for (const std::string& f : files) {
    auto n = parse_dcp_file_name(f);
    if (!n) continue;
    if (n->shard > 0) {
      shards.insert(n->shard);
    } else {
      models_of[n->of].insert(n->model);
    }
  }
  if (!shards.empty()) {
    int64_t expect = 1;
    for (int64_t s : shards) {
      if (s != expect) {
        throw FormatError(dir + ": incomplete DCP checkpoint: files of shard " +
                          std::to_string(expect) + " (rank " + std::to_string(expect - 1) +
                          ") are missing but shard " + std::to_string(s) + " is present");
      }
      ++expect;
    }
  }
  if (models_of.size() > 1) {
    throw FormatError(dir + ": model-<M>-of-<N> files disagree on N (" +
                      std::to_string(models_of.begin()->first) + " and " +
                      std::to_string(models_of.rbegin()->first) + ")");
  }
  for (const auto& [total, seen] : models_of) {
    if (static_cast<int64_t>(seen.size()) != total) {
      int64_t missing = 1;
      while (seen.contains(missing)) ++missing;
      throw FormatError(dir + ": incomplete checkpoint: model file " + std::to_string(missing) +
                        " of " + std::to_string(total) + " is missing");
    }
  }
}

}  // namespace

// No index: DCP's HuggingFace writer's files (or a plain Hugging Face directory), the index
// synthesized from every file's pieces as DCP's reader places them.
void CheckpointDir::Impl::open_dcp_huggingface(const std::vector<std::string>& names) {
  const std::string& dir = path;
  const std::vector<std::string> st = safetensors_files(names);
  for (const std::string& n : st) {
    if (is_shard_file_name(n)) {
      throw FormatError(dir + ": incomplete checkpoint: " + std::string(kIndexFileName) +
                        " missing (found " + n +
                        "; the index is written last, after every rank's file)");
    }
  }
  if (st.empty()) {
    if (std::binary_search(names.begin(), names.end(), kDcpMetadataFileName)) {
      throw FormatError(dir + ": a native torch.distributed.checkpoint directory (pickled " +
                        std::string(kDcpMetadataFileName) +
                        " and its data files) is not readable here: pickle is never loaded; save "
                        "with HuggingFaceStorageWriter instead");
    }
    throw FormatError(dir + ": not a checkpoint: no " + std::string(kIndexFileName) + " and no " +
                      std::string(kSafetensorsSuffix) + " files");
  }
  check_dcp_file_set(dir, st);
  layout = CheckpointLayout::kDcpHuggingFace;
  synthesize_index(st);
}

void CheckpointDir::Impl::synthesize_index(const std::vector<std::string>& st) {
  const std::string& dir = path;
  std::map<std::string, IndexTensor> by_name;
  std::map<std::string, std::vector<Impl::PieceRef>> refs;
  for (const std::string& n : st) {
    const size_t fi = open_file(n);
    const ShardFile& f = files[fi];
    if (f.is_fsdp_ema()) {
      throw FormatError(dir + ": incomplete checkpoint: " + std::string(kIndexFileName) +
                        " missing (" + n + " is an fsdp_ema shard file)");
    }
    for (const TensorInfo& info : f.tensors()) {
      auto [it, inserted] = by_name.try_emplace(info.name);
      IndexTensor& t = it->second;
      if (inserted) {
        t.name = info.name;
        t.dtype = info.dtype;
        t.shape.assign(info.shape.size(), 0);
      } else if (t.dtype != info.dtype || t.shape.size() != info.shape.size()) {
        throw FormatError(f.path() + ": tensor " + json_quote(info.name) + " is " +
                          std::string(dtype_name(info.dtype)) + " with " +
                          std::to_string(info.shape.size()) + " dimensions but " +
                          t.pieces.front().file + " has it as " + std::string(dtype_name(t.dtype)) +
                          " with " + std::to_string(t.shape.size()));
      }
      for (size_t d = 0; d < info.shape.size(); ++d) {
        t.shape[d] = std::max(t.shape[d], info.offsets[d] + info.shape[d]);
      }
      t.pieces.push_back(IndexPiece{n, info.offsets, info.shape, info.checksum});
      refs[info.name].push_back(Impl::PieceRef{fi, &info});
    }
  }
  index.world_size = static_cast<int64_t>(std::max<size_t>(1, st.size()));
  for (auto& entry : by_name) {
    // Keep pieces and their file references in the same (offset) order. (No structured
    // binding: clang 14 cannot capture one in the lambda below.)
    IndexTensor& t = entry.second;
    std::vector<Impl::PieceRef>& r = refs[entry.first];
    std::vector<size_t> order(t.pieces.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
      return t.pieces[a].offsets != t.pieces[b].offsets ? t.pieces[a].offsets < t.pieces[b].offsets
                                                        : t.pieces[a].file < t.pieces[b].file;
    });
    IndexTensor sorted{t.name, t.dtype, t.shape, {}};
    std::vector<Impl::PieceRef> sorted_refs;
    for (size_t i : order) {
      sorted.pieces.push_back(std::move(t.pieces[i]));
      sorted_refs.push_back(r[i]);
    }
    index.tensors.push_back(std::move(sorted));
    pieces.push_back(std::move(sorted_refs));
  }
  validate_index(index, dir, /*require_checksums=*/false);
}

}  // namespace fsdp_ema::format
