#include "ops/reads.h"

#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/from_blob.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/accumulate.h>
#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>

#include "fsdp_ema/format/parallel.h"
#include "ops/format_bridge.h"

namespace fsdp_ema::ops {

size_t read_threads() { return static_cast<size_t>(std::max(1, at::get_num_threads())); }

std::vector<int64_t> rows_shape(const format::IndexTensor& tensor, format::RowRange rows) {
  std::vector<int64_t> shape(tensor.shape.begin(), tensor.shape.end());
  if (!shape.empty()) shape[0] = rows.size();
  return shape;
}

void verify_pieces(const format::CheckpointDir& dir, const RowsPlan& plan, bool mapped) {
  std::vector<std::pair<const format::IndexTensor*, size_t>> pieces;
  for (const auto& [tensor, rows] : plan) {
    for (size_t k = 0; k < tensor->pieces.size(); ++k) {
      const format::IndexPiece& piece = tensor->pieces[k];
      const bool hit = tensor->shape.empty() || (piece.offsets[0] < rows.end &&
                                                 piece.offsets[0] + piece.shape[0] > rows.begin);
      if (hit) pieces.emplace_back(tensor, k);
    }
  }
  // Pieces handed out one at a time (not in fixed shares): a thread slowed by other work on the
  // machine does not hold the others up.
  format::detail::rethrow_first(format::detail::run_jobs(
      pieces.size(),
      [&](size_t i) { dir.verify_piece(pieces[i].first->name, pieces[i].second, mapped); },
      read_threads()));
}

namespace {

// A zero-copy view of the stored piece that holds exactly `rows` of `tensor`, if there is one
// (aligned for the dtype); undefined otherwise.
at::Tensor mapped_view(const std::shared_ptr<const format::CheckpointDir>& dir,
                       const format::IndexTensor& tensor, format::RowRange rows, bool verify) {
  const std::vector<int64_t> shape = rows_shape(tensor, rows);
  if (c10::multiply_integers(shape) == 0) return {};
  for (size_t k = 0; k < tensor.pieces.size(); ++k) {
    const format::IndexPiece& piece = tensor.pieces[k];
    const bool exact = piece.shape == format::Shape(shape.begin(), shape.end()) &&
                       (piece.offsets.empty() || piece.offsets[0] == rows.begin);
    if (!exact) continue;
    const format::ShardFile& file = dir->shard_file(piece.file);
    const auto bytes = file.data(file.tensor(tensor.name));
    if (reinterpret_cast<uintptr_t>(bytes.data()) % format::dtype_size(tensor.dtype) != 0) break;
    if (verify) dir->verify_piece(tensor.name, k, /*mapped=*/true);
    const auto options = at::TensorOptions().dtype(to_scalar_type(tensor.dtype));
    return at::from_blob(
        const_cast<std::byte*>(bytes.data()), shape, [dir](void*) {}, options);
  }
  return {};
}

}  // namespace

namespace {

constexpr size_t kHugePage = size_t{2} << 20;

void free_huge(void* p) { std::free(p); }

// Read destinations of 2 MiB or more start on a 2 MiB boundary and ask for transparent huge
// pages, as torch's own CPU allocator does under THP_MEM_ALLOC_ENABLE=1; smaller ones come from
// torch's CPU allocator. Without the alignment only the aligned middle of a tensor gets huge
// pages and its edges still fault 4 KiB at a time (48,000 faults per GiB in 300 tensors).
class ReadAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    if (n < kHugePage) return c10::GetCPUAllocator()->allocate(n);
    // The last huge page whole too, where that costs at most an eighth more memory: otherwise
    // the tail of an odd-sized tensor still faults 4 KiB at a time.
    const size_t whole = (n + kHugePage - 1) / kHugePage * kHugePage;
    const size_t size = (whole - n) * 8 <= n ? whole : n;
    void* p = nullptr;
    TORCH_CHECK_WITH(OutOfMemoryError, ::posix_memalign(&p, kHugePage, size) == 0,
                     "fsdp_ema: cannot allocate ", n, " bytes for a load");
    // A hint only: where the kernel has no THP (or says no), the pages stay 4 KiB.
    ::madvise(p, size / kHugePage * kHugePage, MADV_HUGEPAGE);
    return {p, p, &free_huge, at::Device(at::kCPU)};
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

}  // namespace

at::Tensor empty_for_read(c10::IntArrayRef shape, at::ScalarType dtype) {
  static ReadAllocator allocator;  // lives as long as the tensors whose storages name it
  return at::detail::empty_generic(shape, &allocator, c10::DispatchKeySet(c10::DispatchKey::CPU),
                                   dtype, std::nullopt);
}

std::vector<at::Tensor> read_rows(const std::shared_ptr<const format::CheckpointDir>& dir,
                                  const RowsPlan& plan, bool verify, bool mmap) {
  std::vector<at::Tensor> out(plan.size());
  std::vector<char> mapped(plan.size(), 0);
  // Allocations on torch's threads: a load of 200,000 small tensors is 200,000 of them.
  at::parallel_for(0, static_cast<int64_t>(plan.size()), 4096, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const auto& [tensor, rows] = plan[i];
      if (mmap) out[i] = mapped_view(dir, *tensor, rows, verify);
      mapped[i] = out[i].defined();
      if (mapped[i]) continue;
      out[i] = empty_for_read(rows_shape(*tensor, rows), to_scalar_type(tensor->dtype));
    }
  });
  RowsPlan owned;
  std::vector<at::Tensor> dst;
  for (size_t i = 0; i < plan.size(); ++i) {
    if (mapped[i]) continue;
    owned.push_back(plan[i]);
    dst.push_back(out[i]);
  }
  read_rows_into(*dir, owned, dst, verify);
  return out;
}

void read_rows_into(const format::CheckpointDir& dir, const RowsPlan& plan,
                    const std::vector<at::Tensor>& dst, bool verify) {
  std::vector<format::CheckpointDir::RowsRead> reads;
  reads.reserve(plan.size());
  for (size_t i = 0; i < plan.size(); ++i) {
    reads.push_back({plan[i].first->name, plan[i].second, dst[i].data_ptr(), dst[i].nbytes()});
  }
  dir.read_rows_batch(reads, verify, read_threads());
}

}  // namespace fsdp_ema::ops
