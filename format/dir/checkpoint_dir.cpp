// CheckpointDir (fsdp_ema/format/checkpoint_dir.h): open, which hands each layout to its own source
// (checkpoint_dir_ours.cpp, checkpoint_dir_dcp.cpp), the accessors and the reads.
#include "fsdp_ema/format/checkpoint_dir.h"

#include <algorithm>
#include <deque>
#include <functional>

#include "checkpoint_dir_impl.h"
#include "fsdp_ema/format/error.h"
#include "fsdp_ema/format/file_util.h"
#include "fsdp_ema/format/json_strict.h"
#include "fsdp_ema/format/names.h"
#include "fsdp_ema/format/parallel.h"
#include "fsdp_ema/format/paths.h"
#include "fsdp_ema/format/read_exec.h"

namespace fsdp_ema::format {

using detail::json_quote;

std::string_view layout_name(CheckpointLayout layout) {
  return layout == CheckpointLayout::kFsdpEma ? "fsdp_ema" : "dcp-huggingface";
}

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
