#include "fsdp_ema/format/checkpoint_dir.h"

#include <sys/stat.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
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
#include "fsdp_ema/format/read_exec.h"

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
    execute_reads(plan, dst, {threads, false});
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
  impl->finish_open();
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

StoredTensor CheckpointDir::stored(size_t index) const { return impl_->stored_tensor(index); }

size_t CheckpointDir::index_of(std::string_view name) const { return impl_->tensor_index(name); }

ReadPlan CheckpointDir::plan(std::span<const ReadRequest> requests,
                             std::span<const uint64_t> dst_bytes,
                             const PlanOptions& options) const {
  return plan_reads(requests, dst_bytes, impl_->path, options);
}

void CheckpointDir::read_full(std::string_view name, void* dst, size_t dst_bytes, bool verify,
                              size_t threads) const {
  const size_t ti = impl_->tensor_index(name);
  ReadRequest q;
  q.tensor = impl_->stored_tensor(ti);
  q.rows = {0, q.tensor.shape.empty() ? 0 : q.tensor.shape[0]};
  impl_->read_one(q, dst, dst_bytes, verify, threads);
}

void CheckpointDir::read_flat(std::string_view name, uint64_t elem_begin, uint64_t elem_end,
                              void* dst, size_t dst_bytes, bool verify,
                              const std::shared_ptr<ReadSession>& session) const {
  const size_t ti = impl_->tensor_index(name);
  const StoredTensor t = impl_->stored_tensor(ti);
  const std::string ctx = impl_->path + ": tensor " + json_quote(name);
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
  if (dst == nullptr) throw FormatError(ctx + ": destination is null");
  std::vector<ReadRequest> requests;
  std::deque<Shape> boxes;  // the requests' box spans point here
  if (t.shape.empty()) {
    ReadRequest q;
    q.tensor = t;
    requests.push_back(q);
  } else {
    // The flat range as boxes, each contiguous in the output: a partial leading row, whole rows,
    // a partial trailing row, recursively per dimension; all planned as one read.
    const size_t ndim = t.shape.size();
    Shape inner(ndim, 1);  // elements per index of dim d
    for (size_t d = ndim; d-- > 1;) inner[d - 1] = inner[d] * t.shape[d];
    Shape prefix(ndim, 0);
    uint64_t at = 0;  // output bytes so far
    auto emit = [&](size_t dim, int64_t lo, int64_t hi) {
      Shape& o = boxes.emplace_back(prefix);
      Shape& s = boxes.emplace_back(ndim, 1);
      o[dim] = lo;
      s[dim] = hi - lo;
      for (size_t d = dim + 1; d < ndim; ++d) {
        o[d] = 0;
        s[d] = t.shape[d];
      }
      ReadRequest q;
      q.tensor = t;
      q.box_offsets = o;
      q.box_shape = s;
      q.dst_offset = at;
      requests.push_back(q);
      at += *nbytes(s, t.dtype);
    };
    std::function<void(size_t, uint64_t, uint64_t)> split = [&](size_t dim, uint64_t b,
                                                                uint64_t e) {
      if (b >= e) return;
      const auto in = static_cast<uint64_t>(inner[dim]);
      uint64_t r0 = b / in;
      const uint64_t r1 = e / in;
      if (r0 == r1) {  // inside one index of `dim`: the next dimension
        prefix[dim] = static_cast<int64_t>(r0);
        split(dim + 1, b - r0 * in, e - r0 * in);
        return;
      }
      if (b % in != 0) {
        prefix[dim] = static_cast<int64_t>(r0);
        split(dim + 1, b - r0 * in, in);
        ++r0;
      }
      if (r1 > r0) emit(dim, static_cast<int64_t>(r0), static_cast<int64_t>(r1));
      if (e % in != 0) {
        prefix[dim] = static_cast<int64_t>(r1);
        split(dim + 1, 0, e - r1 * in);
      }
    };
    split(0, elem_begin, elem_end);
  }
  std::byte* d = static_cast<std::byte*>(dst);
  const uint64_t bytes = dst_bytes;
  impl_->read(requests, std::span(&d, 1), std::span(&bytes, 1), verify, 1, session);
}

bool CheckpointDir::verify_piece(std::string_view name, size_t piece) const {
  const size_t ti = impl_->tensor_index(name);
  const StoredTensor t = impl_->stored_tensor(ti);
  if (piece >= t.pieces.size()) {
    throw FormatError(impl_->path + ": tensor " + json_quote(name) + " has no piece " +
                      std::to_string(piece));
  }
  return t.pieces[piece].file->verify(*t.pieces[piece].info);
}

void CheckpointDir::check_unchanged() const {
  for (const ShardFile& f : impl_->files) f.check_unchanged();
}

size_t CheckpointDir::verify_all() const {
  std::vector<size_t> counts(impl_->files.size(), 0);
  detail::rethrow_first(detail::run_jobs(
      impl_->files.size(), [&](size_t i) { counts[i] = impl_->files[i].verify_all(); }, 0));
  size_t n = 0;
  for (size_t c : counts) n += c;
  return n;
}

}  // namespace fsdp_ema::format
