// Test helper: reference tensors and a checkpoint writer that shards them the way FSDP2 does
// (dim 0 split with torch.chunk semantics), shared by the GoogleTests and make_fixture.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "fsdp_ema/format/checkpoint_dir.h"
#include "fsdp_ema/format/index.h"
#include "fsdp_ema/format/shard_writer.h"

namespace fsdp_ema::format::testing {

struct RefTensor {
  std::string name;
  DType dtype;
  Shape shape;
  std::vector<std::byte> data;  // row-major, numel * element size

  int64_t row_bytes() const {
    int64_t n = static_cast<int64_t>(dtype_size(dtype));
    for (size_t d = 1; d < shape.size(); ++d) n *= shape[d];
    return n;
  }
};

// Deterministic bytes (a simple LCG), valid for every dtype (BOOL gets 0/1).
inline std::vector<std::byte> pattern_bytes(size_t n, uint32_t seed, DType dtype) {
  std::vector<std::byte> out(n);
  uint32_t x = seed * 2654435761u + 12345u;
  for (size_t i = 0; i < n; ++i) {
    x = x * 1664525u + 1013904223u;
    out[i] = static_cast<std::byte>(dtype == DType::kBool ? ((x >> 24) & 1) : (x >> 24));
  }
  return out;
}

inline RefTensor make_ref(std::string name, DType dtype, Shape shape, uint32_t seed) {
  RefTensor t{std::move(name), dtype, std::move(shape), {}};
  size_t n = dtype_size(dtype);
  for (int64_t s : t.shape) n *= static_cast<size_t>(s);
  t.data = pattern_bytes(n, seed, dtype);
  return t;
}

// A small model with the cases that matter: uneven splits, fewer rows than ranks, 0-dim, empty,
// every writable dtype.
inline std::vector<RefTensor> reference_model() {
  return {
      make_ref("layer.weight", DType::kF32, {7, 5}, 1),
      make_ref("layer.bias", DType::kBF16, {5}, 2),
      make_ref("embed", DType::kF16, {3, 4}, 3),  // fewer rows than 4 or 5 ranks
      make_ref("step", DType::kI64, {}, 4),       // 0-dim
      make_ref("empty", DType::kF32, {0, 3}, 5),  // no element
      make_ref("mask", DType::kBool, {6}, 6),
      make_ref("ids", DType::kI32, {10}, 7),
      make_ref("big.f64", DType::kF64, {9, 3, 2}, 8),
      make_ref("small.i16", DType::kI16, {4, 1}, 9),
      make_ref("small.i8", DType::kI8, {13}, 10),
      make_ref("small.u8", DType::kU8, {2, 2, 2}, 11),
      make_ref("one_row", DType::kF32, {1, 8}, 12),  // one rank holds it, the others nothing
  };
}

// The local tensors rank `rank` of `world` writes: the dim-0 chunk of every tensor that has
// rows there; 0-dim and empty tensors only on rank 0 (stored once).
inline std::vector<TensorToWrite> local_shards(const std::vector<RefTensor>& model, int64_t rank,
                                               int64_t world) {
  std::vector<TensorToWrite> out;
  for (const RefTensor& t : model) {
    size_t numel = 1;
    for (int64_t s : t.shape) numel *= static_cast<size_t>(s);
    TensorToWrite w;
    w.name = t.name;
    w.dtype = t.dtype;
    w.global_shape = t.shape;
    if (t.shape.empty() || numel == 0) {
      if (rank != 0) continue;
      w.shape = t.shape;
      w.offsets.assign(t.shape.size(), 0);
      w.host_data = t.data.empty() ? nullptr : t.data.data();
    } else {
      const RowRange r = chunk_rows(t.shape[0], rank, world);
      if (r.size() == 0) continue;
      w.shape = t.shape;
      w.shape[0] = r.size();
      w.offsets.assign(t.shape.size(), 0);
      w.offsets[0] = r.begin;
      w.host_data = t.data.data() + r.begin * t.row_bytes();
    }
    out.push_back(std::move(w));
  }
  return out;
}

// Writes every rank's shard file and then the index.
inline CheckpointIndex write_checkpoint(const std::string& dir, const std::vector<RefTensor>& model,
                                        int64_t world, WriteOptions options = {}) {
  std::vector<ShardDescription> shards(static_cast<size_t>(world));
  for (int64_t r = 0; r < world; ++r) {
    options.rank = r;
    options.world_size = world;
    write_shard_file(dir + "/" + shard_file_name(r, world), local_shards(model, r, world), options,
                     &shards[static_cast<size_t>(r)]);
  }
  CheckpointIndex index = build_index(shards, world);
  write_index(dir, index, /*overwrite=*/false, options.fsync);
  return index;
}

}  // namespace fsdp_ema::format::testing
