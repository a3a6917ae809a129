#include "ops/reads.h"

#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/from_blob.h>
#include <c10/util/accumulate.h>

#include "ops/format_bridge.h"

namespace fsdp_ema::ops {

void verify_pieces(
    const format::CheckpointDir& dir,
    const std::vector<std::pair<const format::IndexTensor*, format::RowRange>>& plan) {
  std::vector<std::pair<const format::IndexTensor*, size_t>> pieces;
  for (const auto& [tensor, rows] : plan) {
    for (size_t k = 0; k < tensor->pieces.size(); ++k) {
      const format::IndexPiece& piece = tensor->pieces[k];
      const bool hit = tensor->shape.empty() || (piece.offsets[0] < rows.end &&
                                                 piece.offsets[0] + piece.shape[0] > rows.begin);
      if (hit) pieces.emplace_back(tensor, k);
    }
  }
  at::parallel_for(0, static_cast<int64_t>(pieces.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) dir.verify_piece(pieces[i].first->name, pieces[i].second);
  });
}

at::Tensor read_rows(const std::shared_ptr<const format::CheckpointDir>& dir,
                     const format::IndexTensor& tensor, format::RowRange rows, bool verify,
                     bool mmap) {
  std::vector<int64_t> shape(tensor.shape.begin(), tensor.shape.end());
  const bool whole = shape.empty() || (rows.begin == 0 && rows.end == shape[0]);
  if (!shape.empty()) shape[0] = rows.size();
  const auto options = at::TensorOptions().dtype(to_scalar_type(tensor.dtype));
  for (size_t k = 0; mmap && k < tensor.pieces.size(); ++k) {
    const format::IndexPiece& piece = tensor.pieces[k];
    const bool exact = piece.shape == format::Shape(shape.begin(), shape.end()) &&
                       (piece.offsets.empty() || piece.offsets[0] == rows.begin);
    if (!exact || c10::multiply_integers(shape) == 0) continue;
    const format::ShardFile& file = dir->shard_file(piece.file);
    const auto bytes = file.data(file.tensor(tensor.name));
    if (reinterpret_cast<uintptr_t>(bytes.data()) % format::dtype_size(tensor.dtype) != 0) break;
    if (verify) dir->verify_piece(tensor.name, k);
    return at::from_blob(
        const_cast<std::byte*>(bytes.data()), shape, [dir](void*) {}, options);
  }
  // Straight to the CPU allocator: at::empty is a dispatcher call, paid 100,000+ times here.
  at::Tensor t = at::detail::empty_cpu(shape, to_scalar_type(tensor.dtype), /*pin_memory=*/false,
                                       std::nullopt);
  if (t.nbytes() == 0) return t;
  if (whole) {
    dir->read_full(tensor.name, t.data_ptr(), t.nbytes(), verify);
  } else {
    dir->read_rows(tensor.name, rows.begin, rows.end, t.data_ptr(), t.nbytes(), verify);
  }
  return t;
}

}  // namespace fsdp_ema::ops
