// CheckpointDir::open for our layout: the index, and the header of every shard file it names
// checked against it.
#include <sys/stat.h>

#include <algorithm>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "checkpoint_dir_impl.h"
#include "fsdp_ema/format/checksum.h"
#include "fsdp_ema/format/index.h"
#include "fsdp_ema/format/parallel.h"

namespace fsdp_ema::format {
namespace {

using detail::json_quote;

// The header entry `info` of file `f` against piece `p` of `t` in the index: dtype, shape,
// offsets, global shape (our files) and checksum agree.
void check_piece_header(const ShardFile& f, const IndexTensor& t, const IndexPiece& p,
                        const TensorInfo& info) {
  auto ctx = [&] { return f.path() + ": tensor " + json_quote(t.name); };  // on error only
  auto mismatch = [&](const std::string& what, const std::string& in_index,
                      const std::string& in_file) {
    return FormatError(ctx() + ": " + what + " " + in_index + " in the index but " + in_file +
                       " in the file header");
  };
  if (info.dtype != t.dtype) {
    throw mismatch("dtype", std::string(dtype_name(t.dtype)), std::string(dtype_name(info.dtype)));
  }
  if (info.shape != p.shape) {
    throw mismatch("shape", shape_to_string(p.shape), shape_to_string(info.shape));
  }
  if (info.offsets != p.offsets) {
    throw mismatch("offsets", shape_to_string(p.offsets), shape_to_string(info.offsets));
  }
  if (f.is_fsdp_ema() && info.global_shape != t.shape) {
    throw mismatch("global shape", shape_to_string(t.shape), shape_to_string(info.global_shape));
  }
  if (info.checksum && p.checksum && *info.checksum != *p.checksum) {
    throw mismatch("checksum", format_checksum(*p.checksum), format_checksum(*info.checksum));
  }
}

}  // namespace

void CheckpointDir::Impl::open_fsdp_ema(const std::vector<std::string>& names) {
  layout = CheckpointLayout::kFsdpEma;
  open_index_and_files(names);
  check_file_headers();
  match_pieces();
}

void CheckpointDir::Impl::open_index_and_files(const std::vector<std::string>& names) {
  const std::string& dir = path;
  // The index and the shard files it names are independent parses: the listing's
  // .safetensors files are opened while the index is read (on the machine's cores when the
  // index is large), then those the index names are kept. A file it names that the listing
  // did not show is opened after; an error of one it does not name is dropped.
  std::vector<std::string> listed;
  for (const std::string& n : names) {
    if (n.ends_with(kSafetensorsSuffix)) listed.push_back(n);
  }
  std::vector<std::optional<ShardFile>> early(listed.size());
  struct stat st {};
  const std::string index_path = dir + "/" + std::string(kIndexFileName);
  const bool large = ::stat(index_path.c_str(), &st) == 0 &&
                     static_cast<uint64_t>(st.st_size) >= detail::kParallelParseBytes;
  const auto errors = detail::run_jobs(
      1 + listed.size(),
      [&](size_t i) {
        if (i == 0) {
          index = read_index(dir);
        } else {
          early[i - 1].emplace(ShardFile::open(resolve_piece_path(dir, listed[i - 1]),
                                               /*verify_checksums=*/false));
        }
      },
      large ? 0 : 1);
  if (errors[0]) std::rethrow_exception(errors[0]);
  std::set<std::string_view> named;  // the files the index names
  std::string_view last;
  for (const IndexTensor& t : index.tensors) {
    for (const IndexPiece& p : t.pieces) {
      if (p.file != last) named.insert(last = p.file);
    }
  }
  for (std::string_view f : named) {
    const auto it = std::lower_bound(listed.begin(), listed.end(), f);
    const size_t k = static_cast<size_t>(it - listed.begin());
    if (it == listed.end() || *it != f) {
      open_file(std::string(f));
      continue;
    }
    if (errors[1 + k]) std::rethrow_exception(errors[1 + k]);
    file_slot.emplace(std::string(f), files.size());
    file_names.emplace_back(f);
    files.push_back(std::move(*early[k]));
  }
}

void CheckpointDir::Impl::check_file_headers() const {
  for (size_t i = 0; i < files.size(); ++i) {
    const ShardHeader& h = files[i].header();
    if (!h.fsdp_ema) {
      throw FormatError(files[i].path() + ": listed in " + std::string(kIndexFileName) +
                        " but its header has no " + std::string(kMetaFormatVersion) +
                        ": not an fsdp_ema shard file");
    }
    if (h.world_size && *h.world_size != index.world_size) {
      throw FormatError(files[i].path() + ": written for world size " +
                        std::to_string(*h.world_size) + " but the index says " +
                        std::to_string(index.world_size));
    }
  }
}

void CheckpointDir::Impl::match_pieces() {
  // matched[file][i]: the file's i-th tensor is a piece the index lists.
  std::vector<std::vector<char>> matched(files.size());
  for (size_t fi = 0; fi < files.size(); ++fi) {
    matched[fi].assign(files[fi].tensors().size(), 0);
  }
  pieces.resize(index.tensors.size());
  for (size_t ti = 0; ti < index.tensors.size(); ++ti) {
    const IndexTensor& t = index.tensors[ti];
    for (const IndexPiece& p : t.pieces) {
      const size_t fi = file_slot.at(p.file);
      const ShardFile& f = files[fi];
      auto ctx = [&] { return f.path() + ": tensor " + json_quote(t.name); };  // on error only
      const TensorInfo* info = f.find(t.name);
      if (info == nullptr) {
        throw FormatError(ctx() + ": listed in the index but missing from the file");
      }
      char& seen = matched[fi][static_cast<size_t>(info - f.tensors().data())];
      if (seen) throw FormatError(ctx() + ": the index lists this file's piece twice");
      seen = 1;
      check_piece_header(f, t, p, *info);
      pieces[ti].push_back(Impl::PieceRef{fi, info});
    }
  }
  for (size_t fi = 0; fi < files.size(); ++fi) {
    const auto& tensors = files[fi].tensors();
    for (size_t i = 0; i < tensors.size(); ++i) {
      if (!matched[fi][i]) {
        throw FormatError(files[fi].path() + ": tensor " + json_quote(tensors[i].name) +
                          " is not listed in the index");
      }
    }
  }
}

}  // namespace fsdp_ema::format
