#include "fsdp_ema/format/checkpoint_dir.h"

#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <unordered_map>

#include "fsdp_ema/format/checksum.h"
#include "fsdp_ema/format/error.h"
#include "fsdp_ema/format/file_util.h"
#include "fsdp_ema/format/json_strict.h"
#include "fsdp_ema/format/names.h"
#include "fsdp_ema/format/parallel.h"
#include "fsdp_ema/format/paths.h"
#include "fsdp_ema/format/piece_reads.h"

namespace fsdp_ema::format {
namespace {

using detail::json_quote;

std::vector<std::string> safetensors_files(const std::vector<std::string>& names) {
  std::vector<std::string> out;
  for (const std::string& n : names) {
    if (is_safetensors_file_name(n)) out.push_back(n);
  }
  return out;
}

Shape strides_of(std::span<const int64_t> shape) {
  Shape s(shape.size(), 1);
  for (size_t d = shape.size(); d-- > 1;) s[d - 1] = s[d] * shape[d];
  return s;
}

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

std::string_view layout_name(CheckpointLayout layout) {
  return layout == CheckpointLayout::kFsdpEma ? "fsdp_ema" : "dcp-huggingface";
}

struct CheckpointDir::Impl {
  std::string path;
  CheckpointLayout layout = CheckpointLayout::kFsdpEma;
  CheckpointIndex index;
  std::vector<std::string> file_names;  // sorted
  std::vector<ShardFile> files;         // parallel to file_names
  // Per tensor (index order) and piece: the file and its header entry.
  struct PieceRef {
    size_t file;
    const TensorInfo* info;
  };
  std::vector<std::vector<PieceRef>> pieces;
  std::vector<size_t> flag_base;  // first once_flag of each tensor
  std::unique_ptr<std::once_flag[]> verified;
  // Set once piece's verdict is in (a flag may be set by a read that hashed it on the way).
  std::unique_ptr<std::atomic<bool>[]> verified_done;
  std::map<std::string, size_t> file_slot;  // file name -> index in files (while opening)

  // open(), one layout each: fill index, files and pieces, or throw.
  void open_fsdp_ema(const std::vector<std::string>& names);
  void open_dcp_huggingface(const std::vector<std::string>& names);

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
      throw FormatError(path + ": no tensor " + json_quote(name) + " in this checkpoint");
    }
    return static_cast<size_t>(t - index.tensors.data());
  }

  void init_flags() {
    flag_base.resize(index.tensors.size());
    size_t n = 0;
    for (size_t i = 0; i < index.tensors.size(); ++i) {
      flag_base[i] = n;
      n += index.tensors[i].pieces.size();
    }
    verified = std::make_unique<std::once_flag[]>(n);
    verified_done = std::make_unique<std::atomic<bool>[]>(n);
  }

  bool is_verified(size_t ti, size_t pi) const {
    return verified_done[flag_base[ti] + pi].load(std::memory_order_acquire);
  }
  // Records that piece (ti, pi) passed: its once_flag is spent, so no later call hashes it again.
  void mark_verified(size_t ti, size_t pi) const {
    std::call_once(verified[flag_base[ti] + pi], [] {});
    verified_done[flag_base[ti] + pi].store(true, std::memory_order_release);
  }

  std::string piece_ctx(size_t ti, size_t pi) const {
    const IndexTensor& t = index.tensors[ti];
    const IndexPiece& p = t.pieces[pi];
    return detail::join_path(path, p.file) + ": tensor " + json_quote(t.name) +
           " (piece at offsets " + shape_to_string(p.offsets) + ")";
  }

  void check_checksum(size_t ti, size_t pi, uint64_t actual) const {
    const IndexPiece& p = index.tensors[ti].pieces[pi];
    if (actual != *p.checksum) {
      throw FormatError(piece_ctx(ti, pi) + ": checksum mismatch: expected " +
                        format_checksum(*p.checksum) + ", data hashes to " +
                        format_checksum(actual) + " (corrupted data)");
    }
  }

  // Verifies a piece once; false if it has no checksum.
  // The verdict on piece (ti, pi), once: its checksum, and the checks every read of its bytes
  // applies (ShardFile::read: BOOL bytes are 0 or 1), so that verify refuses exactly what a load
  // refuses, on every layout (DCP and plain Hugging Face files have no checksums, but a BOOL byte
  // of 2 is as wrong there). True when a checksum was verified.
  bool ensure_verified(size_t ti, size_t pi, bool mapped = false) const {
    const IndexPiece& p = index.tensors[ti].pieces[pi];
    const PieceRef& r = pieces[ti][pi];
    if (!p.checksum && !ShardFile::has_data_checks(*r.info)) return false;
    if (is_verified(ti, pi)) return p.checksum.has_value();
    std::call_once(verified[flag_base[ti] + pi], [&] {
      const uint64_t sum = files[r.file].compute_checksum(*r.info, mapped);  // + data checks
      if (p.checksum) check_checksum(ti, pi, sum);
    });
    mark_verified(ti, pi);
    return p.checksum.has_value();
  }

  // Copies the intersection `box` of piece (ti, pi) into dst, a row-major buffer holding the
  // box [dst_off, dst_off + dst_shape).
  void copy_box(size_t ti, size_t pi, const Box& box, std::span<const int64_t> dst_off,
                std::span<const int64_t> dst_shape, std::byte* dst, bool verify) const {
    const IndexTensor& t = index.tensors[ti];
    const IndexPiece& p = t.pieces[pi];
    const PieceRef& r = pieces[ti][pi];
    const ShardFile& f = files[r.file];
    const uint64_t esz = dtype_size(t.dtype);
    const size_t ndim = box.shape.size();

    // The largest k such that dims > k are whole in both the piece and the destination: each
    // run then spans dims k..ndim-1 and is contiguous on both sides.
    size_t k = ndim == 0 ? 0 : ndim - 1;
    while (k > 0 && box.shape[k] == p.shape[k] && box.shape[k] == dst_shape[k]) --k;
    uint64_t run = esz;
    for (size_t d = k; d < ndim; ++d) run *= static_cast<uint64_t>(box.shape[d]);

    const bool whole_piece = box.shape == p.shape && run == r.info->nbytes;
    if (verify && p.checksum && whole_piece) {
      // The piece lands in dst as one contiguous run: read it there and hash it on the way
      // (once); other threads or later calls copy it plainly.
      uint64_t dst_byte = 0;
      if (ndim > 0) {
        const Shape dstride = strides_of(dst_shape);
        for (size_t d = 0; d < ndim; ++d) {
          dst_byte += static_cast<uint64_t>(box.offsets[d] - dst_off[d]) *
                      static_cast<uint64_t>(dstride[d]) * esz;
        }
      }
      bool copied = false;
      std::call_once(verified[flag_base[ti] + pi], [&] {
        Checksummer h;
        f.read(*r.info, 0, run, dst + dst_byte, &h);
        copied = true;
        check_checksum(ti, pi, h.digest());
      });
      mark_verified(ti, pi);
      if (copied) return;
    } else if (verify) {
      ensure_verified(ti, pi);
    }

    if (ndim == 0) {
      f.read(*r.info, 0, esz, dst);
      return;
    }
    const Shape sstride = strides_of(p.shape);
    const Shape dstride = strides_of(dst_shape);
    std::vector<int64_t> idx(k, 0);
    for (;;) {
      uint64_t s = 0, q = 0;
      for (size_t d = 0; d <= k; ++d) {
        const int64_t i = d < k ? idx[d] : 0;
        s += static_cast<uint64_t>(box.offsets[d] - p.offsets[d] + i) *
             static_cast<uint64_t>(sstride[d]);
        q += static_cast<uint64_t>(box.offsets[d] - dst_off[d] + i) *
             static_cast<uint64_t>(dstride[d]);
      }
      f.read(*r.info, s * esz, run, dst + q * esz);
      // Odometer over dims [0, k).
      size_t d = k;
      while (d > 0) {
        --d;
        if (++idx[d] < box.shape[d]) break;
        idx[d] = 0;
        if (d == 0) return;
      }
      if (k == 0) return;
    }
  }

  // A piece read whole into dst (the common case: a tensor saved by one rank, or the rows one
  // rank wrote), hashed on the way the first time it is read.
  void read_whole_piece(size_t ti, size_t pi, std::byte* dst, bool verify) const {
    const PieceRef& r = pieces[ti][pi];
    const ShardFile& f = files[r.file];
    bool copied = false;
    if (verify && index.tensors[ti].pieces[pi].checksum) {
      std::call_once(verified[flag_base[ti] + pi], [&] {
        Checksummer h;
        f.read(*r.info, 0, r.info->nbytes, dst, &h);
        copied = true;
        check_checksum(ti, pi, h.digest());
      });
      mark_verified(ti, pi);
    }
    if (!copied) f.read(*r.info, 0, r.info->nbytes, dst);
  }

  void read_slice_at(size_t ti, std::span<const int64_t> offsets, std::span<const int64_t> shape,
                     void* dst, size_t dst_bytes, bool verify) const;
  void read_rows_batch(std::span<const CheckpointDir::RowsRead> requests, bool verify,
                       size_t threads) const;
};

CheckpointDir::CheckpointDir(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CheckpointDir::CheckpointDir(CheckpointDir&&) noexcept = default;
CheckpointDir& CheckpointDir::operator=(CheckpointDir&&) noexcept = default;
CheckpointDir::~CheckpointDir() = default;

CheckpointDir CheckpointDir::open(const std::string& dir) {
  check_path(dir, "checkpoint directory");
  if (!detail::is_directory(dir)) {
    throw FormatError(dir + ": not a directory (a checkpoint is a directory)");
  }
  auto impl = std::make_unique<Impl>();
  impl->path = dir;
  const std::vector<std::string> names = detail::list_dir(dir);
  if (std::binary_search(names.begin(), names.end(), kIndexFileName)) {
    impl->open_fsdp_ema(names);
  } else {
    impl->open_dcp_huggingface(names);
  }
  impl->init_flags();
  return CheckpointDir(std::move(impl));
}

// Ours: the index, and the header of every shard file it names checked against it.
void CheckpointDir::Impl::open_fsdp_ema(const std::vector<std::string>& names) {
  const std::string& dir = path;
  layout = CheckpointLayout::kFsdpEma;
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
      auto mismatch = [&](const std::string& what, const std::string& in_index,
                          const std::string& in_file) {
        return FormatError(ctx() + ": " + what + " " + in_index + " in the index but " + in_file +
                           " in the file header");
      };
      if (info->dtype != t.dtype) {
        throw mismatch("dtype", std::string(dtype_name(t.dtype)),
                       std::string(dtype_name(info->dtype)));
      }
      if (info->shape != p.shape) {
        throw mismatch("shape", shape_to_string(p.shape), shape_to_string(info->shape));
      }
      if (info->offsets != p.offsets) {
        throw mismatch("offsets", shape_to_string(p.offsets), shape_to_string(info->offsets));
      }
      if (f.is_fsdp_ema() && info->global_shape != t.shape) {
        throw mismatch("global shape", shape_to_string(t.shape),
                       shape_to_string(info->global_shape));
      }
      if (info->checksum && p.checksum && *info->checksum != *p.checksum) {
        throw mismatch("checksum", format_checksum(*p.checksum), format_checksum(*info->checksum));
      }
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

// No index: DCP's HuggingFace writer's files (or a plain Hugging Face directory), the index
// synthesized from every file's pieces as DCP's reader places them.
void CheckpointDir::Impl::open_dcp_huggingface(const std::vector<std::string>& names) {
  const std::string& dir = path;
  const std::vector<std::string> st = safetensors_files(names);
  for (const std::string& n : st) {
    if (is_shard_file_name(n)) {
      throw FormatError(dir + ": incomplete checkpoint: fsdp_ema.index.json missing (found " + n +
                        "; the index is written last, after every rank's file)");
    }
  }
  if (st.empty()) {
    if (std::binary_search(names.begin(), names.end(), std::string(".metadata"))) {
      throw FormatError(dir +
                        ": a native torch.distributed.checkpoint directory (pickled "
                        ".metadata + .distcp files) is not readable here: pickle is never "
                        "loaded; save with HuggingFaceStorageWriter instead");
    }
    throw FormatError(dir +
                      ": not a checkpoint: no fsdp_ema.index.json and no .safetensors "
                      "files");
  }
  check_dcp_file_set(dir, st);
  layout = CheckpointLayout::kDcpHuggingFace;
  std::map<std::string, IndexTensor> by_name;
  std::map<std::string, std::vector<Impl::PieceRef>> refs;
  for (const std::string& n : st) {
    const size_t fi = open_file(n);
    const ShardFile& f = files[fi];
    if (f.is_fsdp_ema()) {
      throw FormatError(dir + ": incomplete checkpoint: fsdp_ema.index.json missing (" + n +
                        " is an fsdp_ema shard file)");
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

const std::string& CheckpointDir::path() const { return impl_->path; }
CheckpointLayout CheckpointDir::layout() const { return impl_->layout; }
int64_t CheckpointDir::world_size() const { return impl_->index.world_size; }
const CheckpointIndex& CheckpointDir::index() const { return impl_->index; }
const std::vector<IndexTensor>& CheckpointDir::tensors() const { return impl_->index.tensors; }
const IndexTensor* CheckpointDir::find(std::string_view name) const {
  return impl_->index.find(name);
}
const IndexTensor& CheckpointDir::tensor(std::string_view name) const {
  return impl_->index.tensors[impl_->tensor_index(name)];
}
uint64_t CheckpointDir::tensor_nbytes(std::string_view name) const {
  const IndexTensor& t = tensor(name);
  return *nbytes(t.shape, t.dtype);  // validated at open
}
const std::vector<std::string>& CheckpointDir::files() const { return impl_->file_names; }

const ShardFile& CheckpointDir::shard_file(std::string_view file) const {
  auto it = std::lower_bound(impl_->file_names.begin(), impl_->file_names.end(), file);
  if (it == impl_->file_names.end() || *it != file) {
    throw FormatError(impl_->path + ": no shard file " + json_quote(file) + " in this checkpoint");
  }
  return impl_->files[static_cast<size_t>(it - impl_->file_names.begin())];
}

std::vector<std::string> CheckpointDir::stray_files() const {
  std::vector<std::string> out;
  for (const std::string& n : safetensors_files(detail::list_dir(impl_->path))) {
    if (!std::binary_search(impl_->file_names.begin(), impl_->file_names.end(), n)) {
      out.push_back(n);
    }
  }
  return out;
}

void CheckpointDir::read_slice(std::string_view name, std::span<const int64_t> offsets,
                               std::span<const int64_t> shape, void* dst, size_t dst_bytes,
                               bool verify) const {
  impl_->read_slice_at(impl_->tensor_index(name), offsets, shape, dst, dst_bytes, verify);
}

void CheckpointDir::Impl::read_slice_at(size_t ti, std::span<const int64_t> offsets,
                                        std::span<const int64_t> shape, void* dst, size_t dst_bytes,
                                        bool verify) const {
  const IndexTensor& t = index.tensors[ti];
  auto ctx = [&] { return path + ": tensor " + json_quote(t.name); };  // on error only
  const size_t ndim = t.shape.size();
  if (offsets.size() != ndim || shape.size() != ndim) {
    throw FormatError(ctx() + ": slice offsets " + shape_to_string(offsets) + " and shape " +
                      shape_to_string(shape) + " need " + std::to_string(ndim) +
                      " entries each (global shape " + shape_to_string(t.shape) + ")");
  }
  for (size_t d = 0; d < ndim; ++d) {
    if (offsets[d] < 0 || shape[d] < 0 || offsets[d] > t.shape[d] ||
        shape[d] > t.shape[d] - offsets[d]) {
      throw FormatError(ctx() + ": slice at offsets " + shape_to_string(offsets) + " with shape " +
                        shape_to_string(shape) + " is outside global shape " +
                        shape_to_string(t.shape));
    }
  }
  const uint64_t need = *nbytes(shape, t.dtype);
  if (dst_bytes != need) {
    throw FormatError(ctx() + ": destination has " + std::to_string(dst_bytes) +
                      " bytes but the slice of shape " + shape_to_string(shape) + " of " +
                      std::string(dtype_name(t.dtype)) + " needs " + std::to_string(need));
  }
  if (need == 0) return;
  if (dst == nullptr) throw FormatError(ctx() + ": destination is null");
  if (t.pieces.size() == 1 && std::ranges::equal(t.pieces[0].offsets, offsets) &&
      std::ranges::equal(t.pieces[0].shape, shape)) {
    read_whole_piece(ti, 0, static_cast<std::byte*>(dst), verify);
    return;
  }
  const Box want{Shape(offsets.begin(), offsets.end()), Shape(shape.begin(), shape.end())};
  for (size_t pi = 0; pi < t.pieces.size(); ++pi) {
    const IndexPiece& p = t.pieces[pi];
    auto box = intersect(want, Box{p.offsets, p.shape});
    if (!box) continue;
    copy_box(ti, pi, *box, want.offsets, want.shape, static_cast<std::byte*>(dst), verify);
  }
}

void CheckpointDir::read_rows_batch(std::span<const RowsRead> reads, bool verify,
                                    size_t threads) const {
  impl_->read_rows_batch(reads, verify, threads);
}

void CheckpointDir::Impl::read_rows_batch(std::span<const CheckpointDir::RowsRead> requests,
                                          bool verify, size_t threads) const {
  constexpr size_t kNone = ~size_t{0};
  std::vector<PieceRead> reads;
  std::vector<std::pair<size_t, size_t>> hashed;  // per read: its piece (ti, pi) when hashed
  std::vector<std::pair<size_t, size_t>> first;   // pieces read in part: verified before reading
  std::vector<std::pair<size_t, size_t>> sliced;  // (request, ti): pieces split beyond dim 0
  reads.reserve(requests.size());
  hashed.reserve(requests.size());
  for (size_t q = 0; q < requests.size(); ++q) {
    const CheckpointDir::RowsRead& req = requests[q];
    const size_t ti = tensor_index(req.name);
    const IndexTensor& t = index.tensors[ti];
    auto ctx = [&] { return path + ": tensor " + json_quote(t.name); };  // on error only
    Shape shape = t.shape;
    int64_t begin = 0;
    if (!t.shape.empty()) {
      if (req.rows.begin < 0 || req.rows.begin > req.rows.end || req.rows.end > t.shape[0]) {
        throw FormatError(ctx() + ": rows [" + std::to_string(req.rows.begin) + ", " +
                          std::to_string(req.rows.end) + ") are not inside its " +
                          std::to_string(t.shape[0]) + " rows");
      }
      begin = req.rows.begin;
      shape[0] = req.rows.size();
    }
    const uint64_t need = *nbytes(shape, t.dtype);
    if (req.dst_bytes != need) {
      throw FormatError(ctx() + ": destination has " + std::to_string(req.dst_bytes) +
                        " bytes but the slice of shape " + shape_to_string(shape) + " of " +
                        std::string(dtype_name(t.dtype)) + " needs " + std::to_string(need));
    }
    if (need == 0) continue;
    if (req.dst == nullptr) throw FormatError(ctx() + ": destination is null");
    // Pieces whole in every dimension but the first hold rows: one contiguous run each side.
    const bool rows_only = std::ranges::all_of(t.pieces, [&](const IndexPiece& p) {
      return std::ranges::equal(std::span(p.shape).subspan(p.shape.empty() ? 0 : 1),
                                std::span(t.shape).subspan(t.shape.empty() ? 0 : 1));
    });
    if (!rows_only) {
      sliced.emplace_back(q, ti);
      continue;
    }
    const uint64_t row_bytes = t.shape.empty() ? need : need / static_cast<uint64_t>(shape[0]);
    for (size_t pi = 0; pi < t.pieces.size(); ++pi) {
      const IndexPiece& p = t.pieces[pi];
      const PieceRef& ref = pieces[ti][pi];
      int64_t lo = 0, hi = 1, p0 = 0;
      if (!t.shape.empty()) {
        p0 = p.offsets[0];
        lo = std::max(begin, p0);
        hi = std::min(req.rows.end, p0 + p.shape[0]);
        if (lo >= hi) continue;
      }
      PieceRead r;
      r.file = &files[ref.file];
      r.tensor = ref.info;
      r.offset = static_cast<uint64_t>(lo - p0) * row_bytes;
      r.length = static_cast<uint64_t>(hi - lo) * row_bytes;
      r.dst = static_cast<std::byte*>(req.dst) + static_cast<uint64_t>(lo - begin) * row_bytes;
      const bool whole = r.offset == 0 && r.length == ref.info->nbytes;
      if (verify && !is_verified(ti, pi)) {
        if (whole && p.checksum) {
          r.hash = true;
        } else if (!whole && (p.checksum || ShardFile::has_data_checks(*ref.info))) {
          first.emplace_back(ti, pi);
        }
      }
      hashed.emplace_back(r.hash ? ti : kNone, pi);
      reads.push_back(r);
    }
  }
  std::sort(first.begin(), first.end());
  first.erase(std::unique(first.begin(), first.end()), first.end());
  detail::rethrow_first(detail::run_jobs(
      first.size(), [&](size_t i) { ensure_verified(first[i].first, first[i].second); }, threads));
  read_pieces(reads, threads, [&](size_t i, uint64_t digest) {
    const auto [ti, pi] = hashed[i];
    check_checksum(ti, pi, digest);
    mark_verified(ti, pi);
  });
  detail::rethrow_first(detail::run_jobs(
      sliced.size(),
      [&](size_t i) {
        const auto [q, ti] = sliced[i];
        const CheckpointDir::RowsRead& req = requests[q];
        const IndexTensor& t = index.tensors[ti];
        Shape offsets(t.shape.size(), 0), shape = t.shape;
        if (!t.shape.empty()) {
          offsets[0] = req.rows.begin;
          shape[0] = req.rows.size();
        }
        read_slice_at(ti, offsets, shape, req.dst, req.dst_bytes, verify);
      },
      threads));
}

void CheckpointDir::read_full(std::string_view name, void* dst, size_t dst_bytes,
                              bool verify) const {
  const IndexTensor& t = tensor(name);
  const RowsRead read{name, RowRange{0, t.shape.empty() ? 0 : t.shape[0]}, dst, dst_bytes};
  impl_->read_rows_batch(std::span(&read, 1), verify, 1);
}

void CheckpointDir::read_rows(std::string_view name, int64_t row_begin, int64_t row_end, void* dst,
                              size_t dst_bytes, bool verify) const {
  const IndexTensor& t = tensor(name);
  auto ctx = [&] { return impl_->path + ": tensor " + json_quote(t.name); };  // on error only
  if (t.shape.empty()) throw FormatError(ctx() + ": is 0-dim, it has no rows");
  const RowsRead read{name, RowRange{row_begin, row_end}, dst, dst_bytes};
  impl_->read_rows_batch(std::span(&read, 1), verify, 1);
}

void CheckpointDir::read_chunk(std::string_view name, int64_t rank, int64_t world, void* dst,
                               size_t dst_bytes, bool verify) const {
  const IndexTensor& t = tensor(name);
  if (t.shape.empty()) {  // every rank holds a 0-dim tensor whole (rows.h)
    tensor_rows(t.shape, rank, world);
    read_full(name, dst, dst_bytes, verify);
    return;
  }
  const RowRange r = tensor_rows(t.shape, rank, world);
  read_rows(name, r.begin, r.end, dst, dst_bytes, verify);
}

void CheckpointDir::read_flat(std::string_view name, uint64_t elem_begin, uint64_t elem_end,
                              void* dst, size_t dst_bytes, bool verify) const {
  const IndexTensor& t = tensor(name);
  const std::string ctx = impl_->path + ": tensor " + json_quote(t.name);
  const uint64_t total = *numel(t.shape);
  const uint64_t esz = dtype_size(t.dtype);
  if (elem_begin > elem_end || elem_end > total) {
    throw FormatError(ctx + ": elements [" + std::to_string(elem_begin) + ", " +
                      std::to_string(elem_end) + ") are not inside its " + std::to_string(total));
  }
  if (dst_bytes != (elem_end - elem_begin) * esz) {
    throw FormatError(ctx + ": destination has " + std::to_string(dst_bytes) + " bytes but " +
                      std::to_string(elem_end - elem_begin) + " elements need " +
                      std::to_string((elem_end - elem_begin) * esz));
  }
  if (elem_begin == elem_end) return;
  auto* out = static_cast<std::byte*>(dst);
  if (t.shape.empty()) {
    read_full(name, out, esz, verify);
    return;
  }
  // Split the flat range into boxes, each contiguous in the output: a partial leading row, whole
  // rows, a partial trailing row, recursively per dimension.
  const size_t ndim = t.shape.size();
  Shape offsets(ndim, 0), shape(ndim, 1);
  auto emit = [&](size_t dim, int64_t lo, int64_t hi) {
    // Box: the fixed prefix in `offsets[0..dim)`, [lo, hi) in `dim`, whole dims after it.
    Shape o(offsets.begin(), offsets.end()), s(ndim, 1);
    o[dim] = lo;
    s[dim] = hi - lo;
    for (size_t d = dim + 1; d < ndim; ++d) {
      o[d] = 0;
      s[d] = t.shape[d];
    }
    const uint64_t bytes = *nbytes(s, t.dtype);
    read_slice(name, o, s, out, bytes, verify);
    out += bytes;
  };
  // inner[d] = elements per index of dim d.
  Shape inner = strides_of(t.shape);
  std::function<void(size_t, uint64_t, uint64_t)> split = [&](size_t dim, uint64_t b, uint64_t e) {
    if (b >= e) return;
    const auto in = static_cast<uint64_t>(inner[dim]);
    uint64_t r0 = b / in;
    const uint64_t r1 = e / in;
    if (r0 == r1) {
      // Inside one index of `dim`: recurse into the next dimension.
      offsets[dim] = static_cast<int64_t>(r0);
      split(dim + 1, b - r0 * in, e - r0 * in);
      return;
    }
    if (b % in != 0) {
      offsets[dim] = static_cast<int64_t>(r0);
      split(dim + 1, b - r0 * in, in);
      ++r0;
    }
    if (r1 > r0) emit(dim, static_cast<int64_t>(r0), static_cast<int64_t>(r1));
    if (e % in != 0) {
      offsets[dim] = static_cast<int64_t>(r1);
      split(dim + 1, 0, e - r1 * in);
    }
  };
  split(0, elem_begin, elem_end);
}

bool CheckpointDir::verify_piece(std::string_view name, size_t piece, bool mapped) const {
  const size_t ti = impl_->tensor_index(name);
  if (piece >= impl_->index.tensors[ti].pieces.size()) {
    throw FormatError(impl_->path + ": tensor " + json_quote(name) + " has no piece " +
                      std::to_string(piece));
  }
  return impl_->ensure_verified(ti, piece, mapped);
}

void CheckpointDir::check_unchanged() const {
  for (const ShardFile& f : impl_->files) f.check_unchanged();
}

size_t CheckpointDir::verify_all() const {
  size_t n = 0;
  for (size_t ti = 0; ti < impl_->index.tensors.size(); ++ti) {
    for (size_t pi = 0; pi < impl_->index.tensors[ti].pieces.size(); ++pi) {
      n += impl_->ensure_verified(ti, pi) ? 1 : 0;
    }
  }
  return n;
}

}  // namespace fsdp_ema::format
